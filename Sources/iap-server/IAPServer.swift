import ArgumentParser
import CatalogPostgres
import CommandLineReporting
import ContentCatalog
import Foundation
import IAPProtocol
import PurchaseVerification

@main
struct IAPServer: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap-server",
        abstract: "The In-App Purchase content server: catalog, verified download grants, range delivery.",
        version: IAPContentVersion.current,
        subcommands: [Serve.self, Publish.self, Catalog.self, Check.self, Rollout.self, Rollback.self, Remove.self, Verify.self, Reconcile.self, GrantKeysCommand.self])
}

/// An environment variable, nil when unset or empty.
func env(_ name: String) -> String? {
    ProcessInfo.processInfo.environment[name].flatMap { $0.isEmpty ? nil : $0 }
}

/// A colon-separated list from the environment (`IAP_TRUST_ROOTS`, `IAP_CA_FILES`); empty when unset.
func envList(_ name: String) -> [String] {
    env(name)?.split(separator: ":").map(String.init) ?? []
}

/// The apps a command serves: each `--bundle-id` given, else IAP_BUNDLE_ID, either one repeated or
/// comma-separated, each checked; nil when neither says.
func bundlePolicy(_ flags: [String]) throws -> BundlePolicy? {
    // Spaces after a comma are the list's ("a, b"); any other whitespace is refused by the check,
    // as a stray space from an environment file always was.
    func split(_ text: String) -> [String] {
        text.split(separator: ",", omittingEmptySubsequences: false).enumerated().map { $0.offset == 0 ? String($0.element) : String($0.element.drop { $0 == " " }) }
    }
    let (ids, source) = flags.isEmpty ? (env("IAP_BUNDLE_ID").map(split) ?? [], "IAP_BUNDLE_ID") : (flags.flatMap(split), "--bundle-id")
    for id in ids {
        if let refusal = BundleIdentifier.refusal(id, from: source) { throw ValidationError(refusal) }
    }
    return ids.isEmpty ? nil : BundlePolicy(accepting: ids)
}

/// `--database` (or IAP_DATABASE_URL) and `--archives` (or IAP_ARCHIVES), shared by every command that opens the store.
struct StoreOptions: ParsableArguments {
    @Option(
        help:
            "postgres://user@host:5432/database, read as psql reads it (sslmode, sslrootcert; the password from the URL, PGPASSWORD or ~/.pgpass): keep the catalog, ledger and notifications in PostgreSQL (shared by replicas) instead of <data>/catalog.sqlite."
    )
    var database: String?
    @Option(help: "The archive folder, e.g. a mount every replica shares (default <data>/archives).") var archives: String?

    var databaseURL: String? { database ?? env("IAP_DATABASE_URL") }
    var archivesDirectory: String? { archives ?? env("IAP_ARCHIVES") }

    /// Opens the store; the caller closes its database when done.
    func open(data: String) async throws(CatalogError) -> ContentStore {
        try await ContentStore.open(dataDirectory: data, archivesDirectory: archivesDirectory, databaseURL: databaseURL)
    }

    /// Whether there is a catalog to open: PostgreSQL's always is (its schema is made on open),
    /// a data folder's only once `catalog.sqlite` is there.
    func hasCatalog(data: String) -> Bool {
        databaseURL != nil || FileManager.default.fileExists(atPath: SQLiteCatalogDatabase.path(in: data))
    }

    /// Runs `body` on the store and closes its database (PostgreSQL's connections) afterwards.
    /// `existing`: the catalog must be there already, for a command that changes published
    /// versions: a mistyped `--data` is said rather than made into an empty catalog.
    func withStore<T>(data: String, existing: Bool = false, _ body: (ContentStore) async throws(CatalogError) -> T) async throws(CatalogError) -> T {
        if existing, !hasCatalog(data: data) {
            throw CatalogError(
                .notFound, "\(data) holds no catalog (\(SQLiteCatalogDatabase.path(in: data))): pass the --data folder the server uses, or --database for PostgreSQL")
        }
        let store = try await open(data: data)
        do throws(CatalogError) {
            let result = try await body(store)
            await store.database.close()
            return result
        } catch {
            await store.database.close()
            throw error
        }
    }
}

/// Errors go to stderr with the exit code each subcommand documents.
let reporter = Reporter(tool: "iap-server")

/// `--environment`: which App Store environments' transactions are accepted.
enum EnvironmentChoice: String, ExpressibleByArgument, CaseIterable {
    case production, sandbox, both

    init?(argument: String) { self.init(rawValue: argument.lowercased()) }

    var policy: EnvironmentPolicy { EnvironmentPolicy(name: rawValue)! }
}

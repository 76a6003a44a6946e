import AppStoreServerAPI
import AppStoreServerClient
import ArgumentParser
import AsyncHTTPClient
import CatalogPostgres
import CommandLineReporting
import ContentArchive
import ContentCatalog
import ContentServer
import DurableFiles
import Foundation
import IAPProtocol
import Logging
import PurchaseVerification
import ReceiptVerification
import ServerStartup

@main
struct IAPServer: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap-server",
        abstract: "The In-App Purchase content server: catalog, verified download grants, range delivery.",
        version: IAPContentVersion.current,
        subcommands: [Serve.self, Publish.self, Catalog.self, Rollout.self, Rollback.self, Remove.self, Verify.self, Reconcile.self, GrantKeysCommand.self])
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

struct Serve: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Run the server.",
        discussion: """
            Every option can also come from the environment: \(ServerConfiguration.environmentVariables.map { "\($0.0) (\($0.1))" }.joined(separator: ", ")). \
            Apple Root CA - G3 is always trusted. SIGTERM or SIGINT stop accepting connections and let transfers in flight finish for up to 30 s.
            """)

    @Option(help: "The data folder (catalog.sqlite, archives/, grant-keys.json); created if missing.") var data: String?
    @OptionGroup var store: StoreOptions
    @Option(
        name: .customLong("advertise-url"),
        help: "This replica's URL for the other replicas (e.g. http://10.0.0.5:8080): without a shared --archives folder, they fetch the archives published here from it.")
    var advertiseURL: String?
    @Option(
        name: .customLong("ca-file"),
        help:
            "A certificate authority (PEM) trusted beside the system's for this server's own HTTPS requests: other replicas' --advertise-url and verifyReceipt; repeatable.")
    var caFiles: [String] = []
    @Option(name: .customLong("grant-keys"), help: "The grant key file every replica shares (default <data>/grant-keys.json; created with one key if missing).")
    var grantKeys: String?
    @Option(
        name: .customLong("bundle-id"),
        help: "The app's bundle identifier; repeat it or separate with commas for several apps of one developer account (their product identifiers never collide).")
    var bundleIds: [String] = []
    @Option(help: "The address to listen on: 127.0.0.1, 0.0.0.0 for all, ::1 or [::1] for IPv6.") var host: String?
    @Option(help: "The port to listen on (default 8080); 0 picks a free one.") var port: Int?
    @Option(name: .customLong("trust-root"), help: "Another trusted root certificate (DER or PEM), e.g. the sandbox's root.cer; repeatable.") var trustRoots: [String] = []
    @Option(help: "production, sandbox or both. App Review buys in the sandbox against production servers: use both there.") var environment: EnvironmentChoice?
    @Option(name: .customLong("token-ttl"), help: "Seconds a download URL stays valid (10 to 2592000, default 900).") var tokenTTL: Int?
    @Option(name: .customLong("admin-token-file"), help: "A file holding the bearer token for PUT /v1/admin/archives; without it the admin API is off.") var adminTokenFile: String?
    @Option(name: .customLong("public-url"), help: "The base of download URLs, e.g. https://content.example.com (default http://<host>:<port>).") var publicURL: String?
    @Option(name: .customLong("header-timeout"), help: "Seconds a client has to send a complete request head (default 30).") var headerTimeout: Int?
    @Option(name: .customLong("idle-timeout"), help: "Seconds a connection may send nothing between requests, or in the middle of a request body (default 60).") var idleTimeout: Int?
    @Option(
        name: .customLong("revocation-refresh"),
        help: "Seconds between full reloads of revocations other replicas wrote (default 2); with --database PostgreSQL announces each one at once anyway.")
    var revocationRefresh: Int?
    @Option(
        name: .customLong("event-loops"),
        help: "Threads serving connections (default: one per core). Fewer leave cores to a TLS proxy or database on the same machine; see docs/performance.md.")
    var eventLoops: Int?
    @Option(name: .customLong("port-file"), help: "Write the bound port to this file once listening (for scripts).") var portFile: String?
    @Flag(name: .customLong("allow-local-testing"), help: "Also accept Xcode and LocalTesting transactions.") var allowLocalTesting = false
    @Option(name: .customLong("receipt-verification"), help: "How StoreKit 1 app receipts are verified: local (libcrypto, the default), apple (verifyReceipt) or both (must agree).")
    var receiptVerification: ReceiptMode?
    @Option(name: .customLong("verify-receipt-url"), help: "Apple's production verifyReceipt URL (or a sandbox store's, for tests).") var verifyReceiptURL: String?
    @Option(name: .customLong("verify-receipt-sandbox-url"), help: "The sandbox verifyReceipt URL, asked when production answers 21007.")
    var verifyReceiptSandboxURL: String?
    @Option(name: .customLong("verify-receipt-timeout"), help: "Seconds one verifyReceipt request may take (default 15).") var verifyReceiptTimeout: Int?
    @Option(name: .customLong("receipt-shared-secret-file"), help: "A file holding the app-specific shared secret verifyReceipt wants for subscriptions.")
    var receiptSharedSecretFile: String?

    enum ReceiptMode: String, ExpressibleByArgument, CaseIterable {
        case local, apple, both
        var mode: ReceiptVerificationMode { ReceiptVerificationMode(rawValue: rawValue)! }
    }

    func validate() throws {
        for (flag, value) in [("--verify-receipt-url", verifyReceiptURL), ("--verify-receipt-sandbox-url", verifyReceiptSandboxURL)] {
            if let value, URL(string: value).map({ $0.scheme == "http" || $0.scheme == "https" }) != true {
                throw ValidationError("\(flag) \(value) is not an http(s) URL")
            }
        }
    }

    /// A whole number from its flag or else its environment variable, within `range`. A value
    /// that is not a number or is out of range is refused, naming both the flag and the variable:
    /// a container's `IAP_PORT=80a` must not quietly become the default port.
    func number(_ flag: Int?, _ variable: String, _ name: String, _ range: ClosedRange<Int>, _ what: String) throws -> Int? {
        guard let text = flag.map(String.init) ?? env(variable) else { return nil }
        guard let value = Int(text.trimmingCharacters(in: .whitespaces)), range.contains(value) else {
            throw ValidationError("\(name) (\(variable)) must be \(what) from \(range.lowerBound) to \(range.upperBound), not '\(text)'")
        }
        return value
    }

    /// A base URL from its flag or environment variable: http(s) with a host, no query or fragment,
    /// without a trailing slash (paths are appended to it). Refused naming both otherwise: a
    /// scheme left out would make every download URL handed out unusable.
    func baseURL(_ flag: String?, _ variable: String, _ name: String) throws -> String? {
        guard let text = flag ?? env(variable) else { return nil }
        var trimmed = text.trimmingCharacters(in: .whitespaces)
        while trimmed.hasSuffix("/") { trimmed.removeLast() }
        guard let url = URL(string: trimmed), url.scheme == "http" || url.scheme == "https", let host = url.host, !host.isEmpty,
            url.query == nil, url.fragment == nil
        else {
            throw ValidationError("\(name) (\(variable)) must be an http(s) URL with a host and no query, such as https://content.example.com, not '\(text)'")
        }
        return trimmed
    }

    /// A timeout from its flag or environment variable, checked.
    func timeout(_ flag: Int?, _ variable: String, _ name: String) throws -> Duration? {
        try number(flag, variable, name, 1...3600, "a number of seconds").map { .seconds($0) }
    }

    func run() async throws {
        signal(SIGXFSZ, SIG_IGN)  // a file-size limit then fails the write (answered 507) instead of killing the server
        guard let dataDirectory = data ?? env("IAP_DATA") else { throw ValidationError("--data (or IAP_DATA) is required: the folder for the catalog and archives") }
        guard let bundles = try bundlePolicy(bundleIds) else {
            throw ValidationError("--bundle-id (or IAP_BUNDLE_ID) is required: the app's bundle identifier (repeat it, or separate them with commas, for several apps)")
        }
        var configuration = ServerConfiguration(dataDirectory: dataDirectory, bundles: bundles)
        configuration.databaseURL = store.databaseURL
        configuration.archivesDirectory = store.archivesDirectory
        configuration.advertiseURL = try baseURL(advertiseURL, "IAP_ADVERTISE_URL", "--advertise-url")
        configuration.additionalTrustRootFiles = caFiles + envList("IAP_CA_FILES")
        configuration.grantKeysPath = grantKeys ?? env("IAP_GRANT_KEYS") ?? configuration.grantKeysPath
        configuration.host = URLHost.bare(host ?? env("IAP_HOST") ?? configuration.host)
        if let value = try number(port, "IAP_PORT", "--port", 0...65535, "a port number") { configuration.port = value }
        let environmentName = env("IAP_ENVIRONMENT") ?? "production"
        guard var policy = (environment ?? EnvironmentChoice(argument: environmentName))?.policy else {
            throw ValidationError("IAP_ENVIRONMENT must be production, sandbox or both, not '\(environmentName)'")
        }
        if allowLocalTesting { policy = policy.allowingLocalTesting() }
        configuration.environments = policy
        let rootPaths = trustRoots + envList("IAP_TRUST_ROOTS")
        do {
            for path in rootPaths { configuration.trustRoots.append(try AppleRoots.load(path: path)) }
        } catch { throw reporter.failure(error) }
        // Download URLs are meant to be short-lived; a month is the most any use here needs.
        if let ttl = try number(tokenTTL, "IAP_TOKEN_TTL", "--token-ttl", 10...2_592_000, "a number of seconds") { configuration.tokenTTL = .seconds(ttl) }
        if let file = adminTokenFile ?? env("IAP_ADMIN_TOKEN_FILE") {
            guard let token = try? String(contentsOfFile: file, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines), token.count >= 16 else {
                throw reporter.failure("invalid-input", "cannot read an admin token of at least 16 characters from \(file)")
            }
            configuration.adminToken = token
        }
        configuration.publicURL = try baseURL(publicURL, "IAP_PUBLIC_URL", "--public-url")
        let modeName = env("IAP_RECEIPT_VERIFICATION") ?? "local"
        guard let mode = receiptVerification ?? ReceiptMode(rawValue: modeName) else {
            throw ValidationError("IAP_RECEIPT_VERIFICATION must be local, apple or both, not '\(modeName)'")
        }
        configuration.receiptVerification = mode.mode
        configuration.verifyReceiptURL = verifyReceiptURL ?? env("IAP_VERIFY_RECEIPT_URL") ?? configuration.verifyReceiptURL
        configuration.verifyReceiptSandboxURL = verifyReceiptSandboxURL ?? env("IAP_VERIFY_RECEIPT_SANDBOX_URL") ?? configuration.verifyReceiptSandboxURL
        if let seconds = try timeout(verifyReceiptTimeout, "IAP_VERIFY_RECEIPT_TIMEOUT", "--verify-receipt-timeout") { configuration.verifyReceiptTimeout = seconds }
        if let file = receiptSharedSecretFile ?? env("IAP_RECEIPT_SHARED_SECRET_FILE") {
            guard let secret = try? String(contentsOfFile: file, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines), !secret.isEmpty else {
                throw reporter.failure("invalid-input", "cannot read the shared secret from \(file)")
            }
            configuration.receiptSharedSecret = secret
        }
        if let seconds = try timeout(headerTimeout, "IAP_HEADER_TIMEOUT", "--header-timeout") { configuration.headerTimeout = seconds }
        if let seconds = try timeout(idleTimeout, "IAP_IDLE_TIMEOUT", "--idle-timeout") { configuration.idleTimeout = seconds }
        if let seconds = try timeout(revocationRefresh, "IAP_REVOCATION_REFRESH", "--revocation-refresh") { configuration.revocationRefresh = seconds }
        if let loops = try number(eventLoops, "IAP_EVENT_LOOPS", "--event-loops", 1...1024, "a number of threads") { configuration.eventLoops = loops }
        var logger = Logger(label: "iap-server")
        logger.logLevel = env("LOG_LEVEL").flatMap(Logger.Level.init(rawValue:)) ?? .info
        if configuration.publicURL == nil && ["0.0.0.0", "::"].contains(configuration.host) {
            logger.warning(
                "download URLs will name http://\(URLHost.inURL(configuration.host)):<port>, which no device can reach: give --public-url (IAP_PUBLIC_URL), the address devices use, such as https://content.example.com"
            )
        }
        for (path, what) in [
            (configuration.grantKeysPath, "the grant keys (whoever reads them can make download URLs)"),
            (adminTokenFile ?? env("IAP_ADMIN_TOKEN_FILE"), "the admin token"),
            (receiptSharedSecretFile ?? env("IAP_RECEIPT_SHARED_SECRET_FILE"), "the receipt shared secret"),
        ] {
            if let path, let warning = SecretFile.exposure(path, holding: what) { logger.warning("\(warning)") }
        }
        if let raised = OpenFileLimit.raiseToHardLimit(), raised.after > raised.before {
            logger.info("open-file limit raised to the hard limit", metadata: ["from": "\(raised.before)", "to": "\(raised.after)"])
        }
        let portFile = self.portFile
        let host = configuration.host
        // Which apps and environments, so a replica started with the wrong list is seen at once.
        let serving = "for \(configuration.bundles) (\(configuration.environments))"
        do {
            try await ContentServerApp.run(configuration: configuration, logger: logger) { port in
                Console.out("iap-server listening on http://\(URLHost.inURL(host)):\(port) \(serving)\n")
                if let portFile { try? String(port).write(toFile: portFile, atomically: true, encoding: .utf8) }
            }
        } catch let error as CatalogError {
            throw reporter.failure(error)
        } catch let error as ServerStartError {
            throw reporter.failure(error)
        }
    }
}

struct Publish: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Publish an archive into the catalog (the same checks as PUT /v1/admin/archives).",
        discussion:
            "Exit codes: 0 published (or identical bytes already published), 1 invalid archive, 2 version conflict, 3 storage failure, 128 + N stopped by signal N (nothing is published, and the partial copy is removed)."
    )

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The archive (<id>-<version>.zip); its manifest beside it is checked too.") var archive: String
    @Option(help: "The manifest (default: beside the archive, if present).") var manifest: String?
    @Option(help: "Stage the version for this percentage of purchases (1-100; default 100: every purchase).") var rollout: Int?
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        // The copy into the store is removed if the command is stopped part-way.
        let handlers = Interruption.removeUnfinishedFilesOnStop(tool: "iap-server")
        defer { withExtendedLifetime(handlers) {} }
        do throws(CatalogError) {
            let beside = ArchiveVerifier.manifestBeside(archive)
            let manifestPath = manifest ?? (FileManager.default.fileExists(atPath: beside) ? beside : nil)
            var decoded: ArchiveManifest?
            if let manifestPath {
                do { decoded = try ArchiveManifest.load(path: manifestPath) } catch { throw CatalogError(.invalidArchive, error.message) }
            }
            let chosen = decoded
            let outcome = try await storeOptions.withStore(data: data) { store throws(CatalogError) in
                try await store.publish(archiveAt: archive, manifest: chosen, rolloutPercent: rollout)
            }
            switch outcome {
            case .published(let v):
                print("published \(v.productId) \(v.contentVersion) (\(v.size) bytes, sha256 \(v.sha256))\(v.rolloutPercent.map { ", staged for \($0)% of purchases" } ?? "")")
            case .unchanged(let v): print("unchanged: \(v.productId) \(v.contentVersion) is already published with these bytes")
            }
        } catch {
            let code: Int32 =
                switch error.code {
                case .invalidArchive, .notFound: 1
                case .conflict: 2
                case .storage: 3
                }
            throw reporter.failure(error, exitCode: code)
        }
    }
}

/// Exit codes of the catalog commands: 1 invalid input or unknown version, 3 storage.
func catalogFailure(_ error: CatalogError) -> Error {
    reporter.failure(error, exitCode: error.code == .storage ? 3 : 1)
}

struct Rollout: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Stage a published version for a percentage of purchases, widen it, or promote it to all.",
        discussion: """
            Which purchases get a staged version is stable by original transaction id: widening keeps those \
            that have it. Takes effect with the next grant, on every replica sharing the data folder. \
            Exit codes: 0 done, 1 unknown version or invalid percentage, 3 storage failure.
            """)

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The product identifier.") var productId: String
    @Argument(help: "The content version.") var contentVersion: String
    @Option(help: "The share of purchases, 1-100.") var percent: Int?
    @Flag(help: "Give the version to every purchase (the same as --percent 100).") var promote = false
    @Flag(name: .customLong("allow-unserved"), help: "Narrow it even if some purchases are then served no version at all.")
    var allowUnserved = false
    @OptionGroup var storeOptions: StoreOptions

    func validate() throws {
        guard (percent != nil) != promote else { throw ValidationError("give either --percent <1-100> or --promote") }
    }

    func run() async throws {
        do throws(CatalogError) {
            let v = try await storeOptions.withStore(data: data, existing: true) { store throws(CatalogError) in
                try await store.setRollout(productId: productId, contentVersion: contentVersion, percent: promote ? 100 : percent!, allowingUnserved: allowUnserved)
            }
            print("\(v.productId) \(v.contentVersion): \(v.rolloutPercent.map { "staged for \($0)% of purchases" } ?? "every purchase")")
        } catch {
            throw catalogFailure(error)
        }
    }
}

struct Rollback: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Roll a published version back: from the next grant on, each purchase gets the newest version still served to it.",
        discussion: """
            Grants made before stay valid until they expire (--token-ttl). Refused when the version is the last \
            one served to some purchases (they would get no content), unless --allow-unserved. \
            Exit codes: 0 done, 1 unknown version or refused, 3 storage failure.
            """)

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The product identifier.") var productId: String
    @Argument(help: "The content version.") var contentVersion: String
    @Flag(name: .customLong("allow-unserved"), help: "Roll it back even if some purchases are then served no version at all.")
    var allowUnserved = false
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        do throws(CatalogError) {
            let v = try await storeOptions.withStore(data: data, existing: true) { store throws(CatalogError) in
                try await store.rollBack(productId: productId, contentVersion: contentVersion, allowingUnserved: allowUnserved)
            }
            print("\(v.productId) \(v.contentVersion): rolled back")
        } catch {
            throw catalogFailure(error)
        }
    }
}

struct Remove: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Remove a rolled-back version: its archive and manifest are deleted, and its number is never served or published again.",
        discussion: """
            Roll the version back first (iap-server rollback): a version still served to some purchases is refused. \
            Grants made before fail from then on (404 no-content); iap-fetch gets a new grant on its next run. A running \
            server closes the files it kept open within seconds; replicas with archive folders of their own delete their \
            copies when they next read the catalog. Removing a removed version again only retries deleting its files. \
            Exit codes: 0 done, 1 unknown version or refused, 3 storage failure.
            """)

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The product identifier.") var productId: String
    @Argument(help: "The content version.") var contentVersion: String
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        do throws(CatalogError) {
            let removal = try await storeOptions.withStore(data: data, existing: true) { store throws(CatalogError) in
                try await store.remove(productId: productId, contentVersion: contentVersion)
            }
            let freed = removal.freedBytes > 0 ? "deleted \(removal.freedBytes) bytes of archive and manifest" : "its files were gone already"
            print("\(productId) \(contentVersion): removed (\(freed)); the version number stays taken")
        } catch {
            throw catalogFailure(error)
        }
    }
}

struct Catalog: AsyncParsableCommand {
    static let configuration = CommandConfiguration(abstract: "List published products and versions.")

    @Option(help: "The server's data folder.") var data: String
    @Flag(help: "Print JSON.") var json = false
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        do {
            // Listing only looks: a data folder without a catalog (a mistyped --data) is not made.
            let catalog: [(productId: String, versions: [PublishedVersion])]
            if !storeOptions.hasCatalog(data: data) {
                catalog = []
            } else {
                catalog = try await storeOptions.withStore(data: data) { store throws(CatalogError) in try await store.catalog() }
            }
            if json {
                let encoder = JSONEncoder()
                encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
                encoder.dateEncodingStrategy = .iso8601
                struct Entry: Encodable { let productId: String; let versions: [PublishedVersion] }
                print(String(decoding: try encoder.encode(catalog.map { Entry(productId: $0.productId, versions: $0.versions) }), as: UTF8.self))
                return
            }
            if catalog.isEmpty { print("nothing published yet: iap-server publish --data \(data) <archive.zip>") }
            for (product, versions) in catalog {
                let served = ContentStore.servedShare(versions)
                print(product + (served < 100 ? "  (\(100 - served)% of purchases are served no version: rollout --promote one)" : ""))
                for v in versions {
                    let state =
                        v.removedAt.map { "  removed \($0.formatted(.iso8601))" } ?? v.rolledBackAt.map { "  rolled back \($0.formatted(.iso8601))" }
                        ?? v.rolloutPercent.map { "  staged: \($0)% of purchases" } ?? ""
                    print("  \(v.contentVersion)  \(v.size) bytes  sha256 \(v.sha256.prefix(16))…  published \(v.publishedAt.formatted(.iso8601))\(state)")
                }
            }
        } catch let error as CatalogError {
            throw reporter.failure(error, exitCode: 3)
        }
    }
}

struct Verify: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Verify signed data (a transaction, renewal info, a notification's signedPayload, or a StoreKit 1 app receipt) and print it as JSON.",
        discussion: """
            Exit codes: 0 verified, 1 refused (the message says which check failed), 64 usage error. \
            Apple Root CA - G3 (signed data) and Apple Inc. Root (receipts) are always trusted; add the sandbox's \
            root.cer or receipt-root.cer with --trust-root.
            """)

    @Argument(help: "A file holding the JWS, {\"signedPayload\": \"...\"}, or an app receipt (its bytes or base64); - for standard input.")
    var file: String

    @Option(name: .customLong("bundle-id"), help: "The app's bundle identifier (or IAP_BUNDLE_ID); repeat it or separate with commas to accept any of several apps.")
    var bundleIds: [String] = []

    @Option(name: .customLong("trust-root"), help: "Another trusted root certificate (DER or PEM); repeatable.")
    var trustRoots: [String] = []

    @Option(help: "production, sandbox or both (App Review uses sandbox against production servers).")
    var environment: EnvironmentChoice = .production

    @Flag(name: .customLong("allow-local-testing"), help: "Also accept Xcode and LocalTesting environments.")
    var allowLocalTesting = false

    func validate() throws {
        guard try bundlePolicy(bundleIds) != nil else { throw ValidationError("--bundle-id (or IAP_BUNDLE_ID) is required: the app's bundle identifier") }
    }

    func run() async throws {
        guard let bundles = try bundlePolicy(bundleIds) else { throw ValidationError("--bundle-id (or IAP_BUNDLE_ID) is required") }
        var policy = environment.policy
        if allowLocalTesting { policy = policy.allowingLocalTesting() }
        do {
            var roots = [AppleRoots.rootCAG3]
            for path in trustRoots { roots.append(try AppleRoots.load(path: path)) }
            let verifier = SignedDataVerifier(configuration: .init(bundles: bundles, trustRoots: roots, environments: policy))
            let input = try readInput()
            if let receipt = Self.receipt(in: input) {
                let receiptVerifier = try ReceiptVerifier(bundles: bundles, trustRoots: Array(roots.dropFirst()), environments: policy)
                let decoded = try receiptVerifier.verify(receipt)
                let purchases: [Any] = try decoded.transactions.map { transaction in
                    var object = try jsonObject(transaction) as? [String: Any] ?? [:]
                    object["entitlement"] = describe(entitlement(for: transaction, configuration: verifier.configuration))
                    return object
                }
                let output: [String: Any] = ["kind": "receipt", "payload": try jsonObject(decoded), "purchases": purchases]
                let data = try JSONSerialization.data(withJSONObject: output, options: [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes])
                print(String(decoding: data, as: UTF8.self))
                return
            }
            let token = Self.token(in: input)
            let output: [String: Any]
            switch try await verifier.verifyAny(token) {
            case .transaction(let transaction):
                output = [
                    "kind": "transaction", "payload": try jsonObject(transaction),
                    "entitlement": describe(entitlement(for: transaction, configuration: verifier.configuration)),
                ]
            case .renewalInfo(let info):
                output = ["kind": "renewalInfo", "payload": try jsonObject(info)]
            case .notification(let notification, let transaction):
                var object: [String: Any] = ["kind": "notification", "payload": try jsonObject(notification)]
                if let transaction { object["transaction"] = try jsonObject(transaction) }
                output = object
            }
            let data = try JSONSerialization.data(withJSONObject: output, options: [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes])
            print(String(decoding: data, as: UTF8.self))
        } catch let error as VerificationError {
            throw reporter.failure(VerificationError(error.code, "refused (\(error.code.rawValue)): \(error.message)"))
        }
    }

    private func readInput() throws -> Data {
        if file == "-" { return FileHandle.standardInput.readDataToEndOfFile() }
        guard let data = FileManager.default.contents(atPath: file) else { throw ValidationError("cannot read \(file): check the path") }
        return data
    }

    /// The input's bytes when it is an app receipt (PKCS#7, raw or base64), else nil.
    static func receipt(in data: Data) -> [UInt8]? {
        if data.first == 0x30 { return Array(data) }
        let text = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        guard !text.contains("."), !text.hasPrefix("{"), let decoded = Data(base64Encoded: text, options: .ignoreUnknownCharacters), decoded.first == 0x30 else {
            return nil
        }
        return Array(decoded)
    }

    /// The JWS in the input, bare or as `{"signedPayload": ...}`.
    static func token(in data: Data) -> String {
        let text = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        if text.hasPrefix("{"), let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
            let payload = object["signedPayload"] as? String
        {
            return payload
        }
        return text
    }

    private func jsonObject<T: Encodable>(_ value: T) throws -> Any {
        let encoder = JSONEncoder()
        encoder.dateEncodingStrategy = .millisecondsSince1970
        return try JSONSerialization.jsonObject(with: encoder.encode(value))
    }

    private func describe(_ decision: EntitlementDecision) -> [String: Any] {
        switch decision {
        case .granted: ["granted": true]
        case .denied(let reason): ["granted": false, "reason": reason.code, "message": reason.description]
        }
    }
}

struct Reconcile: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Apply the refunds and revocations the server missed: reads Apple's notification history since a date and applies each notification as if it had been POSTed.",
        discussion: """
            Run it after downtime (or on a schedule); it is safe to repeat: a notification the ledger holds is skipped. \
            Every payload is verified like a POSTed one (chain, bundle id, environment). A running server picks up \
            the revocations within seconds. The API key is an App Store Connect In-App Purchase key (or one from iap-sandbox api-key). \
            Exit codes: 0 done, 1 some payloads failed verification (the rest applied), 2 the API could not be asked, 3 storage failure.
            """)

    @Option(help: "The server's data folder.") var data: String?
    @OptionGroup var storeOptions: StoreOptions
    @Option(name: .customLong("bundle-id"), help: "The app's bundle identifier (one: Apple's API answers for one app at a time).") var bundleId: String?
    @Option(help: "Start of the window: ISO 8601 (2026-11-20T00:00:00Z or 2026-11-20); Apple keeps 180 days.") var since: String
    @Option(help: "End of the window (ISO 8601; default now).") var until: String?
    @Option(name: .customLong("key-file"), help: "The API key's .p8 file (env IAP_API_KEY_FILE).") var keyFile: String?
    @Option(name: .customLong("key-id"), help: "The API key's id (env IAP_API_KEY_ID).") var keyId: String?
    @Option(name: .customLong("issuer-id"), help: "The team's issuer id (env IAP_API_ISSUER_ID).") var issuerId: String?
    @Option(name: .customLong("api-url"), help: "The API's base URL, e.g. a sandbox's http://127.0.0.1:9090 (env IAP_API_URL; default Apple's host for --environment).")
    var apiURL: String?
    @Option(name: .customLong("trust-root"), help: "Another trusted root certificate (DER or PEM); repeatable.") var trustRoots: [String] = []
    @Option(help: "Seconds one API request may take, connecting included.") var timeout = 30
    @Option(
        name: .customLong("ca-file"),
        help: "A certificate authority (PEM) trusted beside the system's for the API's HTTPS: a proxy that inspects TLS, or a sandbox behind a private one; repeatable.")
    var caFiles: [String] = []
    @Option(help: "production, sandbox or both: which environments' notifications are accepted (and, without --api-url, which of Apple's hosts are asked).")
    var environment: EnvironmentChoice?
    @Flag(help: "Print the report as JSON.") var json = false

    static func date(_ text: String, _ flag: String) throws -> Date {
        if let date = try? Date(text, strategy: .iso8601) { return date }
        if let date = try? Date(text, strategy: Date.ISO8601FormatStyle().year().month().day()) { return date }
        throw ValidationError("\(flag) \(text) is not an ISO 8601 date such as 2026-11-20T00:00:00Z or 2026-11-20")
    }

    func validate() throws {
        let start = try Self.date(since, "--since")
        let end = try until.map { try Self.date($0, "--until") } ?? Date()
        guard start < end else { throw ValidationError("--since must be before --until (or now)") }
        let oldest = Date().addingTimeInterval(-Double(StoreAPIRoute.notificationHistoryDays) * 86_400)
        guard (1...600).contains(timeout) else { throw ValidationError("--timeout must be between 1 and 600 seconds") }
        guard start >= oldest else { throw ValidationError("--since is more than \(StoreAPIRoute.notificationHistoryDays) days ago: Apple keeps no older notification history") }
        if let url = apiURL ?? env("IAP_API_URL"), URL(string: url).map({ $0.scheme == "http" || $0.scheme == "https" }) != true {
            throw ValidationError("--api-url \(url) is not an http(s) URL")
        }
    }

    func run() async throws {
        guard let dataDirectory = data ?? env("IAP_DATA") else { throw ValidationError("--data (or IAP_DATA) is required: the server's data folder") }
        guard let bundles = try bundlePolicy(bundleId.map { [$0] } ?? []) else { throw ValidationError("--bundle-id (or IAP_BUNDLE_ID) is required") }
        // An API token names one app (its `bid` claim), so the history is asked app by app.
        guard bundles.accepted.count == 1, let bundle = bundles.accepted.first else {
            throw ValidationError(
                "IAP_BUNDLE_ID names \(bundles.accepted.count) apps, and Apple's API answers for one app at a time: run reconcile once per app, with --bundle-id")
        }
        guard let keyFile = keyFile ?? env("IAP_API_KEY_FILE"), let keyId = keyId ?? env("IAP_API_KEY_ID"),
            let issuerId = issuerId ?? env("IAP_API_ISSUER_ID")
        else {
            throw ValidationError("--key-file, --key-id and --issuer-id (or IAP_API_KEY_FILE, IAP_API_KEY_ID, IAP_API_ISSUER_ID) are required: an In-App Purchase API key")
        }
        let environmentName = env("IAP_ENVIRONMENT") ?? "production"
        guard let choice = environment ?? EnvironmentChoice(argument: environmentName) else {
            throw ValidationError("IAP_ENVIRONMENT must be production, sandbox or both, not '\(environmentName)'")
        }
        let start = try Self.date(since, "--since")
        let end = try until.map { try Self.date($0, "--until") } ?? Date()
        if let warning = SecretFile.exposure(keyFile, holding: "an App Store Server API key") { Console.err("iap-server: warning: \(warning)\n") }
        let key: StoreAPIKey
        do { key = try StoreAPIKey(keyId: keyId, issuerId: issuerId, bundleId: bundle, pemFile: keyFile) } catch {
            throw reporter.failure(error)
        }
        let urls: [String] =
            if let url = apiURL ?? env("IAP_API_URL") { [url] } else {
                switch choice {
                case .production: [StoreAPIRoute.productionURL]
                case .sandbox: [StoreAPIRoute.sandboxURL]
                case .both: [StoreAPIRoute.productionURL, StoreAPIRoute.sandboxURL]
                }
            }
        let http: HTTPClient
        do {
            http = OutboundHTTP.client(try OutboundHTTP.trust(caFiles + envList("IAP_CA_FILES")))
        } catch {
            throw reporter.failure(error)
        }
        let outcome: Result<Reconciler.Report, any Error>
        do {
            var roots = [AppleRoots.rootCAG3]
            for path in trustRoots + envList("IAP_TRUST_ROOTS") { roots.append(try AppleRoots.load(path: path)) }
            let verifier = SignedDataVerifier(configuration: .init(bundleId: bundle, trustRoots: roots, environments: choice.policy))
            let store = try await storeOptions.open(data: dataDirectory)
            let reconciler = Reconciler(store: store, verifier: verifier, clients: urls.map { StoreAPIClient(baseURL: $0, key: key, timeout: .seconds(timeout), httpClient: http) })
            do {
                outcome = .success(try await reconciler.run(since: start, until: end))
            } catch {
                outcome = .failure(error)
            }
            await store.database.close()
        } catch {
            outcome = .failure(error)
        }
        try? await http.shutdown()
        let report: Reconciler.Report
        do {
            report = try outcome.get()
        } catch let error as VerificationError {
            throw reporter.failure(error)
        } catch let error as CatalogError {
            throw reporter.failure(error, exitCode: 3)
        } catch let error as ReconcileError {
            throw reporter.failure(error, exitCode: error.code == .api ? 2 : 3)
        }
        if json {
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
            print(String(decoding: try encoder.encode(report), as: UTF8.self))
        } else {
            print(
                "reconciled \(start.formatted(.iso8601))...\(end.formatted(.iso8601)): \(report.fetched) notifications, \(report.applied) applied, \(report.duplicates) already known"
            )
            for id in report.revoked { print("  revoked   \(id)") }
            for id in report.restored { print("  restored  \(id)") }
            for reason in report.refused { print("  REFUSED   \(reason)") }
        }
        if !report.refused.isEmpty { throw ExitCode(1) }
    }
}

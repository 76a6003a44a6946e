import AppStoreServerAPI
import AppStoreServerClient
import ArgumentParser
import AsyncHTTPClient
import CommandLineReporting
import ContentCatalog
import ContentServer
import DurableFiles
import Foundation
import PurchaseVerification

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

import ArgumentParser
import CommandLineReporting
import ContentCatalog
import ContentServer
import DurableFiles
import Foundation
import IAPProtocol
import Logging
import PurchaseVerification
import ServerStartup

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
    @Option(
        name: .customLong("idle-timeout"),
        help:
            "Seconds a connection may send nothing between requests, or in the middle of a request body, and a client may take nothing of a response (default 60)."
    )
    var idleTimeout: Int?
    @Option(
        name: .customLong("drain-timeout"),
        help: "Seconds SIGTERM waits for transfers in flight before closing them and exiting (default 30); keep it below your supervisor's kill timeout.")
    var drainTimeout: Int?
    @Option(
        name: .customLong("revocation-refresh"),
        help: "Seconds between looks for revocations and catalog changes other replicas wrote (default 2); with --database PostgreSQL announces each one at once anyway.")
    var revocationRefresh: Int?
    @Option(
        name: .customLong("archive-check-interval"),
        help:
            "Seconds between reads of every published archive on this replica, one at a time, to find bytes damaged on disk at their published size (default 86400, a day; 0: never). A damaged archive is then refused (503 archive-damaged) and named by /readyz until it is published again; a replica with its own archive folder fetches a good copy from the replica that received it."
    )
    var archiveCheckInterval: Int?
    @Option(
        name: .customLong("notification-retention"),
        help:
            "Days stored App Store notifications are kept (default 400; at least 181, since reconcile replays 180 days of Apple's history); 0 keeps them for ever. What they did to access stays in the revocation ledger."
    )
    var notificationRetention: Int?
    @Option(
        name: .customLong("event-loops"),
        help:
            "Threads serving connections (default: one per core), and as many sending bodies of 1 MiB or more. Fewer leave cores to a TLS proxy or database on the same machine; see docs/performance.md."
    )
    var eventLoops: Int?
    @Option(
        name: .customLong("loopback-congestion-control"),
        help:
            "TCP congestion control for the connections that cross no link: all of them when listening on a loopback address (127.0.0.1, ::1), as behind a proxy on the same machine, else those from this machine. Default: cubic, which does not pace, where the system lets this process set it; 'system' keeps net.ipv4.tcp_congestion_control. With BBR and no fq queueing the kernel paces loopback segments with timers: a 1 GiB download took 6x the server's CPU at under half the speed; see docs/performance.md."
    )
    var loopbackCongestionControl: String?
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
        if let seconds = try timeout(drainTimeout, "IAP_DRAIN_TIMEOUT", "--drain-timeout") { configuration.drainTimeout = seconds }
        if let seconds = try timeout(revocationRefresh, "IAP_REVOCATION_REFRESH", "--revocation-refresh") { configuration.revocationRefresh = seconds }
        if let seconds = try number(archiveCheckInterval, "IAP_ARCHIVE_CHECK_INTERVAL", "--archive-check-interval", 0...31_536_000, "a number of seconds") {
            configuration.archiveCheckInterval = seconds == 0 ? nil : .seconds(seconds)
        }
        if let days = try number(notificationRetention, "IAP_NOTIFICATION_RETENTION", "--notification-retention", 0...36_500, "a number of days") {
            let minimum = Int(ServerConfiguration.minimumNotificationRetention.components.seconds / 86_400)
            guard days == 0 || days >= minimum else {
                throw ValidationError(
                    "--notification-retention (IAP_NOTIFICATION_RETENTION) must be 0 (for ever) or at least \(minimum) days, not \(days): reconcile replays 180 days of Apple's notification history, and a notification deleted sooner would be applied again"
                )
            }
            configuration.notificationRetention = days == 0 ? nil : .seconds(days * 86_400)
        }
        if let loops = try number(eventLoops, "IAP_EVENT_LOOPS", "--event-loops", 1...1024, "a number of threads") { configuration.eventLoops = loops }
        if let name = loopbackCongestionControl ?? env("IAP_LOOPBACK_CONGESTION_CONTROL") {
            // The kernel's names: up to 15 characters (TCP_CA_NAME_MAX), lower-case letters, digits, '_'.
            guard name == "system" || (1...15).contains(name.count) && name.allSatisfy({ $0.isASCII && ($0.isLowercase || $0.isNumber || $0 == "_") }) else {
                throw ValidationError(
                    "--loopback-congestion-control (IAP_LOOPBACK_CONGESTION_CONTROL) must be 'system' or an algorithm's name such as cubic or reno, not '\(name)'")
            }
            configuration.loopbackCongestionControl = name == "system" ? .system : .required(name)
        }
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

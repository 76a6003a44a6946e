import AppStoreServerAPI
import Foundation
import PurchaseVerification
import X509

/// Everything `iap-server serve` needs; each setting also comes from an environment variable
/// (for containers), flags winning.
public struct ServerConfiguration: Sendable {
    /// Holds `catalog.sqlite`, `archives/`, `grant-keys.json`.
    public var dataDirectory: String
    /// `postgres://user:password@host:port/database`: the catalog, ledger and notifications live
    /// there instead of `catalog.sqlite`, shared by every replica given the same URL.
    public var databaseURL: String?
    /// Where archives live (default `<data>/archives`): a folder every replica mounts, for several machines.
    public var archivesDirectory: String?
    /// The URL other replicas reach this one at (e.g. http://10.0.0.5:8080): archives published
    /// here are recorded with it, and replicas without a shared archive folder fetch them from it.
    public var advertiseURL: String?
    /// Certificate authorities (PEM files) trusted beside the system's for the server's own HTTPS
    /// requests: other replicas' `--advertise-url` and `verifyReceipt`.
    public var additionalTrustRootFiles: [String] = []
    /// The grant key file; replicas given the same one accept each other's download URLs.
    public var grantKeysPath: String
    /// The apps served: one bundle identifier, or several apps of one developer account.
    public var bundles: BundlePolicy
    public var host: String = "127.0.0.1"
    /// 0 picks a free port.
    public var port: Int = 8080
    public var trustRoots: [Certificate] = [AppleRoots.rootCAG3]
    public var environments: EnvironmentPolicy = .production
    /// How long a download URL stays valid.
    public var tokenTTL: Duration = .seconds(900)
    /// The admin bearer token; nil or empty disables the admin API (`iap-server serve` asks for
    /// at least 16 characters).
    public var adminToken: String?
    /// The base of the download URLs handed out, e.g. https://content.example.com; defaults to
    /// http://<host>:<port>.
    public var publicURL: String?
    /// Connections that send nothing for this long between requests, or in the middle of a
    /// request body (as nginx's `client_body_timeout`), are closed.
    public var idleTimeout: Duration = .seconds(60)
    /// A request head must be complete within this long of the connection opening or of the
    /// previous response ending (a slow-loris client is cut off), like nginx's `client_header_timeout`.
    public var headerTimeout: Duration = .seconds(30)
    /// How long SIGTERM waits for transfers in flight before closing them.
    public var drainTimeout: Duration = .seconds(30)
    /// Largest JSON request body.
    public var maxJSONBody = 256 * 1024
    /// How app receipts are verified: here (libcrypto), by Apple's `verifyReceipt`, or both.
    public var receiptVerification: ReceiptVerificationMode = .local
    /// `verifyReceipt` URLs: production is asked first, the sandbox on 21007.
    public var verifyReceiptURL = VerifyReceiptStatus.productionURL
    public var verifyReceiptSandboxURL = VerifyReceiptStatus.sandboxURL
    /// How long one `verifyReceipt` request may take, connecting included.
    public var verifyReceiptTimeout: Duration = .seconds(15)
    /// The app-specific shared secret `verifyReceipt` wants for subscriptions.
    public var receiptSharedSecret: String?
    /// How often revocations written by other replicas are picked up.
    public var revocationRefresh: Duration = .seconds(2)
    /// How often every published archive on this replica is read through to find bytes damaged
    /// on disk at their published size, which `stat` cannot tell (nil: never). The first pass
    /// starts after this long or ten minutes, whichever is sooner, not at start: replicas
    /// restarted together by a deploy do not all read their stores at once.
    public var archiveCheckInterval: Duration? = .seconds(86_400)
    /// How long stored App Store notifications are kept (nil: for ever). They only serve to
    /// apply each once and as a record; what they did to access stays in the revocation ledger.
    /// Never under ``minimumNotificationRetention``.
    public var notificationRetention: Duration? = .seconds(400 * 86_400)
    /// Apple's notification history, which `reconcile` replays, reaches back 180 days: a
    /// notification kept longer than that is never applied twice.
    public static let minimumNotificationRetention: Duration = .seconds(181 * 86_400)
    /// Threads that serve connections (NIO event loops); nil is one per core. Fewer leave cores to
    /// what shares the machine (a TLS proxy in front, the database): on two cores shared with the
    /// load generator, one loop cut the 4 KiB p99 to 0.40-0.47x for 0.90-0.93x of the rate, and
    /// 1 MiB and multi-range requests lost 5-25% (docs/performance.md).
    public var eventLoops: Int?
    /// The TCP congestion control of the connections that cross no link: every connection to a
    /// server listening on a loopback address (127.0.0.1, ::1: behind a proxy on the same
    /// machine, as `deploy/` sets it up), and on other addresses those from this machine (a
    /// loopback peer, or a peer at the connection's own address). Other connections keep the
    /// system's choice. The default prefers cubic (``LoopbackCongestionControl/preferred(_:)``).
    ///
    /// Why: with BBR as the system's choice and no `fq` queueing discipline (a common set-up),
    /// the kernel paces every segment a BBR socket sends with timers, loopback too, where there
    /// is no link to pace for and no queue to keep short: a 1 GiB download to curl ran at 3.1
    /// GB/s for 0.34 s of the server's CPU; with cubic, which does not pace, 7.3 GB/s for 0.055,
    /// and 1 MiB ranges (the slices the edge fetches) at 1.6x the rate (docs/performance.md,
    /// forty-third stop). The default, not an option to find: what the system's choice is for (a
    /// path through links) is not on these connections, and they lose nothing without it.
    public var loopbackCongestionControl: LoopbackCongestionControl = .preferred("cubic")

    /// Where the grant key file is when `--grant-keys` does not say: in the data folder.
    public static func grantKeysPath(inDataDirectory dataDirectory: String) -> String { dataDirectory + "/grant-keys.json" }

    /// The embedded defaults for the apps in `bundles`, with state under `dataDirectory`.
    public init(dataDirectory: String, bundles: BundlePolicy) {
        self.dataDirectory = dataDirectory
        self.bundles = bundles
        grantKeysPath = Self.grantKeysPath(inDataDirectory: dataDirectory)
    }

    /// The embedded defaults for the app `bundleId`, with state under `dataDirectory`.
    public init(dataDirectory: String, bundleId: String) {
        self.init(dataDirectory: dataDirectory, bundles: BundlePolicy(bundleId))
    }

    /// The environment variables read, with their meaning.
    public static let environmentVariables: [(String, String)] = [
        ("IAP_DATA", "--data"), ("IAP_DATABASE_URL", "--database"), ("IAP_ARCHIVES", "--archives"), ("IAP_GRANT_KEYS", "--grant-keys"), ("IAP_ADVERTISE_URL", "--advertise-url"),
        ("IAP_CA_FILES", "--ca-file, colon-separated"),
        ("IAP_BUNDLE_ID", "--bundle-id, comma-separated"), ("IAP_HOST", "--host"),
        ("IAP_PORT", "--port"),
        ("IAP_TRUST_ROOTS", "--trust-root, colon-separated"), ("IAP_ENVIRONMENT", "--environment"),
        ("IAP_TOKEN_TTL", "--token-ttl"), ("IAP_ADMIN_TOKEN_FILE", "--admin-token-file"), ("IAP_PUBLIC_URL", "--public-url"),
        ("IAP_HEADER_TIMEOUT", "--header-timeout"), ("IAP_IDLE_TIMEOUT", "--idle-timeout"), ("IAP_DRAIN_TIMEOUT", "--drain-timeout"),
        ("IAP_RECEIPT_VERIFICATION", "--receipt-verification"), ("IAP_VERIFY_RECEIPT_URL", "--verify-receipt-url"),
        ("IAP_VERIFY_RECEIPT_SANDBOX_URL", "--verify-receipt-sandbox-url"), ("IAP_RECEIPT_SHARED_SECRET_FILE", "--receipt-shared-secret-file"),
        ("IAP_VERIFY_RECEIPT_TIMEOUT", "--verify-receipt-timeout"), ("IAP_REVOCATION_REFRESH", "--revocation-refresh"),
        ("IAP_NOTIFICATION_RETENTION", "--notification-retention"), ("IAP_ARCHIVE_CHECK_INTERVAL", "--archive-check-interval"),
        ("IAP_EVENT_LOOPS", "--event-loops"), ("IAP_LOOPBACK_CONGESTION_CONTROL", "--loopback-congestion-control"),
    ]
}

/// How `POST /v1/downloads` verifies app receipts.
public enum ReceiptVerificationMode: String, Sendable, CaseIterable {
    /// PKCS#7 and the chain checked here with libcrypto: no network, no dependency on Apple.
    case local
    /// Apple's `verifyReceipt` (production first, the sandbox on 21007).
    case apple
    /// Both, and they must agree on the app and every purchase.
    case both
}

/// How ``ServerConfiguration/loopbackCongestionControl`` is chosen (`--loopback-congestion-control`).
public enum LoopbackCongestionControl: Sendable, Equatable {
    /// The system's (`net.ipv4.tcp_congestion_control`), as on every other connection.
    case system
    /// This algorithm where the system lets this process set it, else the system's (logged at
    /// start): the default, with cubic, which every Linux kernel has.
    case preferred(String)
    /// This algorithm; a server the system does not let set it refuses to start, naming those
    /// it allows (the operator asked for it by name).
    case required(String)
}

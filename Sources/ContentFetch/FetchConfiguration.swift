import Foundation
import IAPProtocol

/// How the fetcher works.
public struct FetchConfiguration: Sendable {
    /// The content server, e.g. http://127.0.0.1:8080.
    public var server: String
    /// Installed content goes to `<contentDirectory>/<productId>/<contentVersion>/`.
    public var contentDirectory: String
    /// Attempts per download in one run before it is `failed` (the transaction stays unfinished).
    public var maxAttempts = 5
    /// How long a server that cannot be reached at all (refused, unreachable, its name not
    /// resolving, a connect timeout) is tried again before the download fails: a restart, a deploy
    /// or a network coming back. These tries do not count against `maxAttempts`; the waits
    /// between them grow to at most 5 s.
    public var unreachablePatience: Duration = .seconds(60)
    /// The longest wait a server's `Retry-After` (on 503 or 429) gets before the next attempt;
    /// one that asks for more is tried again after this long.
    public var maxRetryAfter: Duration = .seconds(60)
    /// No byte for this long aborts the attempt (and it is retried).
    public var stallTimeout: Duration = .seconds(30)
    /// Optional bandwidth cap, bytes per second, for the whole fetcher: shared by every download
    /// running at once and by each one's connections.
    public var rateLimit: Int?
    /// The journal records progress every this many bytes, and no more often than
    /// `journalMinimumGap`: a killed process loses at most this many bytes, or what arrived in
    /// that gap, whichever is more.
    public var journalInterval: Int64 = 1 << 20
    /// The least time between two progress records. Each record replaces the journal file (a new
    /// file, a write, a rename): at 1 MiB each, a transfer at 800 MiB/s made 800 a second, 7% of
    /// the thread that also hashes every byte (docs/performance.md); 50 a second cost a kill at
    /// most 20 ms of transfer. Cancel requests from other processes are read at records too.
    public var journalMinimumGap: Duration = .milliseconds(20)
    /// The partial file is synced to disk at most this often while bytes arrive (and whenever a
    /// transfer pauses or stops): what a power cut can lose, in transfer time. A timer rather than
    /// a byte count because each fsync makes the disk write back what the page cache holds while
    /// the transfer goes on (docs/performance.md), and a download shorter than this interval
    /// never waits for the disk.
    public var durableInterval: Duration = .seconds(10)
    /// Connections per download: more than one fetches parallel ranges into the same file and
    /// journal. Archives are split only into parts of at least `minimumSegment` bytes.
    public var connections = 1
    /// Transactions whose content is fetched at once (1-8). A restore queues every purchase at
    /// once: one at a time, each small archive costs its round trips (grant, manifest, first
    /// byte) end to end, and one that waits on a server's `Retry-After` or on retries holds back
    /// the rest. Two downloads of the same product never run together: an install replaces the
    /// product's folder, and a delta update is planned from the version installed there.
    public var parallelDownloads = 3
    /// The smallest part a parallel download splits an archive into, in bytes.
    public var minimumSegment: Int64 = 16 << 20
    /// PEM files of certificate authorities trusted for `https://` servers besides the system's:
    /// a private CA that signs a staging server's or an internal edge's certificate. Read when
    /// the fetcher is made; a file that holds no certificate is a `.tls` error then.
    public var additionalTrustRootFiles: [String] = []
    /// Sent with every request, so that the server's and the edge's logs tell which clients ask:
    /// an app may put its own name first (`MyGame/2.3 iap-content/0.14.0`).
    public var userAgent = "iap-content/" + IAPContentVersion.current

    /// The defaults for `server` (its base URL; a trailing slash is dropped) installing into
    /// `contentDirectory`.
    public init(server: String, contentDirectory: String) {
        self.server = server.hasSuffix("/") ? String(server.dropLast()) : server
        self.contentDirectory = contentDirectory
    }
}

/// What a `start()` did.
public struct RunSummary: Sendable {
    /// Transactions whose content was installed and which were then finished.
    public var finished: [String] = []
    /// Transactions left unfinished because a download failed, with the reason.
    public var failed: [(transactionId: String, error: FetchError)] = []
    /// Transactions of products the server has no hosted content for (a consumable, a
    /// subscription, or content not published yet), with the server's reason: there is nothing
    /// to download, so they are neither failed nor finished. They stay unfinished for the app,
    /// which delivers what they bought and finishes them, as StoreKit leaves a purchase without
    /// downloads to it; a later run asks again, so content published meanwhile is fetched.
    public var withoutContent: [(transactionId: String, productId: String, reason: FetchError)] = []
    /// Refunded or revoked purchases, with the server's reason: nothing will be downloaded for
    /// them (a download under way was stopped and its bytes deleted), which is not a failure of
    /// the download. They stay unfinished for the app, which withdraws what they bought and
    /// finishes them; content already installed stays, the app's to remove.
    public var revoked: [(transactionId: String, productId: String, reason: FetchError)] = []
    /// Downloads paused with `pause(_:)`; `resume(_:)` continues them.
    public var paused: [String] = []
    /// Downloads cancelled; their transactions stay unfinished.
    public var cancelled: [String] = []
    /// `pauseAll()` stopped the run; the next start resumes.
    public var interrupted = false
}

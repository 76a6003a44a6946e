import Foundation

/// A snapshot of a download, as `SKDownload` reported it; observers receive one on every state
/// change and a few per second while bytes arrive.
public struct DownloadUpdate: Codable, Sendable, Equatable {
    public var id: String
    public var transactionId: String
    public var productId: String
    public var contentVersion: String?
    public var state: DownloadState
    /// 0…1; 1.0 is not "done": the state is.
    public var progress: Double
    public var bytesReceived: Int64
    /// -1 until the grant says.
    public var expectedContentLength: Int64
    /// Seconds, from a smoothed rate; -1 while unknown (`SKDownloadTimeRemainingUnknown`).
    public var timeRemaining: Double
    public var bytesPerSecond: Double
    public var error: FetchError?
    /// The installed folder (`ContentInfo.plist` and `Contents/`), once finished.
    public var contentURL: String?
    /// Bytes this download fetches: the archive, or for a delta update only its changed entries
    /// (then also `expectedContentLength`, which progress and time remaining count).
    public var bytesToFetch: Int64? = nil
    /// Bytes the install writes: for a delta update, the fetched entries once inflated (files
    /// taken from the installed version are linked, not written).
    public var bytesToWrite: Int64? = nil
    /// For a delta update, "delta from 1.0: N of M entries, X of Y bytes".
    public var delta: String? = nil
}

/// A rate smoothed over time (an exponentially weighted moving average of one-second samples),
/// so the time remaining does not jump with every chunk.
struct RateEstimator {
    private var rate: Double = 0
    private var windowStart = ContinuousClock.now
    private var windowBytes: Int64 = 0
    private var samples = 0

    mutating func add(_ bytes: Int64, now: ContinuousClock.Instant = .now) {
        windowBytes += bytes
        let elapsed = Double((now - windowStart) / .milliseconds(1)) / 1000
        guard elapsed >= 0.5 else { return }
        let instant = Double(windowBytes) / elapsed
        rate = samples == 0 ? instant : 0.7 * rate + 0.3 * instant
        samples += 1
        windowStart = now
        windowBytes = 0
    }

    var bytesPerSecond: Double { rate }

    func timeRemaining(_ remaining: Int64) -> Double {
        guard samples > 0, rate > 0 else { return -1 }
        return Double(remaining) / rate
    }
}

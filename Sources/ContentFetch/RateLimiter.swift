import NIOCore
import Synchronization

/// A fetcher's bandwidth cap (`FetchConfiguration.rateLimit`), shared by every connection of
/// every download running at once, so that `--limit-rate 2M` is what the device gives to content
/// in all, whether one download runs or three with four connections each.
///
/// Each reader reserves what it has just read and waits until the cap has paced it out. The
/// pacing runs one clock for all of them: a second reader's bytes are paced after the first's.
final class RateLimiter: Sendable {
    /// A reader behind the clock (a stall, a server that paused, a download that just started)
    /// may catch up this much at once, and no more: the cap holds over every quarter second, not
    /// only on average over the run.
    static let catchUp = TimeAmount.milliseconds(250)

    let bytesPerSecond: Int
    /// When the bytes reserved so far have been paced out.
    private let pacedUntil = Mutex<NIODeadline?>(nil)

    init(bytesPerSecond: Int) {
        self.bytesPerSecond = max(1, bytesPerSecond)
    }

    /// Reserves `count` bytes that were just read; returns when reading may go on.
    func reserve(_ count: Int) -> NIODeadline {
        let pace = TimeAmount.nanoseconds(Int64(count) * 1_000_000_000 / Int64(bytesPerSecond))
        return pacedUntil.withLock { until in
            let now = NIODeadline.now()
            let due = max(until ?? now, now - Self.catchUp) + pace
            until = due
            return due
        }
    }
}

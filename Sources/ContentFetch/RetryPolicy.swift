import Foundation
import IAPProtocol

/// How often and how patiently a step is tried again: exponential backoff with jitter, so that
/// clients cut off together do not come back together. The one retry mechanism of the client:
/// the grant request and the transfer both go through ``run(_:retryable:willRetry:)``.
struct RetryPolicy: Sendable {
    /// Tries in all, the first included.
    var maxAttempts: Int
    /// The wait before the second try; it doubles with each further try.
    var base: Duration = .milliseconds(250)
    /// How long a server that cannot be reached (``Unreachable``) is tried again, from the first
    /// such failure in a row; those tries do not count against `maxAttempts`.
    var patience: Duration = .seconds(60)
    /// The longest wait between two tries of a server that cannot be reached.
    var longestUnreachableWait: Duration = .seconds(5)

    /// The wait after `attempt` (1-based) failed: base × 2^(attempt−1), plus up to as much again at random.
    func delay(after attempt: Int, random: Double = Double.random(in: 0...1)) -> Duration {
        let step = base * Int(1 << min(max(attempt - 1, 0), 16))
        return step + step * random
    }

    /// How long to wait before the next try.
    enum Wait: Sendable, Equatable {
        /// Try again at once.
        case none
        /// The backoff's delay.
        case backoff
        /// The backoff's delay, or this long if the server asked for longer (`Retry-After`).
        case atLeast(Duration)
    }

    /// Runs `body` until it succeeds, throws what `retryable` refuses, or has been tried
    /// `maxAttempts` times (then the last error is thrown; a ``RetryLater`` as the `FetchError` it
    /// carries, since the wait it asked for is over). A server that cannot be reached
    /// (``Unreachable``) is tried for `patience` instead, on the backoff capped at
    /// `longestUnreachableWait`, and then the ``Unreachable`` is thrown. Before each wait,
    /// `willRetry` hears the attempt and the error (an ``Unreachable``'s `FetchError`), and says
    /// how long to wait; it may throw to stop (a pause, a cancel).
    func run<T>(
        isolation: isolated (any Actor)? = #isolation,
        _ body: (_ attempt: Int) async throws -> T,
        retryable: (any Error) -> Bool,
        willRetry: (_ attempt: Int, _ error: any Error) async throws -> Wait
    ) async throws -> T {
        var attempt = 1
        // The first of the latest failures in a row to reach the server, and how many.
        var unreachableSince: ContinuousClock.Instant?
        var unreachableTries = 0
        while true {
            do {
                return try await body(attempt)
            } catch let unreachable as Unreachable {
                let now = ContinuousClock.now
                let since = unreachableSince ?? now
                unreachableSince = since
                unreachableTries += 1
                guard now - since < patience else { throw unreachable }
                await pause(try await willRetry(attempt, unreachable.reason), backoff: min(delay(after: unreachableTries), longestUnreachableWait))
            } catch {
                unreachableSince = nil
                unreachableTries = 0
                guard retryable(error), attempt < maxAttempts else { throw (error as? RetryLater)?.reason ?? error }
                await pause(try await willRetry(attempt, error), backoff: delay(after: attempt))
                attempt += 1
            }
        }
    }

    /// Waits as `wait` says, where `backoff` is the backoff's delay for this try.
    private func pause(_ wait: Wait, backoff: Duration) async {
        switch wait {
        case .none: break
        case .backoff: try? await Task.sleep(for: backoff)
        case .atLeast(let asked): try? await Task.sleep(for: max(asked, backoff))
        }
    }
}

/// A server that answered 503 or 429 with `Retry-After`: the attempt failed with `reason`, and
/// the server asked for the next one no sooner than `after` (capped by
/// ``FetchConfiguration/maxRetryAfter``). Without the header the answer is a plain `.network`
/// error, retried on the backoff's schedule.
struct RetryLater: Error, CustomStringConvertible {
    let reason: FetchError
    let after: Duration

    var description: String { reason.message }

    /// The error for a `status` answer carrying `retryAfter` (delta-seconds or an HTTP date,
    /// RFC 9110 §10.2.3), or nil when the status does not ask for a wait or the value is neither.
    static func from(status: UInt, retryAfter: String?, cap: Duration, now: Date = Date(), what: String) -> RetryLater? {
        guard status == 503 || status == 429, let value = retryAfter?.trimmingCharacters(in: .whitespaces) else { return nil }
        let seconds: Int64
        if !value.isEmpty, value.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) {
            seconds = Int64(value.prefix(12)) ?? .max
        } else if let date = HTTPDate.parse(value) {
            seconds = max(0, date - Int64(now.timeIntervalSince1970))
        } else {
            return nil
        }
        let after = min(Duration.seconds(seconds), cap)
        let busy = status == 429 ? "is limiting requests (429)" : "is unavailable for now (503)"
        let shown = seconds > Int64(cap.components.seconds) ? "\(cap.components.seconds) s (it asked for \(seconds))" : "\(seconds) s"
        return RetryLater(reason: FetchError(.network, "the server \(busy) for \(what): trying again in \(shown), as it asked"), after: after)
    }
}

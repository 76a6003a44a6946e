import Foundation

/// How often and how patiently a step is tried again: exponential backoff with jitter, so that
/// clients cut off together do not come back together. The one retry mechanism of the client:
/// the grant request and the transfer both go through ``run(_:retryable:willRetry:)``.
struct RetryPolicy: Sendable {
    /// Tries in all, the first included.
    var maxAttempts: Int
    /// The wait before the second try; it doubles with each further try.
    var base: Duration = .milliseconds(250)

    /// The wait after `attempt` (1-based) failed: base × 2^(attempt−1), plus up to as much again at random.
    func delay(after attempt: Int, random: Double = Double.random(in: 0...1)) -> Duration {
        let step = base * Int(1 << min(max(attempt - 1, 0), 16))
        return step + step * random
    }

    /// Runs `body` until it succeeds, throws what `retryable` refuses, or has been tried
    /// `maxAttempts` times (then the last error is thrown). Before each wait, `willRetry` hears the
    /// attempt and the error, and returns whether to wait at all (false: try again at once); it
    /// may throw to stop (a pause, a cancel).
    func run<T>(
        isolation: isolated (any Actor)? = #isolation,
        _ body: (_ attempt: Int) async throws -> T,
        retryable: (any Error) -> Bool,
        willRetry: (_ attempt: Int, _ error: any Error) async throws -> Bool
    ) async throws -> T {
        var attempt = 1
        while true {
            do {
                return try await body(attempt)
            } catch {
                guard retryable(error), attempt < maxAttempts else { throw error }
                if try await willRetry(attempt, error) {
                    try? await Task.sleep(for: delay(after: attempt))
                }
                attempt += 1
            }
        }
    }
}

import NIOCore
import NIOHTTP1

/// One content response as the observer hears of it: started when it is written, finished when
/// its last write completes (file regions included), with whether it left completely. Both
/// content handlers report through this, so the metrics mean the same on either path.
/// The observer is passed to both calls rather than kept: the report is captured by the
/// completion closure of every response, and an existential inside it costs a copy per request.
struct ResponseReport {
    private let status: HTTPResponseStatus
    private let bytes: UInt64
    private let started: ContinuousClock.Instant?

    /// Tells the observer that `response` starts now.
    init(_ response: ContentResponse, observer: (any ContentObserver)?) {
        status = response.status
        bytes = response.servedBytes
        started = bytes > ContentObserverLimits.untimedBytes ? .now : nil
        observer?.responseStarted(status: status, bytes: bytes)
    }

    /// Tells the observer how the response's last write ended; returns whether it succeeded.
    func finished(_ result: Result<Void, any Error>, observer: (any ContentObserver)?) -> Bool {
        let succeeded = (try? result.get()) != nil
        observer?.responseFinished(status: status, bytes: bytes, duration: started.map { .now - $0 } ?? .zero, succeeded: succeeded)
        return succeeded
    }
}

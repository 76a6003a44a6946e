import ServiceLifecycle

/// Runs Hummingbird's request loop for the connections `ContentFastPath` hands to the HTTP/1
/// decoder (the first request that is not a plain content `GET` or `HEAD`), each in a task of
/// this service's group, started at the hand-off.
///
/// Why not a task for every connection, as Hummingbird's server starts: a connection that only
/// downloads never needs one, and the task with its async channel (a handler pair and two
/// streams, a wake-up of the concurrency pool at the start and another at the close) took a
/// fifth of the server's CPU for a fresh connection (docs/performance.md, twentieth stop).
///
/// Listed before the server in the service group, so that it is shut down after it: the
/// server's drain closes every connection first, and their loops then end; the group waits for
/// them. A hand-off once it has stopped is refused, and the connection closed.
final class HandedOffConnections: Service, Sendable {
    typealias Loop = @Sendable () async -> Void
    private let loops: AsyncStream<Loop>
    private let intake: AsyncStream<Loop>.Continuation

    init() {
        (loops, intake) = AsyncStream.makeStream()
    }

    /// Starts `loop` in the group; false when the service has stopped (or never ran), and
    /// `loop` will not run. Callable from any thread.
    func start(_ loop: @escaping Loop) -> Bool {
        if case .enqueued = intake.yield(loop) { return true }
        return false
    }

    func run() async {
        await withDiscardingTaskGroup { group in
            await withGracefulShutdownHandler {
                for await loop in loops { group.addTask { await loop() } }
            } onGracefulShutdown: {
                self.intake.finish()
            }
        }
        intake.finish()
    }
}

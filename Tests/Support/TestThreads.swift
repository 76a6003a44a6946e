import Foundation
import Synchronization
import Testing

/// Threads of the test process's own for tests that block: they wait for child processes
/// (`run`, `curl`, servers), sleep between polls, or pack and extract synchronously.
///
/// Swift concurrency runs every task on a cooperative pool as wide as the machine (two threads
/// here), and Swift Testing runs tests in parallel on it. A test that blocks holds one of those
/// threads until it returns, so with two blocked, nothing else in the process moves: PostgresNIO's
/// connection pool, a migration's next query, a timer. A PostgreSQL test that passes alone in two
/// seconds took two minutes inside the full suite and failed its 60-second operation timeout.
/// Jobs here run on threads of their own, taken in order; a test that waits (awaits) holds none of
/// them, and the cooperative pool stays free for the libraries. Twice as many as the machine has
/// cores, because the tests here mostly wait for child processes: on two cores the full suite took
/// 141 s with two and 122 s with four.
public final class TestThreads: TaskExecutor, Sendable {
    /// The one set of test threads in the process.
    public static let shared = TestThreads(count: 2 * max(2, ProcessInfo.processInfo.activeProcessorCount))

    private struct Jobs: ~Copyable {
        var waiting: [UnownedJob] = []
        var next = 0
    }

    private let jobs = Mutex(Jobs())
    private let ready: DispatchSemaphore = DispatchSemaphore(value: 0)

    private init(count: Int) {
        for index in 0..<count {
            Thread { [self] in
                // Named for gdb. Read back, `Thread.current.name` is no witness of where code
                // runs: on some runs every test thread reported its creator's name there.
                Thread.current.name = "test-thread-\(index)"
                Self.members.withLock { _ = $0.insert(pthread_self()) }
                work()
            }.start()
        }
    }

    private static let members = Mutex(Set<pthread_t>())

    /// Whether the calling code runs on one of the test threads.
    public static var isCurrentThread: Bool {
        let thread = pthread_self()
        return members.withLock { $0.contains(thread) }
    }

    public func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        jobs.withLock { $0.waiting.append(job) }
        ready.signal()
    }

    private func work() -> Never {
        while true {
            ready.wait()
            let job = jobs.withLock { jobs -> UnownedJob in
                let job = jobs.waiting[jobs.next]
                jobs.next += 1
                // Drop what has run once the front half is used, so the array stays small.
                if jobs.next > 64, jobs.next * 2 > jobs.waiting.count {
                    jobs.waiting.removeFirst(jobs.next)
                    jobs.next = 0
                }
                return job
            }
            job.runSynchronously(on: asUnownedTaskExecutor())
        }
    }
}

extension TestThreads {
    /// Waits `duration`, resumed through a continuation, which is enqueued by the task's executor
    /// preference. `Task.sleep` (and `Task.yield`) ignore that preference (swiftlang/swift#74395)
    /// and resume on the cooperative pool, where a poll that then blocks holds a thread again.
    public static func sleep(for duration: Duration) async {
        let (seconds, attoseconds) = duration.components
        let nanoseconds = Int(seconds) * 1_000_000_000 + Int(attoseconds / 1_000_000_000)
        await withCheckedContinuation { continuation in
            DispatchQueue.global().asyncAfter(deadline: .now() + .nanoseconds(nanoseconds)) { continuation.resume() }
        }
    }
}

/// Asks until `condition` holds, for at most `limit`, sleeping with ``TestThreads/sleep(for:)``
/// between asks; how long it took, or nil.
@discardableResult
public func waitUntil(_ limit: Duration, _ condition: () throws -> Bool) async rethrows -> Duration? {
    let clock = ContinuousClock(), start = clock.now
    while clock.now - start < limit {
        if try condition() { return clock.now - start }
        await TestThreads.sleep(for: .milliseconds(10))
    }
    return nil
}

/// ``waitUntil(_:_:)`` for a condition that awaits (a query, a request): asked every 100 ms.
public func waitUntilAnswered(_ limit: Duration, _ condition: () async throws -> Bool) async rethrows -> Duration? {
    let clock = ContinuousClock(), start = clock.now
    while clock.now - start < limit {
        if try await condition() { return clock.now - start }
        await TestThreads.sleep(for: .milliseconds(100))
    }
    return nil
}

/// Runs each test of a suite (or one test) on ``TestThreads``: for tests that block a thread.
public struct OnTestThreads: SuiteTrait, TestTrait, TestScoping {
    public var isRecursive: Bool { true }

    public func scopeProvider(for test: Test, testCase: Test.Case?) -> OnTestThreads? {
        // Each test case's body, not the suite around it: the preference then covers exactly the
        // code that blocks, and the suite's own bookkeeping stays where Swift Testing runs it.
        testCase == nil ? nil : self
    }

    public func provideScope(for test: Test, testCase: Test.Case?, performing function: @Sendable () async throws -> Void) async throws {
        try await withTaskExecutorPreference(TestThreads.shared) {
            try await function()
        }
    }
}

extension Trait where Self == OnTestThreads {
    /// The test blocks a thread (child processes, sleeps, synchronous packing): run it on
    /// ``TestThreads``, not on Swift concurrency's cooperative pool.
    public static var onTestThreads: Self { OnTestThreads() }
}

import Foundation
import IAPTestSupport
import Testing

/// The catalog's PostgreSQL tests need Swift's cooperative pool free (PostgresNIO's connection
/// pool runs there); suites that block are marked to run on the test threads instead.
@Suite("Tests that block run on threads of their own", .onTestThreads)
struct TestThreadsTests {
    @Test("a synchronous test in a marked suite runs on a test thread, not on the cooperative pool")
    func synchronousTest() {
        #expect(threadName().hasPrefix("test-thread-"), "\(threadName())")
    }

    @Test("an asynchronous one starts on a test thread, and so do its child tasks")
    func asynchronousTest() async {
        #expect(threadName().hasPrefix("test-thread-"), "\(threadName())")
        async let child = threadName()
        #expect(await child.hasPrefix("test-thread-"))
    }
}

/// The name of the thread this runs on (`Thread.current` is not for async code; this is synchronous).
private func threadName() -> String { Thread.current.name ?? "an unnamed thread" }

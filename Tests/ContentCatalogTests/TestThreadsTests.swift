import IAPTestSupport
import Testing

/// The catalog's PostgreSQL tests need Swift's cooperative pool free (PostgresNIO's connection
/// pool runs there); suites that block are marked to run on the test threads instead.
@Suite("Tests that block run on threads of their own", .onTestThreads)
struct TestThreadsTests {
    @Test("a synchronous test in a marked suite runs on a test thread, not on the cooperative pool", arguments: 0..<50)
    func synchronousTest(_ case: Int) {
        #expect(TestThreads.isCurrentThread)
    }

    @Test("an asynchronous one runs on a test thread, and so do its child tasks and what follows a wait", arguments: 0..<50)
    func asynchronousTest(_ case: Int) async {
        #expect(TestThreads.isCurrentThread)
        async let child = TestThreads.isCurrentThread
        #expect(await child)
        await TestThreads.sleep(for: .milliseconds(1))
        #expect(TestThreads.isCurrentThread)
    }
}

@Suite("Tests that do not block stay on the cooperative pool")
struct UnmarkedTests {
    @Test("an unmarked test does not run on a test thread")
    func unmarked() {
        #expect(!TestThreads.isCurrentThread)
    }
}

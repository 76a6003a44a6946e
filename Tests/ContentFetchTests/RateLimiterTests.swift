import NIOCore
import Testing

@testable import ContentFetch

@Suite("The shared bandwidth cap")
struct RateLimiterTests {
    @Test("readers that reserve in turn are paced on one clock: the cap holds for all of them together")
    func oneClockForEveryReader() {
        let limiter = RateLimiter(bytesPerSecond: 1_000_000)
        let start = NIODeadline.now()
        // Three readers, 100 KB each in turn, ten times: 3 MB in all.
        var last = start
        for _ in 0..<10 { for _ in 0..<3 { last = limiter.reserve(100_000) } }
        let paced = Double((last - start).nanoseconds) / 1e9
        #expect(paced >= 2.99 && paced < 3.1, "3 MB at 1 MB/s paced out over \(paced) s")
    }
}

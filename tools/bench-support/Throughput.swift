// What the Swift benchmarks (verify-bench, receipt-bench) measure and print alike.
import Foundation

/// Operations per second of `body` over items `0..<n`, split over `tasks` tasks (item `i` on task
/// `i % tasks`), from the first item started to the last one done.
public func rate(_ n: Int, tasks: Int, _ body: @Sendable @escaping (Int) async throws -> Void) async throws -> Double {
    let start = ContinuousClock.now
    try await withThrowingTaskGroup(of: Void.self) { group in
        for worker in 0..<tasks {
            group.addTask {
                var i = worker
                while i < n {
                    try await body(i)
                    i += tasks
                }
            }
        }
        try await group.waitForAll()
    }
    return Double(n) / ((ContinuousClock.now - start) / .seconds(1))
}

/// `label`, padded to a column, then the median of `samples` and their spread: "5488 (5307-5824)".
public func medianLine(_ label: String, _ samples: [Double]) -> String {
    let sorted = samples.sorted()
    let figures = String(format: "%9.0f (%.0f-%.0f)", sorted[sorted.count / 2], sorted.first!, sorted.last!)
    return label.padding(toLength: 37, withPad: " ", startingAt: 0) + figures
}

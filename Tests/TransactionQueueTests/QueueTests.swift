import Foundation
import IAPTestSupport
import Testing
import TransactionQueue

@Suite("Transaction queue", .onTestThreads)
struct QueueTests {
    @Test("finishing is durable, idempotent and one-way")
    func finishing() async throws {
        let tmp = try TemporaryFolder()
        let queue = try FileTransactionQueue(folder: tmp.sub("q"))
        let first = QueuedTransaction(transactionId: "2000000000000001", productId: "p1", signedTransaction: "jws1", addedAt: Date(timeIntervalSince1970: 100))
        let second = QueuedTransaction(transactionId: "2000000000000002", productId: "p2", signedTransaction: "jws2", addedAt: Date(timeIntervalSince1970: 200))
        try queue.add(second)
        try queue.add(first)
        #expect(try await queue.unfinishedTransactions().map(\.transactionId) == ["2000000000000001", "2000000000000002"])

        let finished = try queue.finishNow("2000000000000001", at: Date(timeIntervalSince1970: 300.5))
        let again = try queue.finishNow("2000000000000001", at: Date(timeIntervalSince1970: 999))
        #expect(again.finishedAt == finished.finishedAt)
        #expect(finished.finishedAt == Date(timeIntervalSince1970: 300.5))
        // Re-adding a finished transaction does not make it unfinished again.
        try queue.add(first)
        #expect(try await queue.unfinishedTransactions().map(\.transactionId) == ["2000000000000002"])
        // A second queue object on the same folder (another process) sees the same state.
        let reopened = try FileTransactionQueue(folder: tmp.sub("q"))
        #expect(try reopened.transaction("2000000000000001")?.finishedAt == Date(timeIntervalSince1970: 300.5))
        #expect(throws: TransactionQueueError.self) { try queue.finishNow("9999") }
        #expect(throws: TransactionQueueError.self) { try queue.finishNow("../etc/passwd") }
        let leftovers = try FileManager.default.contentsOfDirectory(atPath: tmp.sub("q")).filter { $0.contains(".tmp-") }
        #expect(leftovers.isEmpty)
    }

    @Test("concurrent finishers agree on one finish time")
    func concurrentFinish() async throws {
        let tmp = try TemporaryFolder()
        let queue = try FileTransactionQueue(folder: tmp.sub("q"))
        try queue.add(QueuedTransaction(transactionId: "42", productId: "p", signedTransaction: "jws"))
        let times = try await withThrowingTaskGroup(of: Date?.self) { group in
            for i in 0..<16 {
                group.addTask { try FileTransactionQueue(folder: tmp.sub("q")).finishNow("42", at: Date(timeIntervalSince1970: Double(1000 + i))).finishedAt }
            }
            return try await group.reduce(into: Set<Date?>()) { $0.insert($1) }
        }
        #expect(times.count == 1)
    }
}

import Foundation
import IAPTestSupport
import SystemPackage
import Testing
import TransactionQueue

@testable import ContentFetch

@Suite("UnbufferedWriter against a file system that refuses direct writes", .onTestThreads)
struct UnbufferedWriterTests {
    @Test(
        "direct writes refused part-way (EINVAL): the rest of the body and of the installed file written as it arrives go through the page cache, and the same bytes are verified, installed and finished"
    )
    func refusedPartWay() throws {
        let size = 3 * UnbufferedWriter.pieceSize + 5_000
        let shop = try Shop(products: ["com.example.refused": .random(size)])
        // The fallback is only exercised where direct writes open at all (ext4, tmpfs since 6.6).
        try FileManager.default.createDirectory(atPath: shop.content, withIntermediateDirectories: true)
        let probe = shop.content + "/probe"
        let fd = try FileDescriptor.open(probe, .readWrite, options: [.create], permissions: .ownerReadWrite)
        let opens = UnbufferedWriter(path: probe, plain: fd, pool: PieceBufferPool(limit: 1)) { _ in } != nil
        try fd.close()
        try FileManager.default.removeItem(atPath: probe)
        try #require(opens, "the test folder's file system opens files for direct I/O")

        let purchase = try shop.store.purchase(productId: "com.example.refused")
        let result = try shop.fetch([], prefix: ["export IAP_FETCH_REFUSE=direct-write"])
        #expect(result.status == 0, "\(result.stderr)")
        #expect(shop.installed("com.example.refused") == shop.payloads["com.example.refused"])
        #expect(result.stdout.contains("transaction-finished"))
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }
}

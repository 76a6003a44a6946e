import Foundation
import IAPTestSupport
import SystemPackage
import Testing
import TransactionQueue

@testable import ContentFetch

@Suite("UnbufferedWriter: pieces written around the page cache, hashed and extracted", .onTestThreads)
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

    @Test("a stored pack several times the pieces' memory installs at the first attempt: each piece is hashed before its buffer is filled again")
    func hashedBeforeReuse() throws {
        // Six times the pool's four pieces: every buffer is filled again while the hash and the
        // extraction follow. A piece reused too soon makes the SHA-256 wrong, which the retry
        // would hide from a test that looks at the install alone.
        let size = 6 * UnbufferedWriter.pieces * UnbufferedWriter.pieceSize + 5_000
        let shop = try Shop(products: ["com.example.pieces": .random(size)])
        let purchase = try shop.store.purchase(productId: "com.example.pieces")
        let result = try shop.fetch([])
        #expect(result.status == 0, "\(result.stderr)")
        #expect(shop.installed("com.example.pieces") == shop.payloads["com.example.pieces"])
        #expect(!result.stdout.contains("\"integrity\""), "the download was fetched again: \(result.stdout.split(separator: "\n").filter { $0.contains("integrity") })")
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }
}

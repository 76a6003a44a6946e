import ContentFetch
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@Suite("iap-fetch with StoreKit 1 purchases (app receipts)", .serialized, .onTestThreads)
struct StoreKit1Tests {
    func events(_ output: String) -> [[String: Any]] {
        output.split(separator: "\n").compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
    }

    @Test("StoreKit 1 and 2 purchases in one queue: each proven its way, installed, finished by transaction id after install")
    func mixedQueue() throws {
        let shop = try Shop(products: ["com.example.one": .random(300_000), "com.example.two": .random(200_000)], receipts: true)
        let old = try shop.store.purchase(productId: "com.example.one", storeKit1: true)
        let new = try shop.store.purchase(productId: "com.example.two")
        let queued = try FileTransactionQueue(folder: shop.queue).all()
        #expect(queued.map(\.isStoreKit1) == [true, false])
        #expect(FileManager.default.fileExists(atPath: shop.store.deviceReceiptPath))

        let result = try shop.fetch()
        #expect(result.status == 0, "\(result.stderr)")
        #expect(shop.installed("com.example.one") == shop.payloads["com.example.one"])
        #expect(shop.installed("com.example.two") == shop.payloads["com.example.two"])
        let finished = events(result.stdout).filter { $0["event"] as? String == "transaction-finished" }.compactMap { $0["transactionId"] as? String }
        #expect(Set(finished) == [old.transaction.transactionId!, new.transaction.transactionId!])
        #expect(try FileTransactionQueue(folder: shop.queue).all().allSatisfy(\.isFinished))
    }

    @Test("a StoreKit 1 purchase refunded, or missing from a stale receipt, is not installed and stays unfinished with the reason")
    func refusals() throws {
        let shop = try Shop(products: ["com.example.one": .random(100_000), "com.example.two": .random(100_000)], receipts: true)
        let refunded = try shop.store.purchase(productId: "com.example.one", storeKit1: true).transaction.transactionId!
        let stale = try Data(contentsOf: URL(fileURLWithPath: shop.store.deviceReceiptPath))
        let later = try shop.store.purchase(productId: "com.example.two", storeKit1: true).transaction.transactionId!
        // The device still holds the receipt from before the second purchase.
        try stale.write(to: URL(fileURLWithPath: shop.store.deviceReceiptPath))
        let refund = try shop.store.refund(transactionId: refunded)
        #expect(try postJSON(shop.server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: shop.tmp).status == 200)

        let result = try shop.fetch()
        #expect(shop.installed("com.example.one") == nil && shop.installed("com.example.two") == nil)
        #expect(result.stderr.contains("refunded or revoked"), "\(result.stderr)")
        #expect(result.stderr.contains("SKReceiptRefreshRequest"), "\(result.stderr)")
        let queue = try FileTransactionQueue(folder: shop.queue)
        #expect(try queue.transaction(later)?.isFinished == false)

        // Refreshed receipt: the second purchase installs and is finished.
        try Data(try shop.store.receipt()).write(to: URL(fileURLWithPath: shop.store.deviceReceiptPath))
        _ = try shop.fetch()
        #expect(shop.installed("com.example.two") == shop.payloads["com.example.two"])
        #expect(try queue.transaction(later)?.isFinished == true)
    }
}

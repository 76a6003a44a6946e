import Foundation
import IAPTestSupport
import SandboxStore
import Testing

@Suite("iap-server verify with app receipts", .onTestThreads)
struct VerifyReceiptToolTests {
    @Test("a receipt file (raw or base64) prints its purchases with the entitlement of each; an untrusted one exits 1")
    func verifyReceipt() throws {
        let tmp = try TemporaryFolder()
        let store = try SandboxStore.initialize(folder: tmp.sub("store"), bundleId: "com.example.app")
        let kept = try store.purchase(productId: "com.example.levels1").transaction.transactionId!
        let refunded = try store.purchase(productId: "com.example.levels2").transaction.transactionId!
        _ = try store.refund(transactionId: refunded)
        let receipt = try store.receipt()
        let raw = try tmp.write("receipt", Data(receipt))
        let tool = productsDirectory() + "/iap-server"
        let flags = ["--bundle-id", "com.example.app", "--trust-root", store.receiptRootCertificatePath, "--environment", "sandbox"]

        for result in [
            try run(tool, ["verify", raw] + flags),
            try run(tool, ["verify", "-"] + flags, stdin: Data(receipt).base64EncodedString()),
        ] {
            #expect(result.status == 0, "\(result.stderr)")
            let output = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any])
            #expect(output["kind"] as? String == "receipt")
            #expect((output["payload"] as? [String: Any])?["bundleId"] as? String == "com.example.app")
            let purchases = try #require(output["purchases"] as? [[String: Any]])
            #expect(purchases.compactMap { $0["transactionId"] as? String } == [kept, refunded])
            let granted = purchases.map { ($0["entitlement"] as? [String: Any])?["granted"] as? Bool }
            #expect(granted == [true, false])
            #expect((purchases[1]["entitlement"] as? [String: Any])?["reason"] as? String == "revoked")
        }
        let untrusted = try run(tool, ["verify", raw, "--bundle-id", "com.example.app", "--environment", "sandbox"])
        #expect(untrusted.status == 1 && untrusted.stderr.contains("untrusted-chain"), "\(untrusted.stderr)")
    }
}

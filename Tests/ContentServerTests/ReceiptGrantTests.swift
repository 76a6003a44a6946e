import ContentArchive
import Foundation
import IAPTestSupport
import SandboxStore
import Testing

extension ServerTests {
    /// The server trusting both sandbox chains: StoreKit 2 (root.cer) and receipts (receipt-root.cer).
    func startForReceipts(_ tmp: TemporaryFolder) throws -> (SandboxStore, ServerProcess) {
        let store = try SandboxStore.initialize(folder: tmp.sub("sandbox"), bundleId: bundleId)
        _ = try store.receiptAuthority()
        try adminToken.write(toFile: tmp.sub("admin-token"), atomically: true, encoding: .utf8)
        let server = try ServerProcess(
            data: tmp.sub("data"),
            arguments: [
                "--bundle-id", bundleId, "--trust-root", store.rootCertificatePath, "--trust-root", store.receiptRootCertificatePath,
                "--environment", "sandbox", "--admin-token-file", tmp.sub("admin-token"),
            ], folder: tmp)
        return (store, server)
    }

    func pack(_ tmp: TemporaryFolder, product: String) throws -> PackResult {
        let content = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("content/\(product)/Contents").path
        return try ArchivePacker.pack(
            folder: content,
            options: .init(productId: try ProductIdentifier(product), contentVersion: try ContentVersion("1.0"), outputDirectory: tmp.sub("out-\(product)")))
    }

    func receiptGrant(_ receipt: [UInt8], server: ServerProcess, tmp: TemporaryFolder, transactionId: String? = nil, productId: String? = nil) throws -> HTTPResult {
        var body: [String: Any] = ["receipt": Data(receipt).base64EncodedString()]
        if let transactionId { body["transactionId"] = transactionId }
        if let productId { body["productId"] = productId }
        return try postJSON(server.base + "/v1/downloads", body, folder: tmp)
    }

    @Test("StoreKit 1: a receipt grants one purchase or restores all; refunds (in the receipt or by notification), missing content and bad receipts refuse")
    func receiptGrants() throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try startForReceipts(tmp)
        defer { _ = server.stop() }
        let levels = try pack(tmp, product: "com.example.cosmos.levels1")
        let drums = try pack(tmp, product: "com.example.soundkit.drums")
        #expect(try upload(levels.archivePath, server: server, tmp: tmp, manifest: levels.manifest).status == 201)
        #expect(try upload(drums.archivePath, server: server, tmp: tmp, manifest: drums.manifest).status == 201)

        let bought = try store.purchase(productId: "com.example.cosmos.levels1").transaction.transactionId!
        let refunded = try store.purchase(productId: "com.example.soundkit.drums").transaction.transactionId!
        let noContent = try store.purchase(productId: "com.example.magazine.issue42").transaction.transactionId!
        let laterRefund = try store.refund(transactionId: refunded)
        let receipt = try store.receipt()

        // One purchase, by transaction id: the URL serves the archive.
        let one = try receiptGrant(receipt, server: server, tmp: tmp, transactionId: bought)
        #expect(one.status == 200, "\(one.text)")
        let download = try #require((one.json["downloads"] as? [[String: Any]])?.first)
        #expect(download["sha256"] as? String == levels.manifest.archiveSHA256 && download["transactionId"] as? String == bought)
        let fetched = try curl([try #require(download["url"] as? String)], folder: tmp)
        let archiveBytes = try Data(contentsOf: URL(fileURLWithPath: levels.archivePath))
        #expect(fetched.status == 200 && fetched.body == archiveBytes)
        #expect(try receiptGrant(receipt, server: server, tmp: tmp, productId: "com.example.cosmos.levels1").status == 200)

        // The refunded purchase carries its cancellation date: refused like a revoked transaction.
        let cancelled = try receiptGrant(receipt, server: server, tmp: tmp, transactionId: refunded)
        #expect(cancelled.status == 403 && cancelled.errorCode == "revoked", "\(cancelled.text)")
        let none = try receiptGrant(receipt, server: server, tmp: tmp, transactionId: noContent)
        #expect(none.status == 404 && none.errorCode == "no-content")
        let absent = try receiptGrant(receipt, server: server, tmp: tmp, transactionId: "9999999999999999")
        #expect(absent.status == 404 && absent.errorCode == "not-in-receipt")

        // Restore: every product once; the others listed with the reason.
        let restore = try receiptGrant(receipt, server: server, tmp: tmp)
        #expect(restore.status == 200)
        #expect((restore.json["downloads"] as? [[String: Any]])?.compactMap { $0["productId"] as? String } == ["com.example.cosmos.levels1"])
        let skipped = (restore.json["skipped"] as? [[String: Any]]) ?? []
        #expect(Set(skipped.compactMap { $0["code"] as? String }) == ["revoked", "no-content"])

        // A receipt issued before a refund does not know it; the ledger (fed by the REFUND
        // notification, whose transaction ids are the receipt's) still refuses.
        let before = try store.receipt()
        let second = try store.refund(transactionId: bought)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": second.signedPayload], folder: tmp).status == 200)
        let revoked = try receiptGrant(before, server: server, tmp: tmp, transactionId: bought)
        #expect(revoked.status == 403 && revoked.errorCode == "revoked", "\(revoked.text)")
        _ = laterRefund

        // Bad receipts: not base64, not PKCS#7, a foreign chain, another app, both proofs at once.
        let garbage = try postJSON(server.base + "/v1/downloads", ["receipt": "%%%"], folder: tmp)
        #expect(garbage.status == 400 && garbage.errorCode == "malformed")
        let notPKCS7 = try postJSON(server.base + "/v1/downloads", ["receipt": Data("hello".utf8).base64EncodedString()], folder: tmp)
        #expect(notPKCS7.status == 400 && notPKCS7.errorCode == "malformed")
        let otherStore = try SandboxStore.initialize(folder: tmp.sub("other"), bundleId: bundleId)
        _ = try otherStore.purchase(productId: "com.example.cosmos.levels1")
        let foreign = try receiptGrant(try otherStore.receipt(), server: server, tmp: tmp)
        #expect(foreign.status == 401 && foreign.errorCode == "untrusted-chain")
        let both = try postJSON(server.base + "/v1/downloads", ["receipt": Data(receipt).base64EncodedString(), "signedTransaction": "x.y.z"], folder: tmp)
        #expect(both.status == 400 && both.errorCode == "malformed")
        let metrics = try curl([server.base + "/metrics"], folder: tmp)
        #expect(metrics.text.contains("iap_grants_total{outcome=\"not-in-receipt\"} 1"))
    }
}

import AppStoreServerAPI
import AppStoreServerClient
import Foundation
import IAPTestSupport
import ReceiptVerification
import SandboxStore
import Testing

@testable import ContentServer

extension ServerTests {
    /// `--receipt-verification apple|both` against `iap-sandbox serve`'s verifyReceipt, one process
    /// per App Store environment as Apple runs them.
    @Test("receipts through verifyReceipt: production first, the sandbox on 21007; Apple's statuses become clear refusals; both must agree")
    func verifyReceiptModes() throws {
        let tmp = try TemporaryFolder()
        let (store, local) = try startForReceipts(tmp)
        defer { _ = local.stop() }
        let levels = try pack(tmp, product: "com.example.cosmos.levels1")
        #expect(try upload(levels.archivePath, server: local, tmp: tmp, manifest: levels.manifest).status == 201)
        let bought = try store.purchase(productId: "com.example.cosmos.levels1").transaction.transactionId!
        let refunded = try store.purchase(productId: "com.example.cosmos.levels1").transaction.transactionId!
        _ = try store.refund(transactionId: refunded)
        let receipt = try store.receipt()

        let production = try ServerProcess(data: store.folder, arguments: ["--environment", "Production"], folder: tmp, tool: "iap-sandbox", dataFlag: "--dir")
        let sandbox = try ServerProcess(data: store.folder, arguments: ["--environment", "Sandbox"], folder: tmp, tool: "iap-sandbox", dataFlag: "--dir")
        defer {
            _ = production.stop()
            _ = sandbox.stop()
        }
        // Apple's endpoints answer as Apple's do.
        let direct = try postJSON(production.base + "/verifyReceipt", ["receipt-data": Data(receipt).base64EncodedString()], folder: tmp)
        #expect(direct.status == 200 && direct.json["status"] as? Int == 21007)
        let inSandbox = try postJSON(sandbox.base + "/verifyReceipt", ["receipt-data": Data(receipt).base64EncodedString()], folder: tmp)
        #expect(inSandbox.json["status"] as? Int == 0 && inSandbox.json["environment"] as? String == "Sandbox")
        let inApp = ((inSandbox.json["receipt"] as? [String: Any])?["in_app"] as? [[String: Any]]) ?? []
        #expect(inApp.compactMap { $0["transaction_id"] as? String } == [bought, refunded])
        #expect(inApp.last?["cancellation_date_ms"] is String)
        #expect(try postJSON(sandbox.base + "/verifyReceipt", ["receipt-data": "aGVsbG8="], folder: tmp).json["status"] as? Int == 21002)
        #expect(try postJSON(sandbox.base + "/verifyReceipt", ["nothing": 1], folder: tmp).json["status"] as? Int == 21000)

        func server(_ mode: String, environment: String = "sandbox", productionURL: String? = nil) throws -> ServerProcess {
            try ServerProcess(
                data: tmp.sub("data"),
                arguments: [
                    "--bundle-id", bundleId, "--trust-root", store.rootCertificatePath, "--trust-root", store.receiptRootCertificatePath,
                    "--environment", environment, "--receipt-verification", mode,
                    "--verify-receipt-url", (productionURL ?? production.base) + "/verifyReceipt", "--verify-receipt-sandbox-url", sandbox.base + "/verifyReceipt",
                    "--verify-receipt-timeout", "2",
                ], folder: tmp)
        }
        for mode in ["apple", "both"] {
            let online = try server(mode)
            defer { _ = online.stop() }
            let granted = try receiptGrant(receipt, server: online, tmp: tmp, transactionId: bought)
            #expect(granted.status == 200, "\(mode): \(granted.text)")
            let cancelled = try receiptGrant(receipt, server: online, tmp: tmp, transactionId: refunded)
            #expect(cancelled.status == 403 && cancelled.errorCode == "revoked", "\(mode): \(cancelled.text)")
            let garbage = try postJSON(online.base + "/v1/downloads", ["receipt": "aGVsbG8="], folder: tmp)
            #expect(garbage.status == 400 && garbage.errorCode == "malformed", "\(mode): \(garbage.text)")
        }
        // Apple mode alone: a receipt Apple cannot authenticate (another store's chain) is 21003.
        let other = try SandboxStore.initialize(folder: tmp.sub("other"), bundleId: bundleId)
        _ = try other.purchase(productId: "com.example.cosmos.levels1")
        let apple = try server("apple")
        let foreign = try receiptGrant(try other.receipt(), server: apple, tmp: tmp)
        #expect(foreign.status == 401 && foreign.errorCode == "invalid-signature", "\(foreign.text)")
        _ = apple.stop()
        // A production-only server does not follow 21007 to the sandbox.
        let productionOnly = try server("apple", environment: "production")
        let sandboxReceipt = try receiptGrant(receipt, server: productionOnly, tmp: tmp, transactionId: bought)
        #expect(sandboxReceipt.status == 403 && sandboxReceipt.errorCode == "wrong-environment", "\(sandboxReceipt.text)")
        _ = productionOnly.stop()
        // Nobody answering: 503, so the device retries.
        let unreachable = try server("apple", productionURL: "http://127.0.0.1:1")
        let down = try receiptGrant(receipt, server: unreachable, tmp: tmp, transactionId: bought)
        #expect(down.status == 503 && down.errorCode == "receipt-service-unavailable", "\(down.text)")
        _ = unreachable.stop()
    }

    @Test(
        "every documented verifyReceipt status maps to an answer or a clear error",
        arguments: [
            (0, nil), (21006, nil), (21000, "malformed"), (21002, "malformed"), (21003, "not-authenticated"), (21004, "wrong-shared-secret"),
            (21005, "unavailable"), (21007, "wrong-environment"), (21008, "wrong-environment"), (21009, "unavailable"), (21010, "account-not-found"),
            (21100, "unavailable"), (21199, "unavailable"), (21011, "malformed-response"), (-1, "malformed-response"),
        ] as [(Int, String?)])
    func verifyReceiptStatuses(status: Int, code: String?) throws {
        let receipt = VerifyReceiptResponse.Receipt(
            receiptType: "ProductionSandbox", bundleId: bundleId, applicationVersion: "1", originalApplicationVersion: "1", receiptCreationDateMs: "0", inApp: [])
        do {
            _ = try VerifyReceiptClient.judge(VerifyReceiptResponse(status: status, environment: "Sandbox", receipt: receipt))
            #expect(code == nil)
        } catch {
            #expect(error.code.rawValue == code)
            #expect(error.message.contains(String(status)) || status == -1)
        }
    }

    @Test("both mode refuses when the two readings differ in app, environment, purchases or cancellations")
    func receiptAgreement() {
        let now = Date()
        let purchase = InAppPurchase(productId: "p", transactionId: "1", originalTransactionId: "1", purchaseDate: now)
        func receipt(_ purchases: [InAppPurchase], bundle: String = "com.example.app", type: String = "ProductionSandbox") -> AppReceipt {
            AppReceipt(
                receiptType: type, bundleId: bundle, appVersion: "1", originalAppVersion: nil, creationDate: now, expirationDate: nil, inAppPurchases: purchases)
        }
        var cancelled = purchase
        cancelled.cancellationDate = now
        var other = purchase
        other.productId = "q"
        #expect(ReceiptChecker.agree(receipt([purchase]), receipt([purchase])))
        #expect(!ReceiptChecker.agree(receipt([purchase]), receipt([cancelled])))
        #expect(!ReceiptChecker.agree(receipt([purchase]), receipt([other])))
        #expect(!ReceiptChecker.agree(receipt([purchase]), receipt([])))
        #expect(!ReceiptChecker.agree(receipt([purchase]), receipt([purchase], bundle: "x")))
        #expect(!ReceiptChecker.agree(receipt([purchase]), receipt([purchase], type: "Production")))
    }
}

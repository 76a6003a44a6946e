import AppStoreServerAPI
import AppStoreServerClient
import Foundation
import PurchaseVerification
import ReceiptVerification

/// Verifies app receipts the configured way (``ReceiptVerificationMode``) and returns one
/// ``AppReceipt`` whichever did it, so granting never depends on how a receipt was checked.
struct ReceiptChecker: Sendable {
    let mode: ReceiptVerificationMode
    let local: ReceiptVerifier
    let apple: VerifyReceiptClient
    let bundles: BundlePolicy
    let environments: EnvironmentPolicy

    func verify(base64 text: String) async throws(VerificationError) -> AppReceipt {
        switch mode {
        case .local:
            return try local.verify(base64: text)
        case .apple:
            return try await askApple(text)
        case .both:
            let mine = try local.verify(base64: text)
            let apples = try await askApple(text)
            guard Self.agree(mine, apples) else {
                throw VerificationError(
                    .verifiersDisagree, "the receipt verified here and by Apple's verifyReceipt name different purchases or cancellations: refused to be safe")
            }
            return mine
        }
    }

    /// Same app, environment and purchases (ids, products, cancellation or not).
    static func agree(_ a: AppReceipt, _ b: AppReceipt) -> Bool {
        func key(_ r: AppReceipt) -> [String] {
            r.inAppPurchases.map { "\($0.transactionId)|\($0.productId)|\($0.originalTransactionId)|\($0.cancellationDate != nil)" }.sorted()
        }
        return a.bundleId == b.bundleId && a.environment == b.environment && key(a) == key(b)
    }

    private func askApple(_ text: String) async throws(VerificationError) -> AppReceipt {
        let response: VerifyReceiptResponse
        do { response = try await apple.verify(text, allowSandbox: environments.accepted.contains(.sandbox)) } catch {
            let code: VerificationErrorCode =
                switch error.code {
                case .malformed: .malformed
                case .notAuthenticated: .invalidSignature
                case .wrongEnvironment: .wrongEnvironment
                case .accountNotFound: .unknownAccount
                case .unreachable, .unavailable, .wrongSharedSecret, .malformedResponse: .receiptServiceUnavailable
                }
            throw VerificationError(code, error.message)
        }
        guard let decoded = response.receipt else { throw VerificationError(.receiptServiceUnavailable, "verifyReceipt answered without a receipt") }
        let receipt = Self.receipt(decoded, environment: response.environment)
        guard bundles.contains(receipt.bundleId) else {
            throw VerificationError(.wrongBundleId, "the receipt is for bundle id '\(receipt.bundleId)', \(bundles.notConfigured)")
        }
        guard let environment = receipt.environment, environments.accepted.contains(environment) else {
            throw VerificationError(.wrongEnvironment, "the receipt's environment '\(response.environment ?? "none")' is not accepted here (\(environments))")
        }
        return receipt
    }

    /// Apple's JSON (strings for numbers and dates) as an ``AppReceipt``.
    static func receipt(_ r: VerifyReceiptResponse.Receipt, environment: String?) -> AppReceipt {
        func date(_ ms: String?) -> Date? { ms.flatMap(Int64.init).map { Date(storeAPIMilliseconds: $0) } }
        return AppReceipt(
            receiptType: environment == "Production" ? "Production" : environment == "Sandbox" ? "ProductionSandbox" : r.receiptType,
            bundleId: r.bundleId, appVersion: r.applicationVersion ?? "", originalAppVersion: r.originalApplicationVersion,
            creationDate: date(r.receiptCreationDateMs) ?? Date(timeIntervalSince1970: 0), expirationDate: nil,
            inAppPurchases: r.inApp.map { p in
                InAppPurchase(
                    quantity: p.quantity.flatMap(Int.init) ?? 1, productId: p.productId, transactionId: p.transactionId,
                    originalTransactionId: p.originalTransactionId ?? p.transactionId, purchaseDate: date(p.purchaseDateMs) ?? Date(timeIntervalSince1970: 0),
                    originalPurchaseDate: date(p.originalPurchaseDateMs), expiresDate: date(p.expiresDateMs), webOrderLineItemId: p.webOrderLineItemId.flatMap(Int64.init),
                    cancellationDate: date(p.cancellationDateMs))
            })
    }
}

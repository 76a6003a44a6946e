import Foundation
import PurchaseVerification

/// A StoreKit 1 app receipt's payload (`Bundle.main.appStoreReceiptURL`), as Apple documents its
/// ASN.1 fields. Dates the receipt leaves empty are nil.
public struct AppReceipt: Sendable, Equatable, Codable {
    /// Field 0: `Production`, `ProductionSandbox` or `Xcode`; which App Store signed it.
    public var receiptType: String?
    /// Field 2.
    public var bundleId: String
    /// Field 3.
    public var appVersion: String
    /// Field 19.
    public var originalAppVersion: String?
    /// Field 12: when the receipt was made; its chain is validated at this date.
    public var creationDate: Date
    /// Field 21 (volume purchase program receipts only).
    public var expirationDate: Date?
    /// Fields 4 and 5: what the device checks the receipt against; kept for completeness.
    public var opaqueValue: [UInt8]
    public var sha1Hash: [UInt8]
    /// Field 17, one per purchase.
    public var inAppPurchases: [InAppPurchase]

    public init(
        receiptType: String?, bundleId: String, appVersion: String, originalAppVersion: String?, creationDate: Date, expirationDate: Date?,
        opaqueValue: [UInt8] = [], sha1Hash: [UInt8] = [], inAppPurchases: [InAppPurchase]
    ) {
        self.receiptType = receiptType
        self.bundleId = bundleId
        self.appVersion = appVersion
        self.originalAppVersion = originalAppVersion
        self.creationDate = creationDate
        self.expirationDate = expirationDate
        self.opaqueValue = opaqueValue
        self.sha1Hash = sha1Hash
        self.inAppPurchases = inAppPurchases
    }

    /// The App Store environment the receipt belongs to, in StoreKit 2's words.
    public var environment: AppStoreEnvironment? {
        switch receiptType {
        case "Production": .production
        case "ProductionSandbox", "Sandbox": .sandbox
        case "Xcode": .xcode
        default: nil
        }
    }

    /// Each purchase as a StoreKit 2 transaction value, so that one function
    /// (`entitlement(for:configuration:)`) decides for receipts and signed transactions alike.
    public var transactions: [Transaction] {
        inAppPurchases.map { purchase in
            var transaction = Transaction(
                transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId, bundleId: bundleId,
                productId: purchase.productId, purchaseDate: purchase.purchaseDate,
                // A receipt names no product type; an expiry makes it a subscription, to be checked.
                type: purchase.expiresDate == nil ? .nonConsumable : .autoRenewable, environment: environment, signedDate: creationDate)
            transaction.quantity = purchase.quantity
            transaction.expiresDate = purchase.expiresDate
            transaction.revocationDate = purchase.cancellationDate
            transaction.originalPurchaseDate = purchase.originalPurchaseDate
            transaction.webOrderLineItemId = purchase.webOrderLineItemId.map(String.init)
            return transaction
        }
    }
}

/// One in-app purchase of a receipt (field 17's nested set).
public struct InAppPurchase: Sendable, Equatable, Codable {
    /// 1701.
    public var quantity: Int
    /// 1702.
    public var productId: String
    /// 1703.
    public var transactionId: String
    /// 1705.
    public var originalTransactionId: String
    /// 1704.
    public var purchaseDate: Date
    /// 1706.
    public var originalPurchaseDate: Date?
    /// 1708: subscriptions only.
    public var expiresDate: Date?
    /// 1711.
    public var webOrderLineItemId: Int64?
    /// 1712: set when Apple refunded or revoked the purchase.
    public var cancellationDate: Date?

    public init(
        quantity: Int = 1, productId: String, transactionId: String, originalTransactionId: String, purchaseDate: Date,
        originalPurchaseDate: Date? = nil, expiresDate: Date? = nil, webOrderLineItemId: Int64? = nil, cancellationDate: Date? = nil
    ) {
        self.quantity = quantity
        self.productId = productId
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.purchaseDate = purchaseDate
        self.originalPurchaseDate = originalPurchaseDate
        self.expiresDate = expiresDate
        self.webOrderLineItemId = webOrderLineItemId
        self.cancellationDate = cancellationDate
    }
}

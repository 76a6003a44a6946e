import Foundation

// Apple's legacy `verifyReceipt` endpoint (https://buy.itunes.apple.com/verifyReceipt and
// https://sandbox.itunes.apple.com/verifyReceipt), as StoreKit 1 servers call it. Deprecated by
// Apple in favour of the App Store Server API, still what the apps that used hosted content use.

/// The request body.
public struct VerifyReceiptRequest: Codable, Sendable, Equatable {
    /// The app receipt, base64.
    public var receiptData: String
    /// The app-specific shared secret (needed for auto-renewable subscriptions).
    public var password: String?
    public var excludeOldTransactions: Bool?

    enum CodingKeys: String, CodingKey {
        case receiptData = "receipt-data", password, excludeOldTransactions = "exclude-old-transactions"
    }

    public init(receiptData: String, password: String? = nil, excludeOldTransactions: Bool? = nil) {
        self.receiptData = receiptData
        self.password = password
        self.excludeOldTransactions = excludeOldTransactions
    }
}

/// The response: `status` 0 with the decoded receipt, or one of Apple's status codes.
public struct VerifyReceiptResponse: Codable, Sendable, Equatable {
    public var status: Int
    /// `Production` or `Sandbox`.
    public var environment: String?
    public var receipt: Receipt?
    /// The latest receipt (base64), for subscriptions.
    public var latestReceipt: String?
    public var isRetryable: Bool?

    enum CodingKeys: String, CodingKey {
        case status, environment, receipt, latestReceipt = "latest_receipt", isRetryable = "is-retryable"
    }

    public init(status: Int, environment: String? = nil, receipt: Receipt? = nil, latestReceipt: String? = nil, isRetryable: Bool? = nil) {
        self.status = status
        self.environment = environment
        self.receipt = receipt
        self.latestReceipt = latestReceipt
        self.isRetryable = isRetryable
    }

    /// The decoded receipt. Apple writes numbers and dates as strings (`"purchase_date_ms": "1582996368000"`).
    public struct Receipt: Codable, Sendable, Equatable {
        public var receiptType: String?
        public var bundleId: String
        public var applicationVersion: String?
        public var originalApplicationVersion: String?
        public var receiptCreationDateMs: String?
        public var inApp: [InApp]

        enum CodingKeys: String, CodingKey {
            case receiptType = "receipt_type", bundleId = "bundle_id", applicationVersion = "application_version"
            case originalApplicationVersion = "original_application_version", receiptCreationDateMs = "receipt_creation_date_ms", inApp = "in_app"
        }

        public init(
            receiptType: String?, bundleId: String, applicationVersion: String?, originalApplicationVersion: String?, receiptCreationDateMs: String?,
            inApp: [InApp]
        ) {
            self.receiptType = receiptType
            self.bundleId = bundleId
            self.applicationVersion = applicationVersion
            self.originalApplicationVersion = originalApplicationVersion
            self.receiptCreationDateMs = receiptCreationDateMs
            self.inApp = inApp
        }
    }

    public struct InApp: Codable, Sendable, Equatable {
        public var quantity: String?
        public var productId: String
        public var transactionId: String
        public var originalTransactionId: String?
        public var purchaseDateMs: String?
        public var originalPurchaseDateMs: String?
        public var expiresDateMs: String?
        public var cancellationDateMs: String?
        public var webOrderLineItemId: String?

        enum CodingKeys: String, CodingKey {
            case quantity, productId = "product_id", transactionId = "transaction_id", originalTransactionId = "original_transaction_id"
            case purchaseDateMs = "purchase_date_ms", originalPurchaseDateMs = "original_purchase_date_ms", expiresDateMs = "expires_date_ms"
            case cancellationDateMs = "cancellation_date_ms", webOrderLineItemId = "web_order_line_item_id"
        }

        public init(
            quantity: String?, productId: String, transactionId: String, originalTransactionId: String?, purchaseDateMs: String?,
            originalPurchaseDateMs: String?, expiresDateMs: String?, cancellationDateMs: String?, webOrderLineItemId: String?
        ) {
            self.quantity = quantity
            self.productId = productId
            self.transactionId = transactionId
            self.originalTransactionId = originalTransactionId
            self.purchaseDateMs = purchaseDateMs
            self.originalPurchaseDateMs = originalPurchaseDateMs
            self.expiresDateMs = expiresDateMs
            self.cancellationDateMs = cancellationDateMs
            self.webOrderLineItemId = webOrderLineItemId
        }
    }
}

/// Apple's documented `verifyReceipt` status codes.
public enum VerifyReceiptStatus {
    public static let valid = 0
    /// The request was not an HTTP POST, or its JSON was malformed.
    public static let badRequest = 21000
    /// `receipt-data` was malformed or the service had a problem reading it.
    public static let malformedReceipt = 21002
    /// The receipt could not be authenticated.
    public static let notAuthenticated = 21003
    /// The shared secret does not match the account's.
    public static let wrongSharedSecret = 21004
    /// The receipt server was temporarily unable to provide the receipt.
    public static let unavailable = 21005
    /// Valid, but the subscription has expired (the receipt is decoded and returned).
    public static let subscriptionExpired = 21006
    /// A sandbox receipt sent to the production service: send it to the sandbox.
    public static let sandboxReceipt = 21007
    /// A production receipt sent to the sandbox service: send it to production.
    public static let productionReceipt = 21008
    /// Internal data access error; try again later.
    public static let internalError = 21009
    /// The user account cannot be found or has been deleted.
    public static let accountNotFound = 21010
    /// 21100-21199: internal data access errors.
    public static let internalRange = 21100...21199

    public static let productionURL = "https://buy.itunes.apple.com/verifyReceipt"
    public static let sandboxURL = "https://sandbox.itunes.apple.com/verifyReceipt"
}

import Foundation

/// A string-valued enumeration that keeps values it does not know, so that a new value Apple
/// adds never breaks decoding.
public protocol OpenStringEnum: RawRepresentable, Codable, Hashable, Sendable, CustomStringConvertible where RawValue == String {
    init(rawValue: String)
}

extension OpenStringEnum {
    public init(from decoder: any Decoder) throws {
        self.init(rawValue: try decoder.singleValueContainer().decode(String.self))
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.singleValueContainer()
        try container.encode(rawValue)
    }

    public var description: String { rawValue }
}

/// The App Store environment a payload was signed for.
public struct AppStoreEnvironment: OpenStringEnum {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public static let production = Self(rawValue: "Production")
    public static let sandbox = Self(rawValue: "Sandbox")
    public static let xcode = Self(rawValue: "Xcode")
    public static let localTesting = Self(rawValue: "LocalTesting")
}

/// `type` of a transaction.
public struct ProductType: OpenStringEnum {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public static let nonConsumable = Self(rawValue: "Non-Consumable")
    public static let consumable = Self(rawValue: "Consumable")
    public static let autoRenewable = Self(rawValue: "Auto-Renewable Subscription")
    public static let nonRenewing = Self(rawValue: "Non-Renewing Subscription")
}

/// `inAppOwnershipType` of a transaction.
public struct OwnershipType: OpenStringEnum {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public static let purchased = Self(rawValue: "PURCHASED")
    public static let familyShared = Self(rawValue: "FAMILY_SHARED")
}

/// `transactionReason` of a transaction.
public struct TransactionReason: OpenStringEnum {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public static let purchase = Self(rawValue: "PURCHASE")
    public static let renewal = Self(rawValue: "RENEWAL")
}

/// `notificationType` of an App Store Server Notification V2.
public struct NotificationType: OpenStringEnum {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public static let refund = Self(rawValue: "REFUND")
    public static let revoke = Self(rawValue: "REVOKE")
    public static let refundReversed = Self(rawValue: "REFUND_REVERSED")
    public static let refundDeclined = Self(rawValue: "REFUND_DECLINED")
    public static let expired = Self(rawValue: "EXPIRED")
    public static let didRenew = Self(rawValue: "DID_RENEW")
    public static let subscribed = Self(rawValue: "SUBSCRIBED")
    public static let consumptionRequest = Self(rawValue: "CONSUMPTION_REQUEST")
    public static let test = Self(rawValue: "TEST")
}

/// Reads Apple's dates: integers (sometimes written as floats) of milliseconds since 1970.
extension KeyedDecodingContainer {
    func decodeMillis(_ key: Key) throws -> Date? {
        if let millis = try? decodeIfPresent(Int64.self, forKey: key) {
            return Date(timeIntervalSince1970: TimeInterval(millis) / 1000)
        }
        guard let millis = try decodeIfPresent(Double.self, forKey: key) else { return nil }
        return Date(timeIntervalSince1970: millis / 1000)
    }
}

extension KeyedEncodingContainer {
    mutating func encodeMillis(_ date: Date?, _ key: Key) throws {
        guard let date else { return }
        try encode(Int64((date.timeIntervalSince1970 * 1000).rounded()), forKey: key)
    }
}

/// A decoded StoreKit 2 signed transaction (`JWSTransactionDecodedPayload`). Every documented
/// field is here; unknown fields are ignored and unknown enumeration values kept.
public struct Transaction: Codable, Sendable, Equatable {
    public var transactionId: String?
    public var originalTransactionId: String?
    public var webOrderLineItemId: String?
    public var bundleId: String?
    public var productId: String?
    public var subscriptionGroupIdentifier: String?
    public var purchaseDate: Date?
    public var originalPurchaseDate: Date?
    public var expiresDate: Date?
    public var quantity: Int?
    public var type: ProductType?
    public var appAccountToken: UUID?
    public var inAppOwnershipType: OwnershipType?
    public var signedDate: Date?
    /// 0: other reason, 1: an issue in the app.
    public var revocationReason: Int?
    public var revocationDate: Date?
    public var isUpgraded: Bool?
    public var offerType: Int?
    public var offerIdentifier: String?
    public var environment: AppStoreEnvironment?
    public var storefront: String?
    public var storefrontId: String?
    public var transactionReason: TransactionReason?
    public var currency: String?
    /// In milliunits of `currency`.
    public var price: Int64?
    public var offerDiscountType: String?
    public var appTransactionId: String?
    public var offerPeriod: String?

    public init(
        transactionId: String? = nil, originalTransactionId: String? = nil, bundleId: String? = nil, productId: String? = nil,
        purchaseDate: Date? = nil, type: ProductType? = nil, environment: AppStoreEnvironment? = nil, signedDate: Date? = nil
    ) {
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.bundleId = bundleId
        self.productId = productId
        self.purchaseDate = purchaseDate
        self.originalPurchaseDate = purchaseDate
        self.type = type
        self.environment = environment
        self.signedDate = signedDate
    }

    enum CodingKeys: String, CodingKey {
        case transactionId, originalTransactionId, webOrderLineItemId, bundleId, productId, subscriptionGroupIdentifier
        case purchaseDate, originalPurchaseDate, expiresDate, quantity, type, appAccountToken, inAppOwnershipType
        case signedDate, revocationReason, revocationDate, isUpgraded, offerType, offerIdentifier, environment
        case storefront, storefrontId, transactionReason, currency, price, offerDiscountType, appTransactionId, offerPeriod
    }

    public init(from decoder: any Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        transactionId = try c.decodeIfPresent(String.self, forKey: .transactionId)
        originalTransactionId = try c.decodeIfPresent(String.self, forKey: .originalTransactionId)
        webOrderLineItemId = try c.decodeIfPresent(String.self, forKey: .webOrderLineItemId)
        bundleId = try c.decodeIfPresent(String.self, forKey: .bundleId)
        productId = try c.decodeIfPresent(String.self, forKey: .productId)
        subscriptionGroupIdentifier = try c.decodeIfPresent(String.self, forKey: .subscriptionGroupIdentifier)
        purchaseDate = try c.decodeMillis(.purchaseDate)
        originalPurchaseDate = try c.decodeMillis(.originalPurchaseDate)
        expiresDate = try c.decodeMillis(.expiresDate)
        quantity = try c.decodeIfPresent(Int.self, forKey: .quantity)
        type = try c.decodeIfPresent(ProductType.self, forKey: .type)
        appAccountToken = try c.decodeIfPresent(UUID.self, forKey: .appAccountToken)
        inAppOwnershipType = try c.decodeIfPresent(OwnershipType.self, forKey: .inAppOwnershipType)
        signedDate = try c.decodeMillis(.signedDate)
        revocationReason = try c.decodeIfPresent(Int.self, forKey: .revocationReason)
        revocationDate = try c.decodeMillis(.revocationDate)
        isUpgraded = try c.decodeIfPresent(Bool.self, forKey: .isUpgraded)
        offerType = try c.decodeIfPresent(Int.self, forKey: .offerType)
        offerIdentifier = try c.decodeIfPresent(String.self, forKey: .offerIdentifier)
        environment = try c.decodeIfPresent(AppStoreEnvironment.self, forKey: .environment)
        storefront = try c.decodeIfPresent(String.self, forKey: .storefront)
        storefrontId = try c.decodeIfPresent(String.self, forKey: .storefrontId)
        transactionReason = try c.decodeIfPresent(TransactionReason.self, forKey: .transactionReason)
        currency = try c.decodeIfPresent(String.self, forKey: .currency)
        price = try c.decodeIfPresent(Int64.self, forKey: .price)
        offerDiscountType = try c.decodeIfPresent(String.self, forKey: .offerDiscountType)
        appTransactionId = try c.decodeIfPresent(String.self, forKey: .appTransactionId)
        offerPeriod = try c.decodeIfPresent(String.self, forKey: .offerPeriod)
    }

    public func encode(to encoder: any Encoder) throws {
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encodeIfPresent(transactionId, forKey: .transactionId)
        try c.encodeIfPresent(originalTransactionId, forKey: .originalTransactionId)
        try c.encodeIfPresent(webOrderLineItemId, forKey: .webOrderLineItemId)
        try c.encodeIfPresent(bundleId, forKey: .bundleId)
        try c.encodeIfPresent(productId, forKey: .productId)
        try c.encodeIfPresent(subscriptionGroupIdentifier, forKey: .subscriptionGroupIdentifier)
        try c.encodeMillis(purchaseDate, .purchaseDate)
        try c.encodeMillis(originalPurchaseDate, .originalPurchaseDate)
        try c.encodeMillis(expiresDate, .expiresDate)
        try c.encodeIfPresent(quantity, forKey: .quantity)
        try c.encodeIfPresent(type, forKey: .type)
        try c.encodeIfPresent(appAccountToken, forKey: .appAccountToken)
        try c.encodeIfPresent(inAppOwnershipType, forKey: .inAppOwnershipType)
        try c.encodeMillis(signedDate, .signedDate)
        try c.encodeIfPresent(revocationReason, forKey: .revocationReason)
        try c.encodeMillis(revocationDate, .revocationDate)
        try c.encodeIfPresent(isUpgraded, forKey: .isUpgraded)
        try c.encodeIfPresent(offerType, forKey: .offerType)
        try c.encodeIfPresent(offerIdentifier, forKey: .offerIdentifier)
        try c.encodeIfPresent(environment, forKey: .environment)
        try c.encodeIfPresent(storefront, forKey: .storefront)
        try c.encodeIfPresent(storefrontId, forKey: .storefrontId)
        try c.encodeIfPresent(transactionReason, forKey: .transactionReason)
        try c.encodeIfPresent(currency, forKey: .currency)
        try c.encodeIfPresent(price, forKey: .price)
        try c.encodeIfPresent(offerDiscountType, forKey: .offerDiscountType)
        try c.encodeIfPresent(appTransactionId, forKey: .appTransactionId)
        try c.encodeIfPresent(offerPeriod, forKey: .offerPeriod)
    }
}

/// A decoded signed renewal info (`JWSRenewalInfoDecodedPayload`).
public struct RenewalInfo: Codable, Sendable, Equatable {
    public var originalTransactionId: String?
    public var autoRenewProductId: String?
    public var productId: String?
    public var autoRenewStatus: Int?
    public var isInBillingRetryPeriod: Bool?
    public var priceIncreaseStatus: Int?
    public var gracePeriodExpiresDate: Date?
    public var expirationIntent: Int?
    public var offerType: Int?
    public var offerIdentifier: String?
    public var signedDate: Date?
    public var environment: AppStoreEnvironment?
    public var recentSubscriptionStartDate: Date?
    public var renewalDate: Date?
    public var currency: String?
    public var renewalPrice: Int64?
    public var appAccountToken: UUID?
    public var appTransactionId: String?

    enum CodingKeys: String, CodingKey {
        case originalTransactionId, autoRenewProductId, productId, autoRenewStatus, isInBillingRetryPeriod
        case priceIncreaseStatus, gracePeriodExpiresDate, expirationIntent, offerType, offerIdentifier, signedDate
        case environment, recentSubscriptionStartDate, renewalDate, currency, renewalPrice, appAccountToken, appTransactionId
    }

    public init(from decoder: any Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        originalTransactionId = try c.decodeIfPresent(String.self, forKey: .originalTransactionId)
        autoRenewProductId = try c.decodeIfPresent(String.self, forKey: .autoRenewProductId)
        productId = try c.decodeIfPresent(String.self, forKey: .productId)
        autoRenewStatus = try c.decodeIfPresent(Int.self, forKey: .autoRenewStatus)
        isInBillingRetryPeriod = try c.decodeIfPresent(Bool.self, forKey: .isInBillingRetryPeriod)
        priceIncreaseStatus = try c.decodeIfPresent(Int.self, forKey: .priceIncreaseStatus)
        gracePeriodExpiresDate = try c.decodeMillis(.gracePeriodExpiresDate)
        expirationIntent = try c.decodeIfPresent(Int.self, forKey: .expirationIntent)
        offerType = try c.decodeIfPresent(Int.self, forKey: .offerType)
        offerIdentifier = try c.decodeIfPresent(String.self, forKey: .offerIdentifier)
        signedDate = try c.decodeMillis(.signedDate)
        environment = try c.decodeIfPresent(AppStoreEnvironment.self, forKey: .environment)
        recentSubscriptionStartDate = try c.decodeMillis(.recentSubscriptionStartDate)
        renewalDate = try c.decodeMillis(.renewalDate)
        currency = try c.decodeIfPresent(String.self, forKey: .currency)
        renewalPrice = try c.decodeIfPresent(Int64.self, forKey: .renewalPrice)
        appAccountToken = try c.decodeIfPresent(UUID.self, forKey: .appAccountToken)
        appTransactionId = try c.decodeIfPresent(String.self, forKey: .appTransactionId)
    }

    public func encode(to encoder: any Encoder) throws {
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encodeIfPresent(originalTransactionId, forKey: .originalTransactionId)
        try c.encodeIfPresent(autoRenewProductId, forKey: .autoRenewProductId)
        try c.encodeIfPresent(productId, forKey: .productId)
        try c.encodeIfPresent(autoRenewStatus, forKey: .autoRenewStatus)
        try c.encodeIfPresent(isInBillingRetryPeriod, forKey: .isInBillingRetryPeriod)
        try c.encodeIfPresent(priceIncreaseStatus, forKey: .priceIncreaseStatus)
        try c.encodeMillis(gracePeriodExpiresDate, .gracePeriodExpiresDate)
        try c.encodeIfPresent(expirationIntent, forKey: .expirationIntent)
        try c.encodeIfPresent(offerType, forKey: .offerType)
        try c.encodeIfPresent(offerIdentifier, forKey: .offerIdentifier)
        try c.encodeMillis(signedDate, .signedDate)
        try c.encodeIfPresent(environment, forKey: .environment)
        try c.encodeMillis(recentSubscriptionStartDate, .recentSubscriptionStartDate)
        try c.encodeMillis(renewalDate, .renewalDate)
        try c.encodeIfPresent(currency, forKey: .currency)
        try c.encodeIfPresent(renewalPrice, forKey: .renewalPrice)
        try c.encodeIfPresent(appAccountToken, forKey: .appAccountToken)
        try c.encodeIfPresent(appTransactionId, forKey: .appTransactionId)
    }
}

/// A decoded App Store Server Notification V2 (`ResponseBodyV2DecodedPayload`).
public struct NotificationPayload: Codable, Sendable, Equatable {
    public struct Data: Codable, Sendable, Equatable {
        public var appAppleId: Int64?
        public var bundleId: String?
        public var bundleVersion: String?
        public var environment: AppStoreEnvironment?
        public var signedTransactionInfo: String?
        public var signedRenewalInfo: String?
        public var status: Int?

        public init(bundleId: String?, environment: AppStoreEnvironment?, signedTransactionInfo: String?) {
            self.bundleId = bundleId
            self.environment = environment
            self.signedTransactionInfo = signedTransactionInfo
        }
    }

    public var notificationType: NotificationType?
    public var subtype: String?
    public var notificationUUID: String?
    public var version: String?
    public var signedDate: Date?
    public var data: Data?

    public init(notificationType: NotificationType, subtype: String? = nil, notificationUUID: String, signedDate: Date, data: Data) {
        self.notificationType = notificationType
        self.subtype = subtype
        self.notificationUUID = notificationUUID
        self.version = "2.0"
        self.signedDate = signedDate
        self.data = data
    }

    enum CodingKeys: String, CodingKey { case notificationType, subtype, notificationUUID, version, signedDate, data }

    public init(from decoder: any Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        notificationType = try c.decodeIfPresent(NotificationType.self, forKey: .notificationType)
        subtype = try c.decodeIfPresent(String.self, forKey: .subtype)
        notificationUUID = try c.decodeIfPresent(String.self, forKey: .notificationUUID)
        version = try c.decodeIfPresent(String.self, forKey: .version)
        signedDate = try c.decodeMillis(.signedDate)
        data = try c.decodeIfPresent(Data.self, forKey: .data)
    }

    public func encode(to encoder: any Encoder) throws {
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encodeIfPresent(notificationType, forKey: .notificationType)
        try c.encodeIfPresent(subtype, forKey: .subtype)
        try c.encodeIfPresent(notificationUUID, forKey: .notificationUUID)
        try c.encodeIfPresent(version, forKey: .version)
        try c.encodeMillis(signedDate, .signedDate)
        try c.encodeIfPresent(data, forKey: .data)
    }
}

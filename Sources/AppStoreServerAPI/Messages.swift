import Foundation

// The App Store Server API's JSON bodies, as Apple documents them and its official libraries
// read them. Dates are integers (milliseconds since 1970), as on the wire, so nothing is lost
// or rounded between a server that answers and a client that reads.

/// `GET /inApps/v1/transactions/{transactionId}`: one signed transaction.
public struct TransactionInfoResponse: Codable, Sendable, Equatable {
    public var signedTransactionInfo: String

    public init(signedTransactionInfo: String) { self.signedTransactionInfo = signedTransactionInfo }
}

/// `GET /inApps/v2/history/{transactionId}`: a page of up to 20 signed transactions.
public struct HistoryResponse: Codable, Sendable, Equatable {
    /// Pass back as `revision` for the next page.
    public var revision: String
    public var hasMore: Bool
    public var bundleId: String
    public var appAppleId: Int64?
    /// `Sandbox` or `Production`.
    public var environment: String
    public var signedTransactions: [String]

    public init(revision: String, hasMore: Bool, bundleId: String, appAppleId: Int64?, environment: String, signedTransactions: [String]) {
        self.revision = revision
        self.hasMore = hasMore
        self.bundleId = bundleId
        self.appAppleId = appAppleId
        self.environment = environment
        self.signedTransactions = signedTransactions
    }
}

/// The body of `POST /inApps/v1/notifications/history`.
public struct NotificationHistoryRequest: Codable, Sendable, Equatable {
    /// Milliseconds since 1970; Apple keeps 180 days.
    public var startDate: Int64?
    public var endDate: Int64?
    public var notificationType: String?
    public var notificationSubtype: String?
    public var transactionId: String?
    public var onlyFailures: Bool?

    public init(
        startDate: Int64?, endDate: Int64?, notificationType: String? = nil, notificationSubtype: String? = nil,
        transactionId: String? = nil, onlyFailures: Bool? = nil
    ) {
        self.startDate = startDate
        self.endDate = endDate
        self.notificationType = notificationType
        self.notificationSubtype = notificationSubtype
        self.transactionId = transactionId
        self.onlyFailures = onlyFailures
    }
}

/// One attempt to deliver a notification to the app's server.
public struct SendAttempt: Codable, Sendable, Equatable {
    public var attemptDate: Int64
    /// `SUCCESS`, `NO_RESPONSE`, `UNSUCCESSFUL_HTTP_RESPONSE_CODE`, … (Apple's `SendAttemptResult`).
    public var sendAttemptResult: String

    public init(attemptDate: Int64, sendAttemptResult: String) {
        self.attemptDate = attemptDate
        self.sendAttemptResult = sendAttemptResult
    }

    public static let success = "SUCCESS"
}

/// One notification in the history: what was sent and every attempt to send it.
public struct NotificationHistoryItem: Codable, Sendable, Equatable {
    public var signedPayload: String
    public var sendAttempts: [SendAttempt]

    public init(signedPayload: String, sendAttempts: [SendAttempt]) {
        self.signedPayload = signedPayload
        self.sendAttempts = sendAttempts
    }
}

/// A page of the notification history; `paginationToken` asks for the next one.
public struct NotificationHistoryResponse: Codable, Sendable, Equatable {
    public var paginationToken: String?
    public var hasMore: Bool
    public var notificationHistory: [NotificationHistoryItem]

    public init(paginationToken: String?, hasMore: Bool, notificationHistory: [NotificationHistoryItem]) {
        self.paginationToken = paginationToken
        self.hasMore = hasMore
        self.notificationHistory = notificationHistory
    }
}

/// Apple's error body: a numeric code and a sentence. The numbers are Apple's, so a client
/// written for Apple's service branches the same way against the sandbox.
public struct StoreAPIError: Codable, Sendable, Equatable, Error {
    public var errorCode: Int
    public var errorMessage: String

    public init(_ errorCode: Int, _ errorMessage: String) {
        self.errorCode = errorCode
        self.errorMessage = errorMessage
    }

    public static let generalBadRequest = 4_000_000
    public static let invalidRevision = 4_000_005
    public static let invalidTransactionId = 4_000_006
    public static let startDateTooFarInPast = 4_000_012
    public static let startDateAfterEndDate = 4_000_013
    public static let invalidPaginationToken = 4_000_014
    public static let invalidStartDate = 4_000_015
    public static let invalidEndDate = 4_000_016
    public static let invalidNotificationType = 4_000_018
    public static let multipleFiltersSupplied = 4_000_019
    public static let invalidSort = 4_000_021
    public static let invalidProductType = 4_000_022
    public static let invalidProductId = 4_000_023
    public static let invalidInAppOwnershipType = 4_000_026
    public static let invalidRevoked = 4_000_030
    public static let transactionIdNotFound = 4_040_010
    public static let rateLimitExceeded = 4_290_000
    public static let generalInternal = 5_000_000
}

/// The API's paths and limits.
public enum StoreAPIRoute {
    public static let transactionInfoPrefix = "/inApps/v1/transactions/"
    public static let historyPrefix = "/inApps/v2/history/"
    public static let notificationHistory = "/inApps/v1/notifications/history"
    /// Apple answers history requests in pages of 20.
    public static let pageSize = 20
    /// Apple keeps notification history for 180 days.
    public static let notificationHistoryDays = 180
    public static let productionURL = "https://api.storekit.apple.com"
    public static let sandboxURL = "https://api.storekit-sandbox.apple.com"
}

extension Date {
    /// The API's date: whole milliseconds since 1970.
    public var storeAPIMilliseconds: Int64 { Int64((timeIntervalSince1970 * 1000).rounded(.down)) }

    public init(storeAPIMilliseconds: Int64) { self.init(timeIntervalSince1970: TimeInterval(storeAPIMilliseconds) / 1000) }
}

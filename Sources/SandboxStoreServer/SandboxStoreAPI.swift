import AppStoreServerAPI
import Base64URL
import Foundation
import PurchaseVerification
import ReceiptVerification
import SandboxStore
import Synchronization

/// The App Store Server API over a sandbox store: what Get Transaction Info, Get Transaction
/// History (v2) and Get Notification History answer, with Apple's status and error codes.
/// Pure over the store's files, so it is tested without HTTP as well as through it.
public struct SandboxStoreAPI: Sendable {
    public let store: SandboxStore
    /// Apple runs one host per environment; so does a sandbox API: it shows only this one's data.
    public let environment: AppStoreEnvironment

    /// The verifier of the store's receipts, made on the first `verifyReceipt` (the receipt chain
    /// may not exist before) and kept, so its warm path serves the requests after.
    private let receiptVerifier = ReceiptVerifierCache()

    public init(store: SandboxStore, environment: AppStoreEnvironment) {
        self.store = store
        self.environment = environment
    }

    /// An answer: a status with a JSON body (a response type or ``StoreAPIError``).
    public enum Answer: Sendable {
        case ok(any Encodable & Sendable)
        case error(status: Int, StoreAPIError)
    }

    // MARK: Get Transaction Info

    public func transactionInfo(_ transactionId: String, now: Date = Date()) -> Answer {
        guard Self.isTransactionId(transactionId) else { return invalidTransactionId(transactionId) }
        do {
            guard var transaction = try visibleTransactions().first(where: { $0.transactionId == transactionId }) else {
                return notFound(transactionId)
            }
            transaction.signedDate = now
            return .ok(TransactionInfoResponse(signedTransactionInfo: try store.sign(transaction)))
        } catch {
            return internalError(error)
        }
    }

    // MARK: Get Transaction History

    /// The query of a history request, as Apple's parameters name it.
    public struct HistoryQuery: Sendable {
        public var revision: String?
        public var startDate: String?
        public var endDate: String?
        public var productIds: [String] = []
        public var productTypes: [String] = []
        public var sort: String?
        public var revoked: String?
        public var inAppOwnershipType: String?

        public init() {}
    }

    static let productTypes: [String: ProductType] = [
        "AUTO_RENEWABLE": .autoRenewable, "NON_RENEWABLE": .nonRenewing, "CONSUMABLE": .consumable, "NON_CONSUMABLE": .nonConsumable,
    ]

    public func history(_ anyTransactionId: String, _ query: HistoryQuery, now: Date = Date()) -> Answer {
        guard Self.isTransactionId(anyTransactionId) else { return invalidTransactionId(anyTransactionId) }
        var start: Int64?, end: Int64?
        if let value = query.startDate {
            guard let ms = Int64(value) else { return badRequest(StoreAPIError.invalidStartDate, "startDate must be milliseconds since 1970") }
            start = ms
        }
        if let value = query.endDate {
            guard let ms = Int64(value) else { return badRequest(StoreAPIError.invalidEndDate, "endDate must be milliseconds since 1970") }
            end = ms
        }
        if let start, let end, start > end { return badRequest(StoreAPIError.startDateAfterEndDate, "startDate is after endDate") }
        var types: Set<ProductType> = []
        for name in query.productTypes {
            guard let type = Self.productTypes[name] else {
                return badRequest(StoreAPIError.invalidProductType, "productType \(name) is not one of \(Self.productTypes.keys.sorted().joined(separator: ", "))")
            }
            types.insert(type)
        }
        let descending: Bool
        switch query.sort ?? "ASCENDING" {
        case "ASCENDING": descending = false
        case "DESCENDING": descending = true
        default: return badRequest(StoreAPIError.invalidSort, "sort must be ASCENDING or DESCENDING")
        }
        var revoked: Bool?
        if let value = query.revoked {
            guard let flag = Bool(value.lowercased()) else { return badRequest(StoreAPIError.invalidRevoked, "revoked must be true or false") }
            revoked = flag
        }
        if let value = query.inAppOwnershipType, value != OwnershipType.purchased.rawValue, value != OwnershipType.familyShared.rawValue {
            return badRequest(StoreAPIError.invalidInAppOwnershipType, "inAppOwnershipType must be PURCHASED or FAMILY_SHARED")
        }
        var offset = 0
        if let revision = query.revision {
            guard let value = Self.decodeOffset(revision) else { return badRequest(StoreAPIError.invalidRevision, "revision \(revision) is not one this API gave") }
            offset = value
        }
        do {
            let all = try visibleTransactions()
            // The sandbox has one customer: every transaction of the store is that customer's.
            guard all.contains(where: { [$0.transactionId, $0.originalTransactionId, $0.appTransactionId].contains(anyTransactionId) }) else {
                return notFound(anyTransactionId)
            }
            var matching = all.filter { t in
                let purchased = t.purchaseDate?.storeAPIMilliseconds ?? 0
                if let start, purchased < start { return false }
                if let end, purchased >= end { return false }
                if !query.productIds.isEmpty, !query.productIds.contains(t.productId ?? "") { return false }
                if !types.isEmpty, !types.contains(t.type ?? ProductType(rawValue: "")) { return false }
                if let revoked, (t.revocationDate != nil) != revoked { return false }
                if let ownership = query.inAppOwnershipType, t.inAppOwnershipType?.rawValue != ownership { return false }
                return true
            }
            matching.sort { ($0.purchaseDate ?? .distantPast, $0.transactionId ?? "") < ($1.purchaseDate ?? .distantPast, $1.transactionId ?? "") }
            if descending { matching.reverse() }
            let page = matching.dropFirst(offset).prefix(StoreAPIRoute.pageSize)
            var signed: [String] = []
            for var transaction in page {
                transaction.signedDate = now
                signed.append(try store.sign(transaction))
            }
            let next = min(offset + page.count, matching.count)
            return .ok(
                HistoryResponse(
                    revision: Self.encodeOffset(next), hasMore: next < matching.count, bundleId: store.bundleId,
                    appAppleId: try store.appAppleId(), environment: environment.rawValue, signedTransactions: signed))
        } catch {
            return internalError(error)
        }
    }

    // MARK: Get Notification History

    static let notificationTypes: Set<String> = [
        "SUBSCRIBED", "DID_CHANGE_RENEWAL_PREF", "DID_CHANGE_RENEWAL_STATUS", "OFFER_REDEEMED", "DID_RENEW", "EXPIRED",
        "DID_FAIL_TO_RENEW", "GRACE_PERIOD_EXPIRED", "PRICE_INCREASE", "REFUND", "REFUND_DECLINED", "CONSUMPTION_REQUEST",
        "RENEWAL_EXTENDED", "REVOKE", "TEST", "RENEWAL_EXTENSION", "REFUND_REVERSED", "EXTERNAL_PURCHASE_TOKEN", "ONE_TIME_CHARGE",
        "RESCIND_CONSENT", "METADATA_UPDATE", "MIGRATION", "PRICE_CHANGE",
    ]

    public func notificationHistory(_ request: NotificationHistoryRequest, paginationToken: String?, now: Date = Date()) -> Answer {
        guard let start = request.startDate else { return badRequest(StoreAPIError.invalidStartDate, "startDate is required (milliseconds since 1970)") }
        guard let end = request.endDate else { return badRequest(StoreAPIError.invalidEndDate, "endDate is required (milliseconds since 1970)") }
        guard start <= end else { return badRequest(StoreAPIError.startDateAfterEndDate, "startDate is after endDate") }
        let oldest = now.addingTimeInterval(-Double(StoreAPIRoute.notificationHistoryDays) * 86_400).storeAPIMilliseconds
        guard start >= oldest else {
            return badRequest(StoreAPIError.startDateTooFarInPast, "startDate is more than \(StoreAPIRoute.notificationHistoryDays) days ago")
        }
        if request.transactionId != nil, request.notificationType != nil {
            return badRequest(StoreAPIError.multipleFiltersSupplied, "give notificationType or transactionId, not both")
        }
        if let type = request.notificationType, !Self.notificationTypes.contains(type) {
            return badRequest(StoreAPIError.invalidNotificationType, "notificationType \(type) is not one Apple sends")
        }
        if let id = request.transactionId, !Self.isTransactionId(id) { return invalidTransactionId(id) }
        var offset = 0
        if let paginationToken {
            guard let value = Self.decodeOffset(paginationToken) else {
                return badRequest(StoreAPIError.invalidPaginationToken, "paginationToken \(paginationToken) is not one this API gave")
            }
            offset = value
        }
        do {
            let matching = try store.notifications().filter { n in
                let signed = n.signedDate.storeAPIMilliseconds
                guard n.environment == environment.rawValue, signed >= start, signed <= end else { return false }
                if let type = request.notificationType, n.notificationType != type { return false }
                if let subtype = request.notificationSubtype, n.subtype != subtype { return false }
                if let id = request.transactionId, n.transactionId != id { return false }
                if request.onlyFailures == true, n.sendAttempts.contains(where: { $0.sendAttemptResult == SendAttempt.success }) { return false }
                return true
            }
            let page = matching.dropFirst(offset).prefix(StoreAPIRoute.pageSize)
            let next = offset + page.count
            return .ok(
                NotificationHistoryResponse(
                    paginationToken: next < matching.count ? Self.encodeOffset(next) : nil, hasMore: next < matching.count,
                    notificationHistory: page.map { NotificationHistoryItem(signedPayload: $0.signedPayload, sendAttempts: $0.sendAttempts) }))
        } catch {
            return internalError(error)
        }
    }

    // MARK: verifyReceipt (StoreKit 1)

    /// Apple's legacy `verifyReceipt` over the store's own receipts: HTTP 200 always, the outcome
    /// in `status`, as Apple's. A production host answers 21007 to a sandbox receipt and a
    /// sandbox host 21008 to a production one, so a server's "production first, then sandbox"
    /// logic is exercised for real.
    public func verifyReceipt(_ body: Data) -> VerifyReceiptResponse {
        guard let request = try? JSONDecoder().decode(VerifyReceiptRequest.self, from: body) else {
            return VerifyReceiptResponse(status: VerifyReceiptStatus.badRequest)
        }
        guard let bytes = Data(base64Encoded: request.receiptData, options: .ignoreUnknownCharacters), !bytes.isEmpty else {
            return VerifyReceiptResponse(status: VerifyReceiptStatus.malformedReceipt)
        }
        guard let verifier = receiptVerifier.get(store) else {
            return VerifyReceiptResponse(status: VerifyReceiptStatus.internalError, isRetryable: true)
        }
        let receipt: AppReceipt
        do { receipt = try verifier.verify(Array(bytes)) } catch {
            let status = error.code == .malformed || error.code == .tooLarge ? VerifyReceiptStatus.malformedReceipt : VerifyReceiptStatus.notAuthenticated
            return VerifyReceiptResponse(status: status)
        }
        if environment == .production, receipt.environment == .sandbox { return VerifyReceiptResponse(status: VerifyReceiptStatus.sandboxReceipt) }
        if environment == .sandbox, receipt.environment == .production { return VerifyReceiptResponse(status: VerifyReceiptStatus.productionReceipt) }
        func ms(_ date: Date?) -> String? { date.map { String($0.storeAPIMilliseconds) } }
        let decoded = VerifyReceiptResponse.Receipt(
            receiptType: receipt.receiptType, bundleId: receipt.bundleId, applicationVersion: receipt.appVersion,
            originalApplicationVersion: receipt.originalAppVersion, receiptCreationDateMs: ms(receipt.creationDate),
            inApp: receipt.inAppPurchases.map { p in
                VerifyReceiptResponse.InApp(
                    quantity: String(p.quantity), productId: p.productId, transactionId: p.transactionId, originalTransactionId: p.originalTransactionId,
                    purchaseDateMs: ms(p.purchaseDate), originalPurchaseDateMs: ms(p.originalPurchaseDate), expiresDateMs: ms(p.expiresDate),
                    cancellationDateMs: ms(p.cancellationDate), webOrderLineItemId: p.webOrderLineItemId.map(String.init))
            })
        return VerifyReceiptResponse(
            status: VerifyReceiptStatus.valid, environment: environment == .production ? "Production" : "Sandbox", receipt: decoded,
            latestReceipt: request.receiptData)
    }

    // MARK: Helpers

    private func visibleTransactions() throws -> [Transaction] {
        try store.transactions().filter { $0.environment == environment }
    }

    /// Apple's transaction ids are decimal digits; anything else is refused before a lookup.
    static func isTransactionId(_ value: String) -> Bool {
        !value.isEmpty && value.utf8.count <= 64 && value.utf8.allSatisfy { $0 >= UInt8(ascii: "0") && $0 <= UInt8(ascii: "9") }
    }

    /// Page tokens are opaque to clients; here they carry the offset of the next page.
    static func encodeOffset(_ offset: Int) -> String { Base64URL.encode(Array("page:\(offset)".utf8)) }

    static func decodeOffset(_ token: String) -> Int? {
        guard token.utf8.count <= 64, let bytes = Base64URL.decode(token.utf8) else { return nil }
        let text = String(decoding: bytes, as: UTF8.self)
        guard text.hasPrefix("page:"), let value = Int(text.dropFirst(5)), value >= 0 else { return nil }
        return value
    }

    private func badRequest(_ code: Int, _ message: String) -> Answer { .error(status: 400, StoreAPIError(code, message)) }

    private func invalidTransactionId(_ id: String) -> Answer {
        badRequest(StoreAPIError.invalidTransactionId, "\(id.prefix(80)) is not a transaction id (decimal digits)")
    }

    private func notFound(_ id: String) -> Answer {
        .error(status: 404, StoreAPIError(StoreAPIError.transactionIdNotFound, "Transaction id \(id) not found in the \(environment) environment."))
    }

    private func internalError(_ error: any Error) -> Answer {
        .error(status: 500, StoreAPIError(StoreAPIError.generalInternal, "the sandbox store cannot answer: \(error)"))
    }
}

/// Holds the sandbox API's receipt verifier once made.
final class ReceiptVerifierCache: Sendable {
    private let verifier = Mutex<ReceiptVerifier?>(nil)

    func get(_ store: SandboxStore) -> ReceiptVerifier? {
        verifier.withLock { cached in
            if let cached { return cached }
            guard let authority = try? store.receiptAuthority(),
                let made = try? ReceiptVerifier(
                    bundleId: store.bundleId, trustRoots: [authority.root], environments: EnvironmentPolicy(accepting: [.production, .sandbox]))
            else { return nil }
            cached = made
            return made
        }
    }
}

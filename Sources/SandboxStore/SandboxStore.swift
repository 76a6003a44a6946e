import AppStoreServerAPI
import Base64URL
import Crypto
import DurableFiles
import Foundation
import IAPProtocol
import PurchaseVerification
import ReceiptVerification
import TransactionQueue
import X509

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What went wrong in the sandbox store.
public enum SandboxErrorCode: String, ErrorCode {
    /// A flag or argument is not acceptable.
    case invalidInput = "invalid-input"
    /// The store's folder or files cannot be read, written or locked.
    case io
    /// The folder holds no store, or a damaged one.
    case damaged
    /// No such transaction in this store.
    case notFound = "not-found"
    /// The transaction was refunded already: the App Store refunds a purchase once.
    case alreadyRefunded = "already-refunded"
}

/// An error from the sandbox store, naming the problem and the fix.
public typealias SandboxError = CodedError<SandboxErrorCode>

/// A local App Store for tests and demos, as Xcode's StoreKit testing is: it signs transactions
/// and notifications with its own certificate chain and queues purchases on the "device".
///
/// Folder layout: `store.json` (bundle id, next transaction id, refunds), `root.cer` (DER: give it
/// to the server with `--trust-root`), `*.key` (PEM, mode 0600), `*.cer`, and `queue/` (the
/// device's ``FileTransactionQueue``).
public final class SandboxStore: Sendable {
    struct State: Codable {
        var bundleId: String
        var nextTransactionId: UInt64
        var appAppleId: Int64
        var refunds: [String: Date] = [:]
        /// The team's issuer id for App Store Server API keys (made with the first key).
        var issuerId: String?
        /// API key id → public key (PEM): the private halves went to their owners.
        var apiKeys: [String: String]?
        /// Every notification the store signed, with its delivery attempts, for Get Notification History.
        var notifications: [StoredNotification]?
    }

    /// A signed notification as the store keeps it for its history.
    public struct StoredNotification: Codable, Sendable {
        public let notificationUUID: String
        public let notificationType: String
        public let subtype: String?
        public let transactionId: String?
        public let environment: String?
        public let signedDate: Date
        public let signedPayload: String
        public var sendAttempts: [SendAttempt]
    }

    public let folder: String
    public let bundleId: String
    public let authority: SandboxCertificateAuthority
    public let queue: FileTransactionQueue

    public var rootCertificatePath: String { folder + "/root.cer" }
    /// The receipt chain's root (RSA; made with the first receipt): give it to the server with `--trust-root`.
    public var receiptRootCertificatePath: String { folder + "/receipt-root.cer" }
    /// The StoreKit 1 device's app receipt (its `appStoreReceiptURL`), rewritten at each StoreKit 1 purchase.
    public var deviceReceiptPath: String { folder + "/device-receipt" }

    /// The first transaction id, 16 digits like Apple's.
    static let firstTransactionId: UInt64 = 2_000_000_000_000_001

    /// Creates a new store in `folder` (which must not hold one already).
    @discardableResult
    public static func initialize(folder: String, bundleId: String, profile: ChainProfile = ChainProfile()) throws(SandboxError) -> SandboxStore {
        guard !bundleId.isEmpty, bundleId.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
            throw SandboxError(.invalidInput, "'\(bundleId)' is not a bundle id: use the app's, such as com.example.app")
        }
        do {
            try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        } catch {
            throw SandboxError(.io, "cannot create \(folder): \(error.localizedDescription)")
        }
        guard !FileManager.default.fileExists(atPath: folder + "/store.json") else {
            throw SandboxError(.invalidInput, "\(folder) already holds a sandbox store: use it, or choose an empty folder")
        }
        let authority: SandboxCertificateAuthority
        do { authority = try SandboxCertificateAuthority.generate(profile: profile) } catch {
            throw SandboxError(.io, "cannot make the sandbox certificates: \(error)")
        }
        try write(Data(authority.rootKey.pemRepresentation.utf8), folder + "/root.key", mode: 0o600)
        try write(Data(authority.intermediateKey.pemRepresentation.utf8), folder + "/intermediate.key", mode: 0o600)
        try write(Data(authority.leafKey.pemRepresentation.utf8), folder + "/leaf.key", mode: 0o600)
        try write(Data(derBytes(authority.root)), folder + "/root.cer", mode: 0o644)
        try write(Data(derBytes(authority.intermediate)), folder + "/intermediate.cer", mode: 0o644)
        try write(Data(derBytes(authority.leaf)), folder + "/leaf.cer", mode: 0o644)
        let state = State(bundleId: bundleId, nextTransactionId: firstTransactionId, appAppleId: Int64.random(in: 1_000_000_000...9_999_999_999))
        try write(try encode(state), folder + "/store.json", mode: 0o600)
        return try SandboxStore(folder: folder)
    }

    /// Opens an existing store.
    public init(folder: String) throws(SandboxError) {
        self.folder = folder
        guard let data = FileManager.default.contents(atPath: folder + "/store.json") else {
            throw SandboxError(.damaged, "\(folder) holds no sandbox store: create one with iap-sandbox init --dir \(folder) --bundle-id <id>")
        }
        let state: State
        do { state = try Self.decoder.decode(State.self, from: data) } catch {
            throw SandboxError(.damaged, "\(folder)/store.json is damaged: create a new store with iap-sandbox init")
        }
        bundleId = state.bundleId
        func key(_ name: String) throws(SandboxError) -> P256.Signing.PrivateKey {
            guard let data = FileManager.default.contents(atPath: folder + "/" + name), let pem = String(data: data, encoding: .utf8),
                let key = try? P256.Signing.PrivateKey(pemRepresentation: pem)
            else {
                throw SandboxError(.damaged, "\(folder)/\(name) is missing or not a P-256 key: create a new store with iap-sandbox init")
            }
            return key
        }
        func certificate(_ name: String) throws(SandboxError) -> Certificate {
            guard let data = FileManager.default.contents(atPath: folder + "/" + name), let cert = try? Certificate(derEncoded: Array(data)) else {
                throw SandboxError(.damaged, "\(folder)/\(name) is missing or not a certificate: create a new store with iap-sandbox init")
            }
            return cert
        }
        authority = SandboxCertificateAuthority(
            rootKey: try key("root.key"), root: try certificate("root.cer"),
            intermediateKey: try key("intermediate.key"), intermediate: try certificate("intermediate.cer"),
            leafKey: try key("leaf.key"), leaf: try certificate("leaf.cer"))
        do { queue = try FileTransactionQueue(folder: folder + "/queue") } catch { throw SandboxError(error, or: .io) }
    }

    /// A purchase as it appears on the device: the signed transaction, queued unfinished.
    public struct Purchase: Sendable {
        public let transaction: Transaction
        public let signedTransaction: String
    }

    /// Buys a product: signs a transaction and puts it in the queue as unfinished.
    ///
    /// With `storeKit1`, the device holds the purchase as StoreKit 1 does: the queued transaction
    /// is proven by the app receipt at ``deviceReceiptPath`` (rewritten to include it) and
    /// finished by its transaction id; the JWS is kept only as the store's own record.
    public func purchase(
        productId: String, type: ProductType = .nonConsumable, environment: AppStoreEnvironment = .sandbox,
        expires: Date? = nil, storeKit1: Bool = false, now: Date = Date()
    ) throws(SandboxError) -> Purchase {
        if let problem = ProductIdentifierRule.problem(productId) {
            throw SandboxError(.invalidInput, "product identifier '\(productId)' \(problem): \(ProductIdentifierRule.fix)")
        }
        if type == .autoRenewable, let expires, expires <= now {
            throw SandboxError(.invalidInput, "--expires \(expires) is in the past: an auto-renewable purchase must expire later")
        }
        let id = try nextTransactionId()
        var transaction = Transaction(
            transactionId: id, originalTransactionId: id, bundleId: bundleId, productId: productId,
            purchaseDate: now, type: type, environment: environment, signedDate: now)
        transaction.quantity = 1
        transaction.inAppOwnershipType = .purchased
        transaction.storefront = "USA"
        transaction.storefrontId = "143441"
        transaction.transactionReason = .purchase
        transaction.currency = "USD"
        transaction.price = 1990
        transaction.appTransactionId = "7\(id.dropFirst())"
        if type == .autoRenewable {
            transaction.expiresDate = expires ?? now.addingTimeInterval(30 * 86_400)
            transaction.webOrderLineItemId = "6\(id.dropFirst())"
            transaction.subscriptionGroupIdentifier = "21000001"
        } else {
            transaction.expiresDate = expires
        }
        let signed = try sign(transaction)
        do {
            try queue.add(
                QueuedTransaction(transactionId: id, productId: productId, signedTransaction: signed, addedAt: now, receiptPath: storeKit1 ? deviceReceiptPath : nil))
        } catch {
            throw SandboxError(error, or: .io)
        }
        if storeKit1 {
            let receipt = try self.receipt(environment: environment, now: now)
            try Self.write(Data(receipt), deviceReceiptPath, mode: 0o644)
        }
        return Purchase(transaction: transaction, signedTransaction: signed)
    }

    /// A transaction with its queue state and refund, for listings.
    public struct Record: Sendable, Codable {
        public let transactionId: String
        public let productId: String
        public let purchaseDate: Date?
        public let environment: String?
        public let type: String?
        public let finishedAt: Date?
        public let refundedAt: Date?
    }

    public func records() throws(SandboxError) -> [Record] {
        let state = try loadState()
        let queued: [QueuedTransaction]
        do { queued = try queue.all() } catch { throw SandboxError(error, or: .io) }
        return queued.map { item in
            let transaction = Self.decodeUnverified(item.signedTransaction)
            return Record(
                transactionId: item.transactionId, productId: item.productId, purchaseDate: transaction?.purchaseDate,
                environment: transaction?.environment?.rawValue, type: transaction?.type?.rawValue,
                finishedAt: item.finishedAt, refundedAt: state.refunds[item.transactionId])
        }
    }

    /// A refund: the revoked transaction and the signed `REFUND` notification that tells servers.
    public struct Refund: Sendable {
        public let transaction: Transaction
        public let signedTransaction: String
        public let notification: NotificationPayload
        /// The body Apple POSTs: `{"signedPayload": "<JWS>"}`.
        public let signedPayload: String
    }

    /// Refunds a purchase: signs the transaction again with `revocationDate`, and a REFUND
    /// notification V2 carrying it.
    public func refund(transactionId: String, reason: Int = 0, now: Date = Date()) throws(SandboxError) -> Refund {
        let queued: QueuedTransaction?
        do { queued = try queue.transaction(transactionId) } catch { throw SandboxError(error, or: .io) }
        guard let queued, var transaction = Self.decodeUnverified(queued.signedTransaction) else {
            throw SandboxError(.notFound, "transaction \(transactionId) was not bought in this sandbox store: list them with iap-sandbox transactions")
        }
        // A second REFUND for one purchase is not something the App Store sends; a server that
        // missed the first gets it from the notification history (iap-server reconcile).
        if let refunded = try loadState().refunds[transactionId] {
            throw SandboxError(
                .alreadyRefunded,
                "transaction \(transactionId) was already refunded at \(refunded.formatted(.iso8601)); nothing new was signed. A server that missed its REFUND notification gets it with iap-server reconcile (the store's notification history)"
            )
        }
        transaction.revocationDate = now
        transaction.revocationReason = reason
        transaction.signedDate = now
        let signedTransaction = try sign(transaction)
        let notification = NotificationPayload(
            notificationType: .refund, notificationUUID: UUID().uuidString.lowercased(), signedDate: now,
            data: .init(bundleId: bundleId, environment: transaction.environment, signedTransactionInfo: signedTransaction))
        var withApp = notification
        withApp.data?.appAppleId = try loadState().appAppleId
        let signedPayload = try sign(withApp)
        let stored = StoredNotification(
            notificationUUID: notification.notificationUUID ?? "", notificationType: NotificationType.refund.rawValue, subtype: nil,
            transactionId: transactionId, environment: transaction.environment?.rawValue, signedDate: now, signedPayload: signedPayload,
            sendAttempts: [])
        try updateState { state in
            state.refunds[transactionId] = now
            state.notifications = (state.notifications ?? []) + [stored]
        }
        return Refund(transaction: transaction, signedTransaction: signedTransaction, notification: withApp, signedPayload: signedPayload)
    }

    /// Records an attempt to deliver a notification (`SUCCESS`, `NO_RESPONSE`, …), as Apple's
    /// notification history shows them.
    public func recordSendAttempt(notificationUUID: String, result: String, at date: Date = Date()) throws(SandboxError) {
        try updateState { state in
            guard let index = state.notifications?.firstIndex(where: { $0.notificationUUID == notificationUUID }) else { return }
            state.notifications?[index].sendAttempts.append(SendAttempt(attemptDate: date.storeAPIMilliseconds, sendAttemptResult: result))
        }
    }

    /// Every notification the store signed, oldest first.
    public func notifications() throws(SandboxError) -> [StoredNotification] { try loadState().notifications ?? [] }

    /// A new App Store Server API key, as App Store Connect makes one.
    public struct APIKey: Sendable {
        public let keyId: String
        public let issuerId: String
        /// PKCS#8 PEM, like the `.p8` file Apple lets you download once.
        public let privateKeyPEM: String
    }

    /// Makes an API key for the store's App Store Server API; only its public half is kept.
    public func createAPIKey() throws(SandboxError) -> APIKey {
        let key = P256.Signing.PrivateKey()
        // Apple's key ids are 10 upper-case letters and digits.
        let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
        let keyId = String((0..<10).map { _ in alphabet.randomElement()! })
        var issuer = ""
        try updateState { state in
            if state.issuerId == nil { state.issuerId = UUID().uuidString.lowercased() }
            issuer = state.issuerId!
            state.apiKeys = (state.apiKeys ?? [:]).merging([keyId: key.publicKey.pemRepresentation]) { $1 }
        }
        return APIKey(keyId: keyId, issuerId: issuer, privateKeyPEM: key.pemRepresentation)
    }

    /// The checker for the API's bearer tokens: this store's issuer id and keys.
    public func tokenVerifier() throws(SandboxError) -> StoreAPIToken {
        let state = try loadState()
        var keys: [String: P256.Signing.PublicKey] = [:]
        for (id, pem) in state.apiKeys ?? [:] {
            guard let key = try? P256.Signing.PublicKey(pemRepresentation: pem) else {
                throw SandboxError(.damaged, "\(folder)/store.json holds a damaged API key \(id): make a new one with iap-sandbox api-key")
            }
            keys[id] = key
        }
        return StoreAPIToken(issuerId: state.issuerId ?? "", bundleId: state.bundleId, keys: keys)
    }

    /// The store's app id, as notifications and histories carry it.
    public func appAppleId() throws(SandboxError) -> Int64 { try loadState().appAppleId }

    /// Every transaction as the App Store knows it now (refunds applied), oldest first, unsigned.
    public func transactions() throws(SandboxError) -> [Transaction] {
        let (state, queued) = try snapshot()
        return Self.transactions(state: state, queued: queued)
    }

    private func snapshot() throws(SandboxError) -> (State, [QueuedTransaction]) {
        let state = try loadState()
        do { return (state, try queue.all()) } catch { throw SandboxError(error, or: .io) }
    }

    private static func transactions(state: State, queued: [QueuedTransaction]) -> [Transaction] {
        queued.compactMap { item in
            guard var transaction = decodeUnverified(item.signedTransaction) else { return nil }
            if let refunded = state.refunds[item.transactionId] {
                transaction.revocationDate = refunded
                transaction.revocationReason = transaction.revocationReason ?? 0
            }
            return transaction
        }
    }

    // MARK: App receipts (StoreKit 1)

    /// The receipt-signing chain, made on first use (RSA key generation takes a moment, and most
    /// stores never issue a receipt).
    public func receiptAuthority() throws(SandboxError) -> SandboxReceiptAuthority {
        let lock: FileLock
        do { lock = try FileLock(exclusive: folder + "/.store.lock") } catch { throw SandboxError(.io, error.message) }
        defer { lock.release() }
        let names = ["receipt-root", "receipt-intermediate", "receipt-leaf"]
        if let existing = Self.loadReceiptAuthority(folder: folder, names: names) { return existing }
        let authority: SandboxReceiptAuthority
        do { authority = try SandboxReceiptAuthority.generate() } catch { throw SandboxError(.io, "cannot make the receipt certificates: \(error)") }
        try Self.write(Data(authority.rootKeyPEM.utf8), folder + "/receipt-root.key", mode: 0o600)
        try Self.write(Data(authority.intermediateKeyPEM.utf8), folder + "/receipt-intermediate.key", mode: 0o600)
        try Self.write(Data(authority.leafKeyPEM.utf8), folder + "/receipt-leaf.key", mode: 0o600)
        try Self.write(Data(derBytes(authority.intermediate)), folder + "/receipt-intermediate.cer", mode: 0o644)
        try Self.write(Data(derBytes(authority.leaf)), folder + "/receipt-leaf.cer", mode: 0o644)
        // The root last: its presence says the chain is complete.
        try Self.write(Data(derBytes(authority.root)), folder + "/receipt-root.cer", mode: 0o644)
        return authority
    }

    private static func loadReceiptAuthority(folder: String, names: [String]) -> SandboxReceiptAuthority? {
        var certificates: [Certificate] = [], keys: [String] = []
        for name in names {
            guard let der = FileManager.default.contents(atPath: "\(folder)/\(name).cer"), let certificate = try? Certificate(derEncoded: Array(der)),
                let key = FileManager.default.contents(atPath: "\(folder)/\(name).key")
            else { return nil }
            certificates.append(certificate)
            keys.append(String(decoding: key, as: UTF8.self))
        }
        return SandboxReceiptAuthority(
            root: certificates[0], intermediate: certificates[1], leaf: certificates[2], leafKeyPEM: keys[2], rootKeyPEM: keys[0], intermediateKeyPEM: keys[1])
    }

    /// The app receipt a device holds now: every purchase of `environment` (refunded ones with
    /// their cancellation date; consumables only until finished, as Apple's receipts), signed as
    /// PKCS#7 by the receipt chain.
    public func receipt(
        environment: AppStoreEnvironment = .sandbox, appVersion: String = "1.0", sha1: Bool = false, now: Date = Date()
    ) throws(SandboxError) -> [UInt8] {
        let (state, queued) = try snapshot()
        let finished = Set(queued.filter { $0.finishedAt != nil }.map(\.transactionId))
        let purchases = Self.transactions(state: state, queued: queued).filter { $0.environment == environment }.compactMap { t -> InAppPurchase? in
            guard let id = t.transactionId, let productId = t.productId, let purchased = t.purchaseDate else { return nil }
            if t.type == .consumable, finished.contains(id) { return nil }
            return InAppPurchase(
                quantity: t.quantity ?? 1, productId: productId, transactionId: id, originalTransactionId: t.originalTransactionId ?? id,
                purchaseDate: purchased, originalPurchaseDate: t.originalPurchaseDate, expiresDate: t.type == .autoRenewable ? t.expiresDate : nil,
                webOrderLineItemId: t.webOrderLineItemId.flatMap { Int64($0) }, cancellationDate: state.refunds[id])
        }
        let receipt = AppReceipt(
            receiptType: environment == .production ? "Production" : "ProductionSandbox", bundleId: bundleId, appVersion: appVersion,
            originalAppVersion: "1.0", creationDate: now, expirationDate: nil,
            opaqueValue: (0..<16).map { _ in UInt8.random(in: 0...255) }, sha1Hash: (0..<20).map { _ in UInt8.random(in: 0...255) },
            inAppPurchases: purchases)
        do {
            return try receiptAuthority().sign(payload: try ReceiptPayload.encode(receipt), sha1: sha1)
        } catch let error as SandboxError {
            throw error
        } catch {
            throw SandboxError(.io, "cannot encode the receipt: \(error)")
        }
    }

    public func sign<T: Encodable>(_ payload: T) throws(SandboxError) -> String {
        do { return try authority.sign(payload) } catch { throw SandboxError(.io, "cannot sign: \(error)") }
    }

    static func decodeUnverified(_ jws: String) -> Transaction? {
        let parts = jws.split(separator: ".")
        guard parts.count == 3 else { return nil }
        guard let payload = Base64URL.decode(parts[1].utf8) else { return nil }
        return try? JSONDecoder().decode(Transaction.self, from: Data(payload))
    }

    private func nextTransactionId() throws(SandboxError) -> String {
        var id: UInt64 = 0
        try updateState { state in
            id = state.nextTransactionId
            state.nextTransactionId += 1
        }
        return String(id)
    }

    private func loadState() throws(SandboxError) -> State {
        guard let data = FileManager.default.contents(atPath: folder + "/store.json"),
            let state = try? Self.decoder.decode(State.self, from: data)
        else {
            throw SandboxError(.damaged, "\(folder)/store.json is missing or damaged: create a new store with iap-sandbox init")
        }
        return state
    }

    /// Read-modify-write of store.json under an exclusive lock, written atomically.
    private func updateState(_ change: (inout State) -> Void) throws(SandboxError) {
        let lock: FileLock
        do { lock = try FileLock(exclusive: folder + "/.store.lock") } catch { throw SandboxError(.io, error.message) }
        defer { lock.release() }
        var state = try loadState()
        change(&state)
        try Self.write(try Self.encode(state), folder + "/store.json", mode: 0o600)
    }

    private static let decoder: JSONDecoder = {
        let d = JSONDecoder()
        d.dateDecodingStrategy = .millisecondsSince1970
        return d
    }()

    private static func encode(_ state: State) throws(SandboxError) -> Data {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
        encoder.dateEncodingStrategy = .millisecondsSince1970
        do { return try encoder.encode(state) } catch { throw SandboxError(.io, "cannot encode the store state") }
    }

    private static func write(_ data: Data, _ path: String, mode: mode_t) throws(SandboxError) {
        do { try AtomicFile.write(data, to: path, permissions: mode) } catch { throw SandboxError(.io, error.message) }
    }
}

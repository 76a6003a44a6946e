import Foundation

/// A stored App Store Server Notification and what it does to access.
public struct NotificationRecord: Sendable, Equatable {
    public var uuid: String
    public var type: String
    public var subtype: String?
    public var transactionId: String?
    /// true cuts access for `transactionId`, false restores it, nil changes nothing.
    public var revoke: Bool?
    public var revokedAt: Date
    public var receivedAt: Date
    public var signedPayload: String

    public init(
        uuid: String, type: String, subtype: String?, transactionId: String?, revoke: Bool?, revokedAt: Date, receivedAt: Date, signedPayload: String
    ) {
        self.uuid = uuid
        self.type = type
        self.subtype = subtype
        self.transactionId = transactionId
        self.revoke = revoke
        self.revokedAt = revokedAt
        self.receivedAt = receivedAt
        self.signedPayload = signedPayload
    }
}

/// One row of the grants ledger: a transaction that was given a download.
public struct GrantRecord: Sendable, Equatable {
    public var transactionId: String
    public var originalTransactionId: String?
    public var productId: String
    public var environment: String?
    public var grantedAt: Date

    public init(transactionId: String, originalTransactionId: String?, productId: String, environment: String?, grantedAt: Date) {
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.productId = productId
        self.environment = environment
        self.grantedAt = grantedAt
    }
}

/// What another process changed about access or the catalog, pushed by databases that can (PostgreSQL's
/// LISTEN/NOTIFY).
public enum RevocationChange: Sendable, Equatable {
    case revoked(transactionId: String)
    case restored(transactionId: String)
    /// A version was published (on another replica, perhaps): its archive may need fetching.
    case published(sha256: String)
    /// Changes may have been missed (the listening connection was lost and is back): read the
    /// whole set again.
    case resynchronize
}

/// A table whose every write raises a counter in the same transaction: a trigger does it, so
/// writers that know nothing of the counter (an older replica, an operator's SQL) count too.
///
/// Servers look at the counter each refresh and read the table itself only when it moved. A
/// revocation ledger holding every refund an app ever had runs to hundreds of thousands of ids,
/// and a publisher's catalog to tens of thousands of versions; reading them whole every two
/// seconds cost an idle server 40-60% of a core at a million revocations (docs/performance.md).
public enum ChangeCounter: String, Sendable, CaseIterable {
    case revocations
    case versions
}

/// The revoked transaction ids, and the ``ChangeCounter/revocations`` counter they were read at.
public struct RevocationSnapshot: Sendable, Equatable {
    public let version: Int64
    public let transactionIds: Set<String>

    public init(version: Int64, transactionIds: Set<String>) {
        self.version = version
        self.transactionIds = transactionIds
    }
}

/// Where the catalog, the grants ledger, revocations and notifications live: SQLite in the data
/// folder (``SQLiteCatalogDatabase``, the default) or PostgreSQL for several replicas (the
/// `CatalogPostgres` module). Both pass the same tests; every write that must be atomic is one
/// transaction in the database.
public protocol CatalogDatabase: Sendable {
    /// Where the state is, for messages: "the catalog database in /srv/iap", "PostgreSQL at db:5432/iap".
    var location: String { get }

    /// The versions of one product, or of every product when nil, in no particular order.
    func versions(productId: String?) async throws(CatalogError) -> [PublishedVersion]

    /// Inserts `version` unless `decide`, given the product's versions read inside the same
    /// transaction (with concurrent publishers of the product kept out), returns an existing one
    /// (then nothing changes) or throws (a conflict).
    func insert(
        _ version: PublishedVersion, unless decide: @escaping @Sendable ([PublishedVersion]) throws(CatalogError) -> PublishedVersion?
    ) async throws(CatalogError) -> PublishOutcome

    /// Changes one version in a transaction; `notFound` when it is not published.
    func update(
        productId: String, contentVersion: String, _ change: @escaping @Sendable (inout PublishedVersion) -> Void
    ) async throws(CatalogError) -> PublishedVersion

    /// Records a grant: the first time, or a new last time.
    func recordGrant(_ grant: GrantRecord) async throws(CatalogError)

    /// The number of transactions ever granted (for tests and operators).
    func grantCount() async throws(CatalogError) -> Int

    func isRevoked(transactionId: String) async throws(CatalogError) -> Bool

    /// Every revoked transaction id, unless the ledger's change counter is still `version`
    /// (nil then): nothing was revoked or restored since the snapshot read at that counter.
    func revocations(changedSince version: Int64?) async throws(CatalogError) -> RevocationSnapshot?

    /// The counter's value now (``ChangeCounter``).
    func changeCounter(_ counter: ChangeCounter) async throws(CatalogError) -> Int64

    /// Stores a notification and applies it in one transaction, once per UUID.
    func apply(_ notification: NotificationRecord) async throws(CatalogError) -> NotificationOutcome

    func notificationCount() async throws(CatalogError) -> Int

    /// Deletes up to `limit` stored notifications received before `date`; returns how many went.
    /// Revocations they caused stay: the ledger is what access is judged by.
    func pruneNotifications(receivedBefore date: Date, limit: Int) async throws(CatalogError) -> Int

    /// Calls `onChange` for every revocation any process makes, until the task is cancelled;
    /// returns at once (false) when the database cannot push changes, and callers poll instead.
    func watchRevocations(_ onChange: @escaping @Sendable (RevocationChange) -> Void) async -> Bool

    /// Closes connections; the database is not used afterwards.
    func close() async
}

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
    /// Raised by deletions from the revocation ledger only (a refund reversed): the one change a
    /// reader cannot pick up by the rows written since it last looked.
    case revocationRemovals
}

/// Where a reader of the revocation ledger stands: the counters its last read saw.
public struct RevocationPosition: Sendable, Equatable {
    /// ``ChangeCounter/revocations``: every write raises it, and each revocation written is
    /// stamped with the value it raised it to.
    public let version: Int64
    /// ``ChangeCounter/revocationRemovals``.
    public let removals: Int64

    public init(version: Int64, removals: Int64) {
        self.version = version
        self.removals = removals
    }
}

/// What a read of the revocation ledger found.
///
/// Why not every id each time: the ledger keeps every refund an app ever had, a million ids for a
/// large app, and each replica read all of it after every refund (about 0.5 s of CPU at a million;
/// a storm of refunds, or notifications retried after an outage, kept a core busy). With nothing
/// restored since the reader's position, the rows stamped after it are all that changed.
public struct RevocationSnapshot: Sendable, Equatable {
    public let position: RevocationPosition
    /// Every revoked id when ``isComplete``; otherwise the ids revoked since the position asked
    /// about, to be added to what the reader holds.
    public let transactionIds: Set<String>
    public let isComplete: Bool

    public init(position: RevocationPosition, transactionIds: Set<String>, isComplete: Bool) {
        self.position = position
        self.transactionIds = transactionIds
        self.isComplete = isComplete
    }

    /// Whether `known` can be brought to `now` by adding the rows stamped after it: nothing was
    /// removed since, and the counter did not go back (a database restored from a backup).
    public static func canAdd(from known: RevocationPosition, to now: RevocationPosition) -> Bool {
        known.removals == now.removals && known.version <= now.version
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

    /// What changed in the revocation ledger since `known` (nil: nothing was revoked or restored
    /// since): the ids revoked since, or every id when one was restored since or `known` is nil
    /// (``RevocationSnapshot``).
    func revocations(changedSince known: RevocationPosition?) async throws(CatalogError) -> RevocationSnapshot?

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

    /// False while the database is known not to answer (a shared one that went away), so that a
    /// caller with something to fall back on need not wait out a query's deadline to learn it.
    var isAnswering: Bool { get }
}

extension CatalogDatabase {
    /// A database in the data folder answers whenever the process runs.
    public var isAnswering: Bool { true }
}

import Foundation
import GRDB

/// The catalog in `<data>/catalog.sqlite` (GRDB): the embedded default, for one machine or for
/// replicas that share the data folder.
public final class SQLiteCatalogDatabase: CatalogDatabase {
    public let location: String
    private let database: DatabaseQueue

    /// Where the catalog of `dataDirectory` is kept (a command that only looks checks it exists).
    public static func path(in dataDirectory: String) -> String { dataDirectory + "/catalog.sqlite" }

    /// Opens (creating and migrating) `<dataDirectory>/catalog.sqlite`.
    public init(dataDirectory: String) throws(CatalogError) {
        location = "the catalog database in \(dataDirectory)"
        do {
            var configuration = Configuration()
            configuration.busyMode = .timeout(10)
            database = try DatabaseQueue(path: Self.path(in: dataDirectory), configuration: configuration)
            try Self.migrator.migrate(database)
        } catch {
            throw Self.storageError(error, location)
        }
    }

    private static var migrator: DatabaseMigrator {
        var migrator = DatabaseMigrator()
        migrator.registerMigration("v1") { db in
            try db.create(table: "versions") { t in
                t.column("productId", .text).notNull()
                t.column("contentVersion", .text).notNull()
                t.column("sha256", .text).notNull()
                t.column("size", .integer).notNull()
                t.column("contentLength", .integer).notNull()
                t.column("publishedAt", .datetime).notNull()
                t.primaryKey(["productId", "contentVersion"])
            }
            try db.create(table: "grants") { t in
                t.column("transactionId", .text).primaryKey()
                t.column("originalTransactionId", .text)
                t.column("productId", .text).notNull()
                t.column("environment", .text)
                t.column("firstGrantedAt", .datetime).notNull()
                t.column("lastGrantedAt", .datetime).notNull()
            }
            try db.create(table: "revocations") { t in
                t.column("transactionId", .text).primaryKey()
                t.column("revokedAt", .datetime).notNull()
                t.column("notificationUUID", .text)
            }
            try db.create(table: "notifications") { t in
                t.column("uuid", .text).primaryKey()
                t.column("type", .text).notNull()
                t.column("subtype", .text)
                t.column("transactionId", .text)
                t.column("receivedAt", .datetime).notNull()
                t.column("signedPayload", .text).notNull()
            }
        }
        migrator.registerMigration("v2-manifests") { db in
            try db.alter(table: "versions") { t in t.add(column: "manifestSHA256", .text) }
        }
        migrator.registerMigration("v3-rollouts") { db in
            try db.alter(table: "versions") { t in
                t.add(column: "rolloutPercent", .integer)
                t.add(column: "rolledBackAt", .datetime)
            }
        }
        migrator.registerMigration("v4-origins") { db in
            try db.alter(table: "versions") { t in t.add(column: "originURL", .text) }
        }
        migrator.registerMigration("v5-removals") { db in
            try db.alter(table: "versions") { t in t.add(column: "removedAt", .datetime) }
        }
        migrator.registerMigration("v6-change-counters") { db in
            // Raised by every write to the table each counts, whoever makes it (ChangeCounter).
            var sql = """
                CREATE TABLE changeCounters (name TEXT PRIMARY KEY, version INTEGER NOT NULL);
                INSERT INTO changeCounters (name, version) VALUES ('revocations', 0), ('versions', 0);
                """
            for table in ["revocations", "versions"] {
                for event in ["INSERT", "UPDATE", "DELETE"] {
                    sql += """
                        CREATE TRIGGER \(table)\(event.capitalized)Counted AFTER \(event) ON \(table)
                        BEGIN UPDATE changeCounters SET version = version + 1 WHERE name = '\(table)'; END;
                        """
                }
            }
            try db.execute(sql: sql)
        }
        migrator.registerMigration("v7-notification-age") { db in
            // Pruning by age (NotificationPruner) finds old rows without reading the table.
            try db.create(index: "notificationsReceivedAt", on: "notifications", columns: ["receivedAt"])
        }
        migrator.registerMigration("v8-revocation-stamps") { db in
            // Each revocation written carries the counter value its write raised it to, so a
            // reader adds the rows after its own position (RevocationSnapshot); deletions raise a
            // counter of their own and send readers back to the whole set. Triggers again, for
            // writers that know nothing of either. The stamp's own update names no column the
            // update trigger watches, so it does not fire it.
            try db.execute(
                sql: """
                    ALTER TABLE revocations ADD COLUMN changed INTEGER;
                    CREATE INDEX revocationsChanged ON revocations (changed);
                    INSERT INTO changeCounters (name, version) VALUES ('revocationRemovals', 0);
                    DROP TRIGGER revocationsInsertCounted;
                    DROP TRIGGER revocationsUpdateCounted;
                    CREATE TRIGGER revocationsInsertCounted AFTER INSERT ON revocations BEGIN
                        UPDATE changeCounters SET version = version + 1 WHERE name = 'revocations';
                        UPDATE revocations SET changed = (SELECT version FROM changeCounters WHERE name = 'revocations') WHERE rowid = NEW.rowid;
                    END;
                    CREATE TRIGGER revocationsUpdateCounted AFTER UPDATE OF transactionId, revokedAt, notificationUUID ON revocations BEGIN
                        UPDATE changeCounters SET version = version + 1 WHERE name = 'revocations';
                        UPDATE revocations SET changed = (SELECT version FROM changeCounters WHERE name = 'revocations') WHERE rowid = NEW.rowid;
                    END;
                    CREATE TRIGGER revocationsDeleteRemoved AFTER DELETE ON revocations BEGIN
                        UPDATE changeCounters SET version = version + 1 WHERE name = 'revocationRemovals';
                    END;
                    """)
        }
        return migrator
    }

    public func versions(productId: String?) async throws(CatalogError) -> [PublishedVersion] {
        try await run { [database] in
            try await database.read { db in
                if let productId { return try PublishedVersion.filter(Column("productId") == productId).fetchAll(db) }
                return try PublishedVersion.fetchAll(db)
            }
        }
    }

    public func insert(
        _ version: PublishedVersion, unless decide: @escaping @Sendable ([PublishedVersion]) throws(CatalogError) -> PublishedVersion?
    ) async throws(CatalogError) -> PublishOutcome {
        try await run { [database] in
            // A write transaction is exclusive in SQLite: no other publisher runs between the read and the insert.
            try await database.write { db throws -> PublishOutcome in
                let existing = try PublishedVersion.filter(Column("productId") == version.productId).fetchAll(db)
                if let same = try decide(existing) { return .unchanged(same) }
                try version.insert(db)
                return .published(version)
            }
        }
    }

    public func update(
        productId: String, contentVersion: String, _ change: @escaping @Sendable (inout PublishedVersion) -> Void
    ) async throws(CatalogError) -> PublishedVersion {
        try await run { [database] in
            try await database.write { db in
                guard var version = try PublishedVersion.filter(Column("productId") == productId && Column("contentVersion") == contentVersion).fetchOne(db)
                else { throw CatalogError.unpublished(productId, contentVersion) }
                change(&version)
                try version.update(db)
                return version
            }
        }
    }

    public func recordGrant(_ grant: GrantRecord) async throws(CatalogError) {
        try await run { [database] in
            try await database.write { db in
                try db.execute(
                    sql: """
                        INSERT INTO grants (transactionId, originalTransactionId, productId, environment, firstGrantedAt, lastGrantedAt)
                        VALUES (?, ?, ?, ?, ?, ?)
                        ON CONFLICT(transactionId) DO UPDATE SET lastGrantedAt = excluded.lastGrantedAt
                        """,
                    arguments: [grant.transactionId, grant.originalTransactionId, grant.productId, grant.environment, grant.grantedAt, grant.grantedAt])
            }
        }
    }

    public func grantCount() async throws(CatalogError) -> Int {
        try await run { [database] in try await database.read { db in try Int.fetchOne(db, sql: "SELECT COUNT(*) FROM grants") ?? 0 } }
    }

    public func isRevoked(transactionId: String) async throws(CatalogError) -> Bool {
        try await run { [database] in
            try await database.read { db in
                try Bool.fetchOne(db, sql: "SELECT 1 FROM revocations WHERE transactionId = ?", arguments: [transactionId]) ?? false
            }
        }
    }

    public func revocations(changedSince known: RevocationPosition?) async throws(CatalogError) -> RevocationSnapshot? {
        try await run { [database] in
            // One read transaction: the counters and the ids are of the same snapshot.
            try await database.read { db -> RevocationSnapshot? in
                let now = RevocationPosition(version: try Self.counter(.revocations, in: db), removals: try Self.counter(.revocationRemovals, in: db))
                if now == known { return nil }
                if let known, RevocationSnapshot.canAdd(from: known, to: now) {
                    let added = try String.fetchAll(db, sql: "SELECT transactionId FROM revocations WHERE changed > ?", arguments: [known.version])
                    return RevocationSnapshot(position: now, transactionIds: Set(added), isComplete: false)
                }
                return RevocationSnapshot(position: now, transactionIds: Set(try String.fetchAll(db, sql: "SELECT transactionId FROM revocations")), isComplete: true)
            }
        }
    }

    public func changeCounter(_ counter: ChangeCounter) async throws(CatalogError) -> Int64 {
        try await run { [database] in try await database.read { db in try Self.counter(counter, in: db) } }
    }

    private static func counter(_ counter: ChangeCounter, in db: Database) throws -> Int64 {
        try Int64.fetchOne(db, sql: "SELECT version FROM changeCounters WHERE name = ?", arguments: [counter.rawValue]) ?? 0
    }

    public func apply(_ n: NotificationRecord) async throws(CatalogError) -> NotificationOutcome {
        try await run { [database] in
            try await database.write { db -> NotificationOutcome in
                if try Bool.fetchOne(db, sql: "SELECT 1 FROM notifications WHERE uuid = ?", arguments: [n.uuid]) == true {
                    return .duplicate
                }
                try db.execute(
                    sql: "INSERT INTO notifications (uuid, type, subtype, transactionId, receivedAt, signedPayload) VALUES (?, ?, ?, ?, ?, ?)",
                    arguments: [n.uuid, n.type, n.subtype, n.transactionId, n.receivedAt, n.signedPayload])
                if let transactionId = n.transactionId, let revoke = n.revoke {
                    if revoke {
                        try db.execute(
                            sql: "INSERT OR REPLACE INTO revocations (transactionId, revokedAt, notificationUUID) VALUES (?, ?, ?)",
                            arguments: [transactionId, n.revokedAt, n.uuid])
                    } else {
                        try db.execute(sql: "DELETE FROM revocations WHERE transactionId = ?", arguments: [transactionId])
                    }
                }
                return .applied
            }
        }
    }

    public func notificationCount() async throws(CatalogError) -> Int {
        try await run { [database] in try await database.read { db in try Int.fetchOne(db, sql: "SELECT COUNT(*) FROM notifications") ?? 0 } }
    }

    public func pruneNotifications(receivedBefore date: Date, limit: Int) async throws(CatalogError) -> Int {
        try await run { [database] in
            try await database.write { db in
                try db.execute(
                    sql: "DELETE FROM notifications WHERE rowid IN (SELECT rowid FROM notifications WHERE receivedAt < ? LIMIT ?)", arguments: [date, limit])
                return db.changesCount
            }
        }
    }

    /// SQLite cannot tell other processes; they poll ``revocations(changedSince:)``.
    public func watchRevocations(_ onChange: @escaping @Sendable (RevocationChange) -> Void) async -> Bool { false }

    public func close() async {}

    private func run<T: Sendable>(_ body: @Sendable () async throws -> T) async throws(CatalogError) -> T {
        do { return try await body() } catch { throw Self.storageError(error, location) }
    }

    static func storageError(_ error: any Error, _ location: String) -> CatalogError {
        if let error = error as? CatalogError { return error }
        if let db = error as? DatabaseError {
            switch db.resultCode {
            case .SQLITE_READONLY, .SQLITE_CANTOPEN, .SQLITE_PERM:
                return CatalogError(.storage, "\(location) cannot be written (\(db.resultCode)): make the folder and catalog.sqlite writable by the server")
            case .SQLITE_FULL:
                return CatalogError(.storage, "the disk holding \(location) is full: free space; nothing was changed")
            default:
                return CatalogError(.storage, "\(location) failed: \(db.message ?? "\(db.resultCode)")")
            }
        }
        return CatalogError(.storage, "\(location) failed: \(error)")
    }
}

extension CatalogError {
    /// The one message for a version that is not in the catalog.
    public static func unpublished(_ productId: String, _ contentVersion: String) -> CatalogError {
        CatalogError(.notFound, "\(productId) \(contentVersion) is not published: see iap-server catalog")
    }
}

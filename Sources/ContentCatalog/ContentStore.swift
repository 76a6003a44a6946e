import ContentArchive
import Crypto
import DurableFiles
import Foundation
import GRDB
import IAPProtocol

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What went wrong in the catalog; the server maps it to an HTTP status.
public enum CatalogErrorCode: String, ErrorCode {
    /// The archive is malformed, corrupt, over the cap, or lies about itself (400).
    case invalidArchive = "invalid-archive"
    /// The version is not newer than the latest, or differs from what was published (409).
    case conflict
    /// Nothing published under that product or version (404).
    case notFound = "not-found"
    /// The data folder or database cannot be written (503).
    case storage
}

/// An error from the catalog.
public typealias CatalogError = CodedError<CatalogErrorCode>

/// One published content version.
public struct PublishedVersion: Codable, Sendable, Equatable, FetchableRecord, PersistableRecord {
    public static let databaseTableName = "versions"
    public var productId: String
    public var contentVersion: String
    /// SHA-256 of the archive: its name in the store and its strong ETag.
    public var sha256: String
    /// The archive's size in bytes (what StoreKit called `downloadContentLengths`).
    public var size: Int64
    /// The content's size once extracted.
    public var contentLength: Int64
    public var publishedAt: Date
    /// SHA-256 of the archive's manifest as the server serves it (`archives/<sha256>.manifest.json`),
    /// which clients fetch for delta updates; nil for versions published before manifests were kept.
    public var manifestSHA256: String? = nil
    /// A staged rollout: the share of purchases (1-99) that get this version; nil when every
    /// purchase does. Which purchases is stable by transaction id (``ContentStore/rolloutBucket``).
    public var rolloutPercent: Int? = nil
    /// When the version was rolled back: no grant names it since, and the version before serves.
    public var rolledBackAt: Date? = nil

    /// Whether a purchase gets this version: not rolled back, and in its rollout.
    public func isServed(toBucket bucket: Int) -> Bool {
        rolledBackAt == nil && bucket < (rolloutPercent ?? 100)
    }
}

/// What `publish` did.
public enum PublishOutcome: Sendable, Equatable {
    case published(PublishedVersion)
    /// The same bytes were already published under that version: nothing changed.
    case unchanged(PublishedVersion)

    public var version: PublishedVersion {
        switch self {
        case .published(let v), .unchanged(let v): v
        }
    }
}

/// Whether a notification changed anything.
public enum NotificationOutcome: Sendable, Equatable {
    case applied
    /// Its `notificationUUID` was seen before; nothing was done again.
    case duplicate
}

/// The server's durable state in `<data>/`: `catalog.sqlite` (versions, grants, revocations,
/// notifications) and `archives/<sha256>.zip`, content-addressed and immutable.
public final class ContentStore: Sendable {
    public let dataDirectory: String
    private let database: DatabaseQueue

    public init(dataDirectory: String) throws(CatalogError) {
        self.dataDirectory = dataDirectory
        for folder in [dataDirectory, dataDirectory + "/archives", dataDirectory + "/tmp"] {
            do {
                try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
            } catch {
                throw CatalogError(.storage, "cannot create \(folder): \(error.localizedDescription); choose a writable --data folder")
            }
        }
        do {
            var configuration = Configuration()
            configuration.busyMode = .timeout(10)
            database = try DatabaseQueue(path: dataDirectory + "/catalog.sqlite", configuration: configuration)
            try Self.migrator.migrate(database)
        } catch {
            throw Self.storageError(error, dataDirectory)
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
        return migrator
    }

    /// The manifest the server computed from archive `sha256` when it was published.
    public func manifestPath(sha256: String) -> String { dataDirectory + "/archives/" + sha256 + ".manifest.json" }

    /// What keeps this server from serving everything it publishes: the database unreadable, or
    /// published archives missing from `archives/`; empty when ready.
    public func readinessProblems() -> [String] {
        let versions: [PublishedVersion]
        do {
            versions = try database.read { db in try PublishedVersion.fetchAll(db) }
        } catch {
            return ["the catalog database cannot be read: \(error)"]
        }
        let missing = versions.filter { access(archivePath(sha256: $0.sha256), R_OK) != 0 }
        guard let first = missing.first else { return [] }
        return ["\(missing.count) published archive(s) missing from \(dataDirectory)/archives, \(first.productId) \(first.contentVersion) (\(first.sha256)) first"]
    }

    public func archivePath(sha256: String) -> String { dataDirectory + "/archives/" + sha256 + ".zip" }

    /// A fresh path for an upload in progress, inside the data folder so it can be renamed into place.
    public func temporaryUploadPath() -> String { dataDirectory + "/tmp/upload-\(UUID().uuidString)" }

    // MARK: Catalog

    /// Validates an archive with the format library and publishes it atomically.
    ///
    /// The archive must be well-formed, within the 2 GiB cap, and agree with `manifest` when one is
    /// given. Its version must be newer than the product's latest; publishing identical bytes again
    /// changes nothing; anything else is a conflict. With `moveFile` the file is renamed into the
    /// store (it must be on the same file system), otherwise copied.
    public func publish(
        archiveAt path: String, manifest: ArchiveManifest? = nil, moveFile: Bool = false, rolloutPercent: Int? = nil, now: Date = Date()
    ) throws(CatalogError) -> PublishOutcome {
        if let rolloutPercent, !(1...100).contains(rolloutPercent) {
            throw CatalogError(.invalidArchive, "a rollout is 1 to 100 percent of purchases, not \(rolloutPercent)")
        }
        let computed: ArchiveManifest
        do throws(ArchiveError) {
            computed = try ArchiveVerifier.computeManifest(archive: path)
            guard computed.archiveSize <= ArchiveLimits.maxArchiveSize else {
                throw ArchiveError(.capExceeded, "the archive is \(computed.archiveSize) bytes, over the cap of \(ArchiveLimits.maxArchiveSize) bytes (2 GiB): split the content into several products")
            }
            if let manifest {
                try ArchiveVerifier.check(computed, against: manifest, archive: "the archive", source: "its manifest")
            }
        } catch {
            throw CatalogError(error.code == .io ? .storage : .invalidArchive, error.message)
        }
        let product = computed.productId.rawValue, version = computed.contentVersion
        // What clients trust for delta updates is the manifest computed here from the bytes, not
        // an uploaded one; its creation time is fixed so that the same archive gives the same file.
        let manifestData = computed.jsonData()
        let record = PublishedVersion(
            productId: product, contentVersion: version.string, sha256: computed.archiveSHA256,
            size: Int64(computed.archiveSize), contentLength: Int64(computed.contentLength), publishedAt: now,
            manifestSHA256: Hex.encode(SHA256.hash(data: manifestData)), rolloutPercent: rolloutPercent == 100 ? nil : rolloutPercent)
        // Check before touching the store, so a refused upload leaves nothing behind.
        if let existing = try decide(record) { return .unchanged(existing) }
        try store(path, as: computed.archiveSHA256, move: moveFile)
        do {
            try AtomicFile.write(manifestData, to: manifestPath(sha256: computed.archiveSHA256), permissions: 0o444)
        } catch {
            throw CatalogError(.storage, "cannot write the manifest into \(dataDirectory)/archives: \(error.message)")
        }
        do {
            return try database.write { db throws -> PublishOutcome in
                // Checked again inside the write transaction: another publisher may have won meanwhile.
                if let existing = try Self.decide(record, db) { return .unchanged(existing) }
                try record.insert(db)
                return .published(record)
            }
        } catch let error as CatalogError {
            throw error
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    private func decide(_ record: PublishedVersion) throws(CatalogError) -> PublishedVersion? {
        do {
            return try database.read { db in try Self.decide(record, db) }
        } catch let error as CatalogError {
            throw error
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    /// nil: publish it; a version: already published with these bytes; throws on conflict.
    private static func decide(_ record: PublishedVersion, _ db: Database) throws -> PublishedVersion? {
        let existing = try PublishedVersion.filter(Column("productId") == record.productId).fetchAll(db)
        if let same = existing.first(where: { $0.contentVersion == record.contentVersion }) {
            if same.sha256 == record.sha256 { return same }
            throw CatalogError(
                .conflict,
                "\(record.productId) \(record.contentVersion) is already published with other bytes (sha256 \(same.sha256.prefix(16))…): published versions are immutable; raise ContentVersion and publish again"
            )
        }
        let newVersion = try ContentVersion(record.contentVersion)
        if let latest = existing.compactMap({ try? ContentVersion($0.contentVersion) }).max(), !(latest < newVersion) || latest.isNumericallyEqual(to: newVersion) {
            throw CatalogError(.conflict, "\(record.productId) \(record.contentVersion) is not newer than the latest published version \(latest): raise ContentVersion above \(latest) and pack again")
        }
        return nil
    }

    private func store(_ path: String, as sha256: String, move: Bool) throws(CatalogError) {
        let target = archivePath(sha256: sha256)
        if access(target, F_OK) == 0 {
            if move { unlink(path) }
            return
        }
        var source = path
        if !move {
            source = temporaryUploadPath()
            do {
                try FileManager.default.copyItem(atPath: path, toPath: source)
            } catch {
                try? FileManager.default.removeItem(atPath: source)
                throw CatalogError(.storage, "cannot copy the archive into \(dataDirectory)/tmp: \(error.localizedDescription); check free space and permissions")
            }
        }
        // The bytes reach the disk before their name does: a power cut never publishes a torn archive.
        let fd = open(source, O_RDONLY)
        guard fd >= 0, fsync(fd) == 0 else {
            let reason = errnoDescription(errno)
            if fd >= 0 { close(fd) }
            if !move { unlink(source) }
            throw CatalogError(.storage, "cannot sync the archive \(source): \(reason); check free space")
        }
        close(fd)
        chmod(source, 0o444)
        guard rename(source, target) == 0 else {
            let reason = String(cString: strerror(errno))
            if !move { unlink(source) }
            throw CatalogError(.storage, "cannot move the archive into \(target): \(reason)")
        }
        do { try Directory.sync(dataDirectory + "/archives") } catch { throw CatalogError(.storage, error.message) }
    }

    // MARK: Staged rollouts

    /// A purchase's place (0-99) in every rollout of `productId`: the first four bytes of
    /// SHA-256("<productId>:<transactionId>"). Stable, so a device keeps its version as a rollout
    /// widens, and spread evenly over transaction ids; per product, so the same purchasers are not
    /// always first.
    public static func rolloutBucket(productId: String, transactionId: String) -> Int {
        let digest = Array(SHA256.hash(data: Data("\(productId):\(transactionId)".utf8)))
        let value = UInt32(digest[0]) << 24 | UInt32(digest[1]) << 16 | UInt32(digest[2]) << 8 | UInt32(digest[3])
        return Int(value % 100)
    }

    /// The version a purchase gets among `versions` (newest first): the newest one served to it.
    public static func version(forTransaction transactionId: String, productId: String, among versions: [PublishedVersion]) -> PublishedVersion? {
        let bucket = rolloutBucket(productId: productId, transactionId: transactionId)
        return versions.first { $0.isServed(toBucket: bucket) }
    }

    /// Stages a version for `percent` of purchases (1-99), or promotes it to every purchase (100);
    /// undoes a rollback. Takes effect for the next grant.
    public func setRollout(productId: String, contentVersion: String, percent: Int) throws(CatalogError) -> PublishedVersion {
        guard (1...100).contains(percent) else {
            throw CatalogError(.invalidArchive, "a rollout is 1 to 100 percent of purchases, not \(percent); roll a version back with rollback")
        }
        return try update(productId: productId, contentVersion: contentVersion) {
            $0.rolloutPercent = percent == 100 ? nil : percent
            $0.rolledBackAt = nil
        }
    }

    /// Rolls a version back at once: no new grant names it, and each purchase gets the newest
    /// version still served to it (grants already made stay valid until they expire).
    public func rollBack(productId: String, contentVersion: String, now: Date = Date()) throws(CatalogError) -> PublishedVersion {
        try update(productId: productId, contentVersion: contentVersion) { $0.rolledBackAt = $0.rolledBackAt ?? now }
    }

    private func update(productId: String, contentVersion: String, _ change: @Sendable (inout PublishedVersion) -> Void) throws(CatalogError) -> PublishedVersion {
        do {
            return try database.write { db in
                guard var version = try PublishedVersion.filter(Column("productId") == productId && Column("contentVersion") == contentVersion).fetchOne(db)
                else {
                    throw CatalogError(.notFound, "\(productId) \(contentVersion) is not published: see iap-server catalog")
                }
                change(&version)
                try version.update(db)
                return version
            }
        } catch let error as CatalogError {
            throw error
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    /// Every version of a product, newest first.
    public func versions(productId: String) throws(CatalogError) -> [PublishedVersion] {
        let rows: [PublishedVersion]
        do {
            rows = try database.read { db in try PublishedVersion.filter(Column("productId") == productId).fetchAll(db) }
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
        return rows.sorted { a, b in
            guard let va = try? ContentVersion(a.contentVersion), let vb = try? ContentVersion(b.contentVersion) else { return a.contentVersion > b.contentVersion }
            return vb < va
        }
    }

    /// Every product with its versions, newest first.
    public func catalog() throws(CatalogError) -> [(productId: String, versions: [PublishedVersion])] {
        let ids: [String]
        do {
            ids = try database.read { db in try String.fetchAll(db, sql: "SELECT DISTINCT productId FROM versions ORDER BY productId") }
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
        var result: [(String, [PublishedVersion])] = []
        for id in ids { result.append((id, try versions(productId: id))) }
        return result
    }

    // MARK: Ledger

    /// Records that a transaction was granted a download.
    public func recordGrant(transactionId: String, originalTransactionId: String?, productId: String, environment: String?, now: Date = Date()) throws(CatalogError) {
        do {
            try database.write { db in
                try db.execute(
                    sql: """
                        INSERT INTO grants (transactionId, originalTransactionId, productId, environment, firstGrantedAt, lastGrantedAt)
                        VALUES (?, ?, ?, ?, ?, ?)
                        ON CONFLICT(transactionId) DO UPDATE SET lastGrantedAt = excluded.lastGrantedAt
                        """, arguments: [transactionId, originalTransactionId, productId, environment, now, now])
            }
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    public func isRevoked(transactionId: String) throws(CatalogError) -> Bool {
        do {
            return try database.read { db in
                try Bool.fetchOne(db, sql: "SELECT 1 FROM revocations WHERE transactionId = ?", arguments: [transactionId]) ?? false
            }
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    /// Every revoked transaction id: servers keep this set in memory to check each content request.
    public func revokedTransactionIds() throws(CatalogError) -> Set<String> {
        do {
            return Set(try database.read { db in try String.fetchAll(db, sql: "SELECT transactionId FROM revocations") })
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    /// Stores a notification and applies its effect in one transaction, once per UUID: `revoke`
    /// true cuts access for `transactionId`, false restores it, nil changes nothing.
    public func apply(
        notificationUUID: String, type: String, subtype: String?, transactionId: String?, revoke: Bool?,
        revokedAt: Date, signedPayload: String, now: Date = Date()
    ) throws(CatalogError) -> NotificationOutcome {
        do {
            return try database.write { db -> NotificationOutcome in
                if try Bool.fetchOne(db, sql: "SELECT 1 FROM notifications WHERE uuid = ?", arguments: [notificationUUID]) == true {
                    return .duplicate
                }
                try db.execute(
                    sql: "INSERT INTO notifications (uuid, type, subtype, transactionId, receivedAt, signedPayload) VALUES (?, ?, ?, ?, ?, ?)",
                    arguments: [notificationUUID, type, subtype, transactionId, now, signedPayload])
                if let transactionId, let revoke {
                    if revoke {
                        try db.execute(
                            sql: "INSERT OR REPLACE INTO revocations (transactionId, revokedAt, notificationUUID) VALUES (?, ?, ?)",
                            arguments: [transactionId, revokedAt, notificationUUID])
                    } else {
                        try db.execute(sql: "DELETE FROM revocations WHERE transactionId = ?", arguments: [transactionId])
                    }
                }
                return .applied
            }
        } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    public func notificationCount() throws(CatalogError) -> Int {
        do { return try database.read { db in try Int.fetchOne(db, sql: "SELECT COUNT(*) FROM notifications") ?? 0 } } catch {
            throw Self.storageError(error, dataDirectory)
        }
    }

    static func storageError(_ error: any Error, _ data: String) -> CatalogError {
        if let error = error as? CatalogError { return error }
        if let db = error as? DatabaseError {
            switch db.resultCode {
            case .SQLITE_READONLY, .SQLITE_CANTOPEN, .SQLITE_PERM:
                return CatalogError(.storage, "the catalog database in \(data) cannot be written (\(db.resultCode)): make the folder and catalog.sqlite writable by the server")
            case .SQLITE_FULL:
                return CatalogError(.storage, "the disk holding \(data) is full: free space; nothing was changed")
            default:
                return CatalogError(.storage, "the catalog database in \(data) failed: \(db.message ?? "\(db.resultCode)")")
            }
        }
        return CatalogError(.storage, "the catalog in \(data) failed: \(error)")
    }
}

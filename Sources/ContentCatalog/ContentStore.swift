import ContentArchive
import Crypto
import DurableFiles
import Foundation
import GRDB
import IAPProtocol
import Synchronization

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
    /// purchase does. Which purchases is stable by original transaction id (``ContentStore/rolloutBucket``).
    public var rolloutPercent: Int? = nil
    /// When the version was rolled back: no grant names it since, and the version before serves.
    public var rolledBackAt: Date? = nil
    /// The replica that received the archive (its `--advertise-url`), from which replicas without
    /// a shared archive folder fetch it; nil when archives are shared or there is one server.
    public var originURL: String? = nil
    /// When the version was removed (after a rollback): its archive is deleted, it is never served
    /// again, and its number stays taken, so devices and caches never see other bytes under it.
    public var removedAt: Date? = nil

    public init(
        productId: String, contentVersion: String, sha256: String, size: Int64, contentLength: Int64, publishedAt: Date,
        manifestSHA256: String? = nil, rolloutPercent: Int? = nil, rolledBackAt: Date? = nil, originURL: String? = nil, removedAt: Date? = nil
    ) {
        self.originURL = originURL
        self.removedAt = removedAt
        self.productId = productId
        self.contentVersion = contentVersion
        self.sha256 = sha256
        self.size = size
        self.contentLength = contentLength
        self.publishedAt = publishedAt
        self.manifestSHA256 = manifestSHA256
        self.rolloutPercent = rolloutPercent
        self.rolledBackAt = rolledBackAt
    }

    /// Whether a purchase gets this version: not rolled back, and in its rollout.
    public func isServed(toBucket bucket: Int) -> Bool {
        rolledBackAt == nil && removedAt == nil && bucket < (rolloutPercent ?? 100)
    }
}

/// What `publish` did.
public enum PublishOutcome: Sendable, Equatable {
    case published(PublishedVersion)
    /// The same bytes were already published under that version: nothing changed.
    case unchanged(PublishedVersion)
    /// The same bytes were already published under that version, and the store's copy of the
    /// archive or its manifest was missing or damaged: it was put back from these bytes.
    case repaired(PublishedVersion)

    public var version: PublishedVersion {
        switch self {
        case .published(let v), .unchanged(let v), .repaired(let v): v
        }
    }
}

/// Whether a notification changed anything.
public enum NotificationOutcome: Sendable, Equatable {
    case applied
    /// Its `notificationUUID` was seen before; nothing was done again.
    case duplicate
}

/// The server's durable state: content-addressed, immutable archives in `<data>/archives/`
/// (`<sha256>.zip` and `<sha256>.manifest.json`), and a ``CatalogDatabase`` for the catalog,
/// grants, revocations and notifications (SQLite in `<data>/catalog.sqlite` unless another is given).
public final class ContentStore: Sendable {
    public let dataDirectory: String
    /// `<data>/archives` unless given: a folder several replicas may share (a network mount).
    public let archivesDirectory: String
    /// Uploads in progress: inside the archive folder's file system, so they rename into place.
    private let uploadsDirectory: String
    public let database: any CatalogDatabase

    /// Opens the store in `dataDirectory`, with archives in `archivesDirectory` (default
    /// `<data>/archives`) and `database` or else the SQLite catalog in `dataDirectory`.
    public init(dataDirectory: String, archivesDirectory: String? = nil, database: (any CatalogDatabase)? = nil) throws(CatalogError) {
        self.dataDirectory = dataDirectory
        self.archivesDirectory = archivesDirectory ?? dataDirectory + "/archives"
        uploadsDirectory = archivesDirectory.map { $0 + "/.uploads" } ?? dataDirectory + "/tmp"
        for folder in [dataDirectory, self.archivesDirectory, uploadsDirectory] {
            do throws(DurableFileError) {
                try Directory.create(folder)
            } catch {
                // The system's reason in the project's words ("exists and is not a folder",
                // "permission denied"), rather than Foundation's "The operation could not be completed".
                throw CatalogError(.storage, "the data folder (--data): \(error.message)")
            }
        }
        if let database {
            self.database = database
        } else {
            self.database = try SQLiteCatalogDatabase(dataDirectory: dataDirectory)
        }
        removedLeftoverUploads = UnfinishedFiles.removeLeftovers(in: uploadsDirectory) { $0.hasPrefix(Self.uploadPrefix) }
    }

    /// Uploads that a run stopped part-way (a crash, `kill -9`, a cancelled `publish`) had left in
    /// the uploads folder, removed when this store was opened. An upload in progress elsewhere
    /// (another replica sharing the folder) holds a lock on its file and is left alone.
    public let removedLeftoverUploads: [String]
    private static let uploadPrefix = "upload-"

    /// The manifest the server computed from archive `sha256` when it was published.
    public func manifestPath(sha256: String) -> String { archivesDirectory + "/" + sha256 + ".manifest.json" }

    /// What a readiness probe asks of this server.
    public enum ReadinessScope: Sendable, Equatable {
        /// All it does: grants, notifications and publishing need the catalog database.
        case everything
        /// The download URLs it has granted or will be shown: the published archives on disk.
        /// Grant keys and revocations are kept in memory, so these are served while a shared
        /// database is away (`/readyz?for=downloads`).
        case downloads
    }

    /// A readiness answer: what keeps the server from its scope (empty when ready), and for
    /// ``ReadinessScope/downloads`` the database's trouble it is ready in spite of.
    public struct Readiness: Sendable, Equatable {
        public var problems: [String]
        public var databaseTrouble: String?
        public var isReady: Bool { problems.isEmpty }
        public init(problems: [String], databaseTrouble: String? = nil) { (self.problems, self.databaseTrouble) = (problems, databaseTrouble) }
    }

    /// What keeps this server from serving everything it publishes: the database unreachable, or
    /// published archives missing from `archives/`; empty when ready.
    public func readinessProblems() async -> [String] { await readiness(for: .everything).problems }

    /// Whether this server is ready for `scope`: the database answers (for
    /// ``ReadinessScope/everything``) and every published archive is on disk with its published
    /// size.
    ///
    /// Balancers ask often (every few seconds, each of them), and a publisher's catalog runs to
    /// tens of thousands of versions: the whole check cost 105 ms of CPU at 25,000. So a "ready"
    /// is kept while the catalog's ``ChangeCounter/versions`` stays, for up to
    /// ``readinessRecheck``; every answer still asks the database (the counter), and looks at one
    /// archive, so a lost mount is seen at once. A "not ready" is kept the same way while the
    /// first archive it named is still missing or damaged (looked at each time), so that a
    /// replica out of the balancer's set does not read the whole catalog at every probe (200 ms
    /// of CPU at 25,000 versions); once that archive is back, the next answer looks at them all.
    ///
    /// For downloads, a database that does not answer (or that the pool's keeper knows is away,
    /// then without waiting out a query's deadline) is reported beside the answer, and the archives
    /// are those of the last catalog read: replicas share one database, and a balancer that took
    /// every replica out while it is away would stop the downloads they can still serve.
    public func readiness(for scope: ReadinessScope) async -> Readiness {
        var counter: Int64?
        var trouble: String?
        if scope == .everything || database.isAnswering {
            do {
                counter = try await database.changeCounter(.versions)
            } catch {
                trouble = "\(database.location) cannot be read: \(error.message)"
            }
        } else {
            trouble = "\(database.location) does not answer"
        }
        if let trouble, scope == .everything { return Readiness(problems: [trouble]) }
        // Without the database, a "ready" holds only for the newest catalog known.
        let known = counter ?? lastVersions.withLock { $0?.counter }
        if let last = lastReady.withLock({ $0 }), last.counter == known,
            ContinuousClock.now - last.at < Self.readinessRecheck, last.probe.map({ access($0, R_OK) == 0 }) ?? true
        {
            return Readiness(problems: [], databaseTrouble: trouble)
        }
        if let counter, let last = lastUnready.withLock({ $0 }), last.counter == counter, ContinuousClock.now - last.at < Self.readinessRecheck,
            let still = damage(of: last.first, readingContents: false, includingManifest: false).0
        {
            return Readiness(problems: [unreadyMessage(count: last.count, first: last.first, damage: still)], databaseTrouble: trouble)
        }
        let versions: [PublishedVersion]
        let read: Int64
        if let counter {
            do {
                versions = try await database.versions(productId: nil)
                read = counter
                noteVersionsRead(versions, atCounter: counter)
            } catch {
                let message = "\(database.location) cannot be read: \(error.message)"
                guard scope == .downloads, let known = lastVersions.withLock({ $0 }) else { return Readiness(problems: [message]) }
                (versions, read, trouble) = (known.versions, known.counter, message)
            }
        } else if let known = lastVersions.withLock({ $0 }) {
            (versions, read) = (known.versions, known.counter)
        } else {
            return Readiness(
                problems: [
                    "the published archives are not known: the catalog has not been read since the server started (\(trouble ?? database.location)); ready once the database answers"
                ],
                databaseTrouble: trouble)
        }
        let published = versions.filter { $0.removedAt == nil }
        // What stat tells (presence and size): reading every archive is `iap-server check`'s work.
        // A missing manifest costs delta updates only, which fall back to whole downloads: not looked at.
        let damaged = published.compactMap { version in
            damage(of: version, readingContents: false, includingManifest: false).0.map { (version, $0) }
        }
        guard let first = damaged.first else {
            // The newest archive: the likeliest to be missing after a bad deploy, and on any mount.
            let newest = published.max { $0.publishedAt < $1.publishedAt }
            lastReady.withLock { $0 = (read, ContinuousClock.now, newest.map { archivePath(sha256: $0.sha256) }) }
            lastUnready.withLock { $0 = nil }
            return Readiness(problems: [], databaseTrouble: trouble)
        }
        lastReady.withLock { $0 = nil }
        // Only a verdict on the catalog the database has now is kept.
        lastUnready.withLock { $0 = read == counter ? (read, ContinuousClock.now, first.0, damaged.count) : nil }
        return Readiness(problems: [unreadyMessage(count: damaged.count, first: first.0, damage: first.1)], databaseTrouble: trouble)
    }

    private func unreadyMessage(count: Int, first: PublishedVersion, damage: ArchiveDamage) -> String {
        "\(count) published version(s) missing or damaged in \(archivesDirectory) (iap-server check lists them), first \(damage.message(for: first, in: self))"
    }

    /// Keeps the newest catalog read (by the server's beat too), which a download readiness check
    /// looks for while the database is away. `counter`: ``ChangeCounter/versions`` read before
    /// `versions` were.
    public func noteVersionsRead(_ versions: [PublishedVersion], atCounter counter: Int64) {
        // The published ones only: a catalog's removed versions are its history, not its archives.
        let published = versions.filter { $0.removedAt == nil }
        lastVersions.withLock { known in
            if known.map({ $0.counter <= counter }) ?? true { known = (counter, published) }
        }
    }

    /// The last "ready": the catalog's counter then, when, and one archive to look at each time.
    private let lastReady = Mutex<(counter: Int64, at: ContinuousClock.Instant, probe: String?)?>(nil)
    /// The newest catalog read (``noteVersionsRead(_:atCounter:)``), its published versions, and its counter.
    private let lastVersions = Mutex<(counter: Int64, versions: [PublishedVersion])?>(nil)
    /// Archives a read found with other bytes than published at their published size (bit rot,
    /// a write in place), by SHA-256, with the file as it was then: `stat` alone cannot tell
    /// these, so ``damage(of:readingContents:includingManifest:)`` reports them from here until
    /// the file changes (repaired: renamed over, or written again in place).
    let rotten = Mutex<[String: (stamp: FileIdentity, digest: String)]>([:])

    /// The last "not ready" on a catalog the database gave: its counter, when, the first version
    /// found missing or damaged, and how many were.
    private let lastUnready = Mutex<(counter: Int64, at: ContinuousClock.Instant, first: PublishedVersion, count: Int)?>(nil)

    /// Forgets the last verdict, so that the next readiness check looks at the archives again.
    func forgetReady() {
        lastReady.withLock { $0 = nil }
        lastUnready.withLock { $0 = nil }
    }
    /// How long a "ready" is kept while the catalog does not change: an archive deleted by hand
    /// is seen within this.
    public static let readinessRecheck: Duration = .seconds(10)

    /// Where the archive with this SHA-256 lives: archives are stored by content, immutable.
    public func archivePath(sha256: String) -> String { archivesDirectory + "/" + sha256 + ".zip" }

    /// A fresh path for an upload in progress, inside the archive folder's file system so it can
    /// be renamed into place. The caller creates the file, locks it (``UnfinishedFiles/Claim/lock()``)
    /// and keeps the claim until the file is published or removed: opening the store sweeps the
    /// uploads folder of files nobody holds.
    public func claimUpload() -> UnfinishedFiles.Claim {
        UnfinishedFiles.Claim(uploadsDirectory + "/" + Self.uploadPrefix + UUID().uuidString)
    }

    // MARK: Catalog

    /// Validates an archive with the format library and publishes it atomically.
    ///
    /// The archive must be well-formed, within the 2 GiB cap, and agree with `manifest` when one is
    /// given. Its version must be newer than the product's latest; publishing identical bytes again
    /// changes nothing; anything else is a conflict. With `moveFile` the file is renamed into the
    /// store (it must be on the same file system), otherwise copied. Reading and syncing the
    /// archive run on a dispatch queue, not on the caller's executor.
    public func publish(
        archiveAt path: String, manifest: ArchiveManifest? = nil, moveFile: Bool = false, rolloutPercent: Int? = nil, originURL: String? = nil,
        now: Date = Date()
    ) async throws(CatalogError) -> PublishOutcome {
        if let rolloutPercent, !(1...100).contains(rolloutPercent) {
            throw CatalogError(.invalidArchive, "a rollout is 1 to 100 percent of purchases, not \(rolloutPercent)")
        }
        let computed = try await Self.offload { () throws(CatalogError) in try Self.verify(archiveAt: path, against: manifest) }
        // What clients trust for delta updates is the manifest computed here from the bytes, not
        // an uploaded one; its creation time is fixed so that the same archive gives the same file.
        let manifestData = computed.jsonData()
        let record = PublishedVersion(
            productId: computed.productId.rawValue, contentVersion: computed.contentVersion.string, sha256: computed.archiveSHA256,
            size: Int64(computed.archiveSize), contentLength: Int64(computed.contentLength), publishedAt: now,
            manifestSHA256: Hex.encode(SHA256.hash(data: manifestData)), rolloutPercent: rolloutPercent == 100 ? nil : rolloutPercent, originURL: originURL)
        // Check before touching the store, so a refused upload leaves nothing behind.
        if let existing = try Self.decide(record, among: try await database.versions(productId: record.productId)) {
            let repaired = try await Self.offload { () throws(CatalogError) in
                try self.repair(existing, from: path, manifest: manifestData, move: moveFile)
            }
            return repaired ? .repaired(existing) : .unchanged(existing)
        }
        try await Self.offload { () throws(CatalogError) in
            try self.store(path, as: computed.archiveSHA256, move: moveFile)
            try self.storeManifest(manifestData, archiveSHA256: computed.archiveSHA256)
        }
        // Decided again inside the write transaction: another publisher may have won meanwhile.
        return try await database.insert(record) { existing throws(CatalogError) in try Self.decide(record, among: existing) }
    }

    private static func verify(archiveAt path: String, against manifest: ArchiveManifest?) throws(CatalogError) -> ArchiveManifest {
        do throws(ArchiveError) {
            let computed = try ArchiveVerifier.computeManifest(archive: path)
            guard computed.archiveSize <= ArchiveLimits.maxArchiveSize else {
                throw ArchiveError(.capExceeded, "the archive is \(computed.archiveSize) bytes, over the cap of \(ArchiveLimits.maxArchiveSize) bytes (2 GiB): split the content into several products")
            }
            if let manifest {
                try ArchiveVerifier.check(computed, against: manifest, archive: "the archive", source: "its manifest")
            }
            return computed
        } catch {
            throw CatalogError(error.code == .io ? .storage : .invalidArchive, error.message)
        }
    }

    /// Runs file work that blocks (reading a 2 GiB archive, fsync) on a dispatch queue, so that
    /// it never holds one of the few threads Swift concurrency runs every task on.
    static func offload<T: Sendable>(_ work: @escaping @Sendable () throws(CatalogError) -> T) async throws(CatalogError) -> T {
        let result: Result<T, CatalogError> = await withCheckedContinuation { continuation in
            DispatchQueue.global(qos: .utility).async {
                do throws(CatalogError) { continuation.resume(returning: .success(try work())) } catch { continuation.resume(returning: .failure(error)) }
            }
        }
        return try result.get()
    }

    /// nil: publish it; a version: already published with these bytes; throws on conflict.
    static func decide(_ record: PublishedVersion, among existing: [PublishedVersion]) throws(CatalogError) -> PublishedVersion? {
        if let same = existing.first(where: { $0.contentVersion == record.contentVersion }) {
            if let removed = same.removedAt {
                throw CatalogError(
                    .conflict,
                    "\(record.productId) \(record.contentVersion) was removed at \(removed.formatted(.iso8601)), and a removed version is never published again (devices and caches may hold it): raise ContentVersion and pack again"
                )
            }
            if same.sha256 == record.sha256 { return same }
            throw CatalogError(
                .conflict,
                "\(record.productId) \(record.contentVersion) is already published with other bytes (sha256 \(same.sha256.prefix(16))…): published versions are immutable; raise ContentVersion and publish again"
            )
        }
        let newVersion: ContentVersion
        do throws(ArchiveError) { newVersion = try ContentVersion(record.contentVersion) } catch { throw CatalogError(.invalidArchive, error.message) }
        if let latest = existing.compactMap({ try? ContentVersion($0.contentVersion) }).max(), !(latest < newVersion) || latest.isNumericallyEqual(to: newVersion) {
            throw CatalogError(.conflict, "\(record.productId) \(record.contentVersion) is not newer than the latest published version \(latest): raise ContentVersion above \(latest) and pack again")
        }
        return nil
    }

    /// Puts back a published version's files that are missing or damaged, from `path`, which was
    /// just found to hold the version's very bytes: publishing again is how an operator repairs
    /// what `iap-server check` or `/readyz` reports. Reads the stored copy once to tell. Whether
    /// anything was put back; `path` is consumed when `move`.
    private func repair(_ version: PublishedVersion, from path: String, manifest: Data, move: Bool) throws(CatalogError) -> Bool {
        guard let damage = damage(of: version, readingContents: true).0 else {
            if move { unlink(path) }
            return false
        }
        switch damage {
        case .manifestMissing, .manifestWrongDigest:
            if move { unlink(path) }
        case .missing, .wrongSize, .wrongDigest, .unreadable:
            try store(path, as: version.sha256, move: move, replacing: true)
        }
        // The manifest is made from the bytes the same way each time; one that is not what the
        // catalog lists (made by an older release) is left alone rather than listed wrongly.
        if let published = version.manifestSHA256, Hex.encode(SHA256.hash(data: manifest)) == published,
            (try? FileDigest.sha256(manifestPath(sha256: version.sha256)).get().1) != published
        {
            try storeManifest(manifest, archiveSHA256: version.sha256)
        }
        return true
    }

    /// Moves an archive fetched from another replica into the store the way `publish` does
    /// (synced, read-only, renamed); the caller has checked its size and SHA-256 against the catalog.
    /// `replacing`: over a damaged copy at its name (otherwise a copy there is kept).
    public func adoptArchive(at path: String, sha256: String, replacing: Bool = false) async throws(CatalogError) {
        try await Self.offload { () throws(CatalogError) in try self.store(path, as: sha256, move: true, replacing: replacing) }
    }

    /// Writes archive `archiveSHA256`'s manifest (read-only, atomically).
    public func storeManifest(_ data: Data, archiveSHA256: String) throws(CatalogError) {
        do throws(DurableFileError) {
            try AtomicFile.write(data, to: manifestPath(sha256: archiveSHA256), permissions: 0o444)
        } catch {
            throw CatalogError(.storage, "cannot write the manifest into \(archivesDirectory): \(error.message)")
        }
    }

    /// `replacing`: a file at the target (damaged) is replaced; otherwise it is kept, as
    /// archives are named by their bytes.
    private func store(_ path: String, as sha256: String, move: Bool, replacing: Bool = false) throws(CatalogError) {
        let target = archivePath(sha256: sha256)
        if !replacing, access(target, F_OK) == 0 {
            if move { unlink(path) }
            return
        }
        var source = path
        var claim: UnfinishedFiles.Claim?
        defer { claim?.release() }
        if !move {
            claim = claimUpload()
            source = claim!.path
            // In large writes: the store's copy is what sendfile serves from the page cache next.
            do throws(DurableFileError) {
                try LargeWriteCopy.copy(from: path, to: source, created: { claim?.lock() })
            } catch {
                throw CatalogError(.storage, "cannot copy the archive into the store: \(error.message)")
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
        // A find recorded against the file this one replaced is of the past.
        unlink(damageRecordPath(sha256: sha256))
        do { try Directory.sync(archivesDirectory) } catch { throw CatalogError(.storage, error.message) }
    }

    // MARK: Staged rollouts

    /// A purchase's place (0-99) in every rollout of `productId`: the first four bytes of
    /// SHA-256("<productId>:<transactionId>"), given the original transaction id (the server
    /// does, so renewals stay with their purchase). Stable, so a device keeps its version as a rollout
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
    /// Stages a published version for `percent` of purchases (100: every purchase) and clears a
    /// rollback. Refused when it would leave purchases that have a version now with none (see
    /// ``rollBack(productId:contentVersion:now:allowingUnserved:)``), unless `allowingUnserved`.
    public func setRollout(productId: String, contentVersion: String, percent: Int, allowingUnserved: Bool = false) async throws(CatalogError)
        -> PublishedVersion
    {
        guard (1...100).contains(percent) else {
            throw CatalogError(.invalidArchive, "a rollout is 1 to 100 percent of purchases, not \(percent); roll a version back with rollback")
        }
        let change: @Sendable (inout PublishedVersion) -> Void = {
            // A removed version has no archive left to serve.
            guard $0.removedAt == nil else { return }
            $0.rolloutPercent = percent == 100 ? nil : percent
            $0.rolledBackAt = nil
        }
        if !allowingUnserved {
            try await refuseUnserving(productId: productId, contentVersion: contentVersion, change, doing: "staging \(productId) \(contentVersion) for \(percent)%")
        }
        let version = try await database.update(productId: productId, contentVersion: contentVersion, change)
        if let removed = version.removedAt {
            throw CatalogError(
                .conflict, "\(productId) \(contentVersion) was removed at \(removed.formatted(.iso8601)) and its archive deleted: publish a new version instead")
        }
        return version
    }

    /// Rolls a version back at once: no new grant names it, and each purchase gets the newest
    /// version still served to it (grants already made stay valid until they expire). Refused
    /// when some purchases would then have no version at all (the last version served to them
    /// rolled back: every buyer outside the remaining rollouts would be told there is no
    /// content), unless `allowingUnserved`, for content taken away on purpose.
    public func rollBack(productId: String, contentVersion: String, now: Date = Date(), allowingUnserved: Bool = false) async throws(CatalogError)
        -> PublishedVersion
    {
        let change: @Sendable (inout PublishedVersion) -> Void = { $0.rolledBackAt = $0.rolledBackAt ?? now }
        if !allowingUnserved {
            try await refuseUnserving(productId: productId, contentVersion: contentVersion, change, doing: "rolling back \(productId) \(contentVersion)")
        }
        return try await database.update(productId: productId, contentVersion: contentVersion, change)
    }

    /// Removes a rolled-back version: marks it removed (its number stays taken: it is never served
    /// or published again) and then deletes its archive and manifest from this server's archive
    /// folder. Replicas with folders of their own delete their copies when they next read the
    /// catalog. A version still served to some purchases is refused: roll it back first, which
    /// refuses what would leave buyers with no version. Grants already made for it fail from then
    /// on with 404 `no-content`, and iap-fetch asks for a new grant on its next run. Removing a
    /// removed version again only retries deleting its files.
    public func remove(productId: String, contentVersion: String, now: Date = Date()) async throws(CatalogError) -> Removal {
        guard let current = try await database.versions(productId: productId).first(where: { $0.contentVersion == contentVersion }) else {
            throw CatalogError.unpublished(productId, contentVersion)
        }
        // Measured around the whole removal: a replica that hears of it (PostgreSQL's NOTIFY)
        // may delete the files of a shared folder before this call gets to them.
        let before = fileSizes(sha256: current.sha256)
        var version = current
        if current.removedAt == nil {
            guard current.rolledBackAt != nil else { throw Self.stillServed(current) }
            // Set only if still rolled back when the update runs: a rollout meanwhile wins.
            version = try await database.update(productId: productId, contentVersion: contentVersion) {
                if $0.rolledBackAt != nil, $0.removedAt == nil { $0.removedAt = now }
            }
            guard version.removedAt != nil else { throw Self.stillServed(version) }
        }
        try await deleteArchiveIfUnused(version)
        let after = fileSizes(sha256: current.sha256)
        return Removal(version: version, freedBytes: before.filter { after[$0.key] == nil }.values.reduce(0, +))
    }

    /// What ``remove(productId:contentVersion:now:)`` did.
    public struct Removal: Sendable, Equatable {
        /// The version, with `removedAt`.
        public let version: PublishedVersion
        /// Bytes of archive and manifest that left this server's folder during the removal (0 when
        /// they were gone already).
        public let freedBytes: Int64
    }

    private static func stillServed(_ version: PublishedVersion) -> CatalogError {
        let share = version.rolloutPercent.map { "\($0)% of purchases" } ?? "every purchase"
        return CatalogError(
            .conflict,
            "\(version.productId) \(version.contentVersion) is not rolled back (it can be granted to \(share)): roll it back first (iap-server rollback), which checks that its buyers keep a version, then remove it"
        )
    }

    /// The archives (by SHA-256) that only removed versions name: what may be deleted. Only
    /// explicit removals count; an archive the catalog does not know (a catalog that is not this
    /// folder's, say) is never among them.
    public static func removedArchives(_ versions: [PublishedVersion]) -> Set<String> {
        let live = Set(versions.filter { $0.removedAt == nil }.map(\.sha256))
        return Set(versions.filter { $0.removedAt != nil }.map(\.sha256)).subtracting(live)
    }

    /// Deletes these archives and their manifests from this server's archive folder; returns the
    /// bytes freed. Off the concurrency pool (``offload(_:)``): freeing a file's blocks takes the
    /// `unlink` itself 0.25-0.4 s per GiB on ext4 mounted with `discard` (the file system trims
    /// them as it frees them; 3 ms without), which held one of its threads that long.
    public func deleteArchives(_ sha256s: Set<String>) async -> Int64 {
        (try? await Self.offload { () throws(CatalogError) in self.deleteArchivesNow(sha256s) }) ?? 0
    }

    private func deleteArchivesNow(_ sha256s: Set<String>) -> Int64 {
        var freed: Int64 = 0
        for sha256 in sha256s {
            for (path, size) in fileSizes(sha256: sha256) where unlink(path) == 0 { freed += size }
            unlink(damageRecordPath(sha256: sha256))
        }
        if freed > 0 { try? Directory.sync(archivesDirectory) }
        return freed
    }

    private func deleteArchiveIfUnused(_ removed: PublishedVersion) async throws(CatalogError) {
        // An archive's bytes name its product and version (ContentInfo.plist), so no other
        // version can share it; checked anyway, as the rest of the catalog is cheap to read.
        guard Self.removedArchives(try await database.versions(productId: nil)).contains(removed.sha256) else { return }
        _ = await deleteArchives([removed.sha256])
    }

    /// The sizes of an archive's file and its manifest's, by path, for those that exist.
    private func fileSizes(sha256: String) -> [String: Int64] {
        var sizes: [String: Int64] = [:]
        for path in [archivePath(sha256: sha256), manifestPath(sha256: sha256)] {
            var info = stat()
            if lstat(path, &info) == 0 { sizes[path] = Int64(info.st_size) }
        }
        return sizes
    }

    /// The share of purchases (rollout buckets 0..<n) that some version is served to: a
    /// purchase gets the newest version served to its bucket, so buckets below the widest
    /// rollout of a version not rolled back have one.
    public static func servedShare(_ versions: [PublishedVersion]) -> Int {
        versions.filter { $0.rolledBackAt == nil }.map { $0.rolloutPercent ?? 100 }.max() ?? 0
    }

    /// Throws when `change` to that version would leave purchases that are served now with no
    /// version. Read before the update: two operators acting at once on one product can still
    /// race past it, which an operator's guard may allow.
    private func refuseUnserving(
        productId: String, contentVersion: String, _ change: (inout PublishedVersion) -> Void, doing action: String
    ) async throws(CatalogError) {
        let before = try await database.versions(productId: productId)
        guard let index = before.firstIndex(where: { $0.contentVersion == contentVersion }) else { return }  // the update says not found
        var after = before
        change(&after[index])
        let (was, will) = (Self.servedShare(before), Self.servedShare(after))
        guard will < was else { return }
        throw CatalogError(
            .conflict,
            "\(action) would leave \(was - will)% of its purchases with no version to download (no other version is served to them): publish a version or promote one (rollout --promote) first; to take the content away on purpose, pass --allow-unserved"
        )
    }

    /// Every version of a product, newest first.
    public func versions(productId: String) async throws(CatalogError) -> [PublishedVersion] {
        Self.newestFirst(try await database.versions(productId: productId))
    }

    /// Every product with its versions, newest first.
    public func catalog() async throws(CatalogError) -> [(productId: String, versions: [PublishedVersion])] {
        let byProduct = Dictionary(grouping: try await database.versions(productId: nil), by: \.productId)
        return byProduct.keys.sorted().map { ($0, Self.newestFirst(byProduct[$0]!)) }
    }

    private static func newestFirst(_ rows: [PublishedVersion]) -> [PublishedVersion] {
        rows.sorted { a, b in
            guard let va = try? ContentVersion(a.contentVersion), let vb = try? ContentVersion(b.contentVersion) else { return a.contentVersion > b.contentVersion }
            return vb < va
        }
    }

    // MARK: Ledger

    /// Records that a transaction was granted a download.
    public func recordGrant(transactionId: String, originalTransactionId: String?, productId: String, environment: String?, now: Date = Date()) async throws(CatalogError) {
        try await database.recordGrant(
            GrantRecord(transactionId: transactionId, originalTransactionId: originalTransactionId, productId: productId, environment: environment, grantedAt: now))
    }

    public func isRevoked(transactionId: String) async throws(CatalogError) -> Bool { try await database.isRevoked(transactionId: transactionId) }

    /// Every revoked transaction id: servers keep this set in memory to check each content request.
    public func revokedTransactionIds() async throws(CatalogError) -> Set<String> {
        try await database.revocations(changedSince: nil)?.transactionIds ?? []
    }

    /// What changed in the revocation ledger since `known`: nil when nothing did
    /// (``RevocationSnapshot``).
    public func revocations(changedSince known: RevocationPosition?) async throws(CatalogError) -> RevocationSnapshot? {
        try await database.revocations(changedSince: known)
    }

    /// Stores a notification and applies its effect in one transaction, once per UUID: `revoke`
    /// true cuts access for `transactionId`, false restores it, nil changes nothing.
    public func apply(
        notificationUUID: String, type: String, subtype: String?, transactionId: String?, revoke: Bool?,
        revokedAt: Date, signedPayload: String, now: Date = Date()
    ) async throws(CatalogError) -> NotificationOutcome {
        try await database.apply(
            NotificationRecord(
                uuid: notificationUUID, type: type, subtype: subtype, transactionId: transactionId, revoke: revoke, revokedAt: revokedAt, receivedAt: now,
                signedPayload: signedPayload))
    }

    public func notificationCount() async throws(CatalogError) -> Int { try await database.notificationCount() }

    /// Deletes the notifications received before `date`, `batch` at a time so that no write
    /// holds the database long; returns how many went.
    public func pruneNotifications(receivedBefore date: Date, batch: Int = 5_000) async throws(CatalogError) -> Int {
        var total = 0
        while true {
            let deleted = try await database.pruneNotifications(receivedBefore: date, limit: batch)
            total += deleted
            if deleted < batch { return total }
        }
    }
}

import CatalogPostgres
import ContentArchive
import ContentCatalog
import Foundation
import IAPTestSupport
import Synchronization
import Testing

/// The two places the catalog's state can live; every test here runs against both.
enum Backend: String, CaseIterable, CustomTestStringConvertible, Sendable {
    case sqlite, postgres

    var testDescription: String { rawValue }

    /// A fresh state: SQLite in `dir`, or a new database on the test PostgreSQL server.
    func freshURL() async throws -> String? {
        switch self {
        case .sqlite: nil
        case .postgres: try await PostgresServer.shared().createDatabase()
        }
    }
}

/// A product of one file in a folder of its own, packed at any version.
struct SampleProduct {
    let dir = FileManager.default.temporaryDirectory.path + "/catalog-" + UUID().uuidString
    var content: String { dir + "/content" }
    let id: ProductIdentifier

    init() throws {
        id = try ProductIdentifier("com.example.levels1")
        try FileManager.default.createDirectory(atPath: dir + "/content", withIntermediateDirectories: true)
        try Data("level data\n".utf8).write(to: URL(fileURLWithPath: dir + "/content/level.json"))
    }

    func pack(_ version: String, into out: String) throws -> PackResult {
        try ArchivePacker.pack(folder: content, options: .init(productId: id, contentVersion: try ContentVersion(version), outputDirectory: dir + "/" + out))
    }

    func remove() { try? FileManager.default.removeItem(atPath: dir) }
}

@Suite("The catalog")
struct CatalogTests {
    @Test("opening the store removes uploads a stopped run left, and none an upload in progress holds")
    func leftoverUploads() throws {
        let dir = FileManager.default.temporaryDirectory.path + "/catalog-" + UUID().uuidString
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let uploads = dir + "/data/tmp"
        try FileManager.default.createDirectory(atPath: uploads, withIntermediateDirectories: true)
        func leftover(_ name: String, modified: Date = Date().addingTimeInterval(-3600)) throws {
            try Data("partial upload".utf8).write(to: URL(fileURLWithPath: uploads + "/" + name))
            try FileManager.default.setAttributes([.modificationDate: modified], ofItemAtPath: uploads + "/" + name)
        }
        try leftover("upload-killed")
        try leftover("upload-in-progress")
        let held = open(uploads + "/upload-in-progress", O_RDONLY)
        defer { close(held) }
        #expect(flock(held, LOCK_EX | LOCK_NB) == 0)
        try leftover("upload-just-created", modified: Date())
        try leftover("notes.txt")

        let store = try ContentStore(dataDirectory: dir + "/data")
        #expect(store.removedLeftoverUploads == [uploads + "/upload-killed"])
        #expect(
            ((try? FileManager.default.contentsOfDirectory(atPath: uploads)) ?? []).sorted() == [
                "notes.txt", "upload-in-progress", "upload-just-created",
            ])
        // A claimed upload is locked as soon as it exists: a second store opened on the folder
        // (another replica) leaves it alone, whatever its age.
        let upload = store.claimUpload()
        #expect(FileManager.default.createFile(atPath: upload.path, contents: Data("bytes".utf8)))
        upload.lock()
        try FileManager.default.setAttributes([.modificationDate: Date().addingTimeInterval(-3600)], ofItemAtPath: upload.path)
        #expect(try ContentStore(dataDirectory: dir + "/data").removedLeftoverUploads == [])
        upload.release()
        #expect(try ContentStore(dataDirectory: dir + "/data").removedLeftoverUploads == [upload.path])
    }

    @Test("publishing: newer versions only, identical bytes are a no-op, anything else conflicts; lies are refused", arguments: Backend.allCases)
    func publishing(backend: Backend) async throws {
        let sample = try SampleProduct()
        defer { sample.remove() }
        let (dir, content, id) = (sample.dir, sample.content, sample.id)
        func pack(_ version: String, _ out: String) throws -> PackResult { try sample.pack(version, into: out) }
        let v1 = try pack("1.0", "a"), v2 = try pack("1.2", "a")
        let store = try await openStore(dir + "/data", databaseURL: try await backend.freshURL())
        guard case .published = try await store.publish(archiveAt: v1.archivePath, manifest: v1.manifest) else { Issue.record("not published"); return }
        guard case .unchanged = try await store.publish(archiveAt: v1.archivePath) else { Issue.record("republish was not a no-op"); return }
        guard case .published = try await store.publish(archiveAt: v2.archivePath) else { Issue.record("1.2 not published"); return }
        #expect(try await store.versions(productId: id.rawValue).map(\.contentVersion) == ["1.2", "1.0"])
        #expect(FileManager.default.fileExists(atPath: store.archivePath(sha256: v1.manifest.archiveSHA256)))

        let older = try pack("1.1", "b")
        let conflict = try await #require(throws: CatalogError.self) { try await store.publish(archiveAt: older.archivePath) }
        #expect(conflict.code == .conflict)
        #expect(conflict.message.contains("not newer than the latest published version 1.2"))

        try Data("changed\n".utf8).write(to: URL(fileURLWithPath: content + "/level.json"))
        let changed = try pack("1.2", "c")
        let immutable = try await #require(throws: CatalogError.self) { try await store.publish(archiveAt: changed.archivePath) }
        #expect(immutable.code == .conflict)

        var lying = changed.manifest
        lying.entries[1].sha256 = String(repeating: "0", count: 64)
        let liar = try await #require(throws: CatalogError.self) { try await store.publish(archiveAt: changed.archivePath, manifest: lying) }
        #expect(liar.code == .invalidArchive)
        try Data("not a zip".utf8).write(to: URL(fileURLWithPath: dir + "/junk.zip"))
        #expect((try? await store.publish(archiveAt: dir + "/junk.zip")) == nil)
        // Refused uploads leave no files in the store: two archives, each with the manifest computed from it.
        let stored = try FileManager.default.contentsOfDirectory(atPath: dir + "/data/archives")
        #expect(stored.filter { $0.hasSuffix(".zip") }.count == 2)
        #expect(stored.filter { $0.hasSuffix(".manifest.json") }.count == 2)
        #expect(stored.count == 4)

        // Rollouts and rollbacks change the row, and only an existing one.
        let staged = try await store.setRollout(productId: id.rawValue, contentVersion: "1.2", percent: 30)
        #expect(staged.rolloutPercent == 30 && staged.rolledBackAt == nil)
        let rolledBack = try await store.rollBack(productId: id.rawValue, contentVersion: "1.2")
        #expect(rolledBack.rolledBackAt != nil)
        let listed = try #require(try await store.catalog().first?.versions.first)
        #expect(listed.contentVersion == "1.2" && listed.rolloutPercent == 30 && listed.rolledBackAt != nil)
        let missing = try await #require(throws: CatalogError.self) { try await store.rollBack(productId: id.rawValue, contentVersion: "9.9") }
        #expect(missing.code == .notFound)

        // 1.0 is the last version served to every purchase: rolling it back, or staging it
        // narrower while 1.2 is rolled back, would leave buyers with no content, and is refused
        // unless asked for on purpose.
        let last = try await #require(throws: CatalogError.self) { try await store.rollBack(productId: id.rawValue, contentVersion: "1.0") }
        #expect(last.code == .conflict && last.message.contains("would leave 100% of its purchases with no version"), "\(last.message)")
        let narrowed = try await #require(throws: CatalogError.self) {
            try await store.setRollout(productId: id.rawValue, contentVersion: "1.0", percent: 40)
        }
        #expect(narrowed.code == .conflict && narrowed.message.contains("would leave 60% of its purchases"), "\(narrowed.message)")
        let unchanged = try await store.versions(productId: id.rawValue)
        #expect(unchanged.last?.rolloutPercent == nil, "a refused change changed the row")
        // With 1.2 served to every purchase again, 1.0 may go.
        _ = try await store.setRollout(productId: id.rawValue, contentVersion: "1.2", percent: 100)
        let first = try await store.rollBack(productId: id.rawValue, contentVersion: "1.0")
        #expect(first.rolledBackAt != nil)
        let gone = try await store.rollBack(productId: id.rawValue, contentVersion: "1.2", allowingUnserved: true)
        let remaining = try await store.versions(productId: id.rawValue)
        #expect(gone.rolledBackAt != nil && ContentStore.servedShare(remaining) == 0)
        await store.database.close()
    }

    @Test("removing: only a rolled-back version; its files go, its number stays taken; other replicas' copies go on their next read", arguments: Backend.allCases)
    func removing(backend: Backend) async throws {
        let sample = try SampleProduct()
        defer { sample.remove() }
        let (dir, id) = (sample.dir, sample.id)
        func pack(_ version: String) throws -> PackResult { try sample.pack(version, into: "out") }
        let v1 = try pack("1.0"), v2 = try pack("1.1")
        let url = try await backend.freshURL()
        let store = try await openStore(dir + "/data", databaseURL: url)
        _ = try await store.publish(archiveAt: v1.archivePath)
        _ = try await store.publish(archiveAt: v2.archivePath)
        let files = [store.archivePath(sha256: v2.manifest.archiveSHA256), store.manifestPath(sha256: v2.manifest.archiveSHA256)]
        #expect(files.allSatisfy { FileManager.default.fileExists(atPath: $0) })

        // A version served to purchases is refused, and nothing changes.
        let served = try await #require(throws: CatalogError.self) { try await store.remove(productId: id.rawValue, contentVersion: "1.1") }
        #expect(served.code == .conflict && served.message.contains("is not rolled back (it can be granted to every purchase): roll it back first"), "\(served.message)")
        #expect(try await store.versions(productId: id.rawValue).allSatisfy { $0.removedAt == nil })
        #expect(files.allSatisfy { FileManager.default.fileExists(atPath: $0) })

        _ = try await store.rollBack(productId: id.rawValue, contentVersion: "1.1")
        let removal = try await store.remove(productId: id.rawValue, contentVersion: "1.1")
        #expect(removal.version.removedAt != nil && removal.freedBytes >= Int64(v2.manifest.archiveSize))
        #expect(files.allSatisfy { !FileManager.default.fileExists(atPath: $0) })
        #expect(FileManager.default.fileExists(atPath: store.archivePath(sha256: v1.manifest.archiveSHA256)), "1.0's archive went too")
        #expect(await store.readinessProblems().isEmpty, "a removed version counts as a missing archive")
        // Removing again only retries the files; an unknown version is named.
        #expect(try await store.remove(productId: id.rawValue, contentVersion: "1.1").freedBytes == 0)
        let unknown = try await #require(throws: CatalogError.self) { try await store.remove(productId: id.rawValue, contentVersion: "9.9") }
        #expect(unknown.code == .notFound)

        // Its number stays taken: not served again, not published again, with these bytes or others.
        let promote = try await #require(throws: CatalogError.self) { try await store.setRollout(productId: id.rawValue, contentVersion: "1.1", percent: 100) }
        #expect(promote.code == .conflict && promote.message.contains("was removed"), "\(promote.message)")
        let again = try await #require(throws: CatalogError.self) { try await store.publish(archiveAt: v2.archivePath) }
        #expect(again.code == .conflict && again.message.contains("a removed version is never published again"), "\(again.message)")
        #expect(ContentStore.version(forTransaction: "2000000000000001", productId: id.rawValue, among: try await store.versions(productId: id.rawValue))?.contentVersion == "1.0")
        await store.database.close()

        // Reopened (the removal is durable), by a replica whose archive folder holds its own
        // copies: the removed version's go, the live version's and an archive the catalog does
        // not know stay.
        let replica = dir + "/replica-archives"
        try FileManager.default.createDirectory(atPath: replica, withIntermediateDirectories: true)
        let stranger = replica + "/" + String(repeating: "ab", count: 32) + ".zip"
        for (from, to) in [(v1.archivePath, v1.manifest.archiveSHA256 + ".zip"), (v2.archivePath, v2.manifest.archiveSHA256 + ".zip"), (v1.archivePath, String(repeating: "ab", count: 32) + ".zip")] {
            try FileManager.default.copyItem(atPath: from, toPath: replica + "/" + to)
        }
        let other: ContentStore
        if let url {
            other = try ContentStore(dataDirectory: dir + "/replica", archivesDirectory: replica, database: try await testCatalog(url))
        } else {
            other = try ContentStore(dataDirectory: dir + "/data", archivesDirectory: replica)
        }
        let versions = try await other.database.versions(productId: nil)
        #expect(versions.first { $0.contentVersion == "1.1" }?.removedAt != nil)
        #expect(await other.deleteArchives(ContentStore.removedArchives(versions)) == Int64(v2.manifest.archiveSize))
        #expect(!FileManager.default.fileExists(atPath: other.archivePath(sha256: v2.manifest.archiveSHA256)))
        #expect(FileManager.default.fileExists(atPath: other.archivePath(sha256: v1.manifest.archiveSHA256)))
        #expect(FileManager.default.fileExists(atPath: stranger))
        await other.database.close()
    }

    @Test("notifications apply once per UUID; REFUND_REVERSED restores access; grants are recorded once per transaction", arguments: Backend.allCases)
    func ledger(backend: Backend) async throws {
        let dir = FileManager.default.temporaryDirectory.path + "/ledger-" + UUID().uuidString
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let url = try await backend.freshURL()
        let store = try await openStore(dir, databaseURL: url)
        func refund(_ uuid: String, _ type: String, revoke: Bool) async throws -> NotificationOutcome {
            try await store.apply(notificationUUID: uuid, type: type, subtype: nil, transactionId: "t1", revoke: revoke, revokedAt: Date(), signedPayload: "x")
        }
        #expect(try await refund("n1", "REFUND", revoke: true) == .applied)
        #expect(try await refund("n1", "REFUND", revoke: true) == .duplicate)
        #expect(try await store.isRevoked(transactionId: "t1"))
        #expect(try await store.revokedTransactionIds() == ["t1"])
        #expect(try await refund("n2", "REFUND_REVERSED", revoke: false) == .applied)
        #expect(try await !store.isRevoked(transactionId: "t1"))
        // A replay of the old REFUND changes nothing.
        #expect(try await refund("n1", "REFUND", revoke: true) == .duplicate)
        #expect(try await !store.isRevoked(transactionId: "t1"))
        #expect(try await store.notificationCount() == 2)
        try await store.recordGrant(transactionId: "t1", originalTransactionId: "t1", productId: "p", environment: "Sandbox")
        try await store.recordGrant(transactionId: "t1", originalTransactionId: "t1", productId: "p", environment: "Sandbox")
        try await store.recordGrant(transactionId: "t2", originalTransactionId: "t1", productId: "p", environment: nil)
        #expect(try await store.database.grantCount() == 2)
        await store.database.close()
        // State survives reopening.
        let reopened = try await openStore(dir, databaseURL: url)
        #expect(try await reopened.notificationCount() == 2)
        #expect(try await reopened.database.grantCount() == 2)
        await reopened.database.close()
    }

    @Test(
        "the revocation ledger read from where the reader stands: unchanged, no read; revocations since, only those; a restore, the whole set; anyone's writes count",
        arguments: Backend.allCases)
    func revocationCounter(backend: Backend) async throws {
        let dir = FileManager.default.temporaryDirectory.path + "/counter-" + UUID().uuidString
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let url = try await backend.freshURL()
        let store = try await openStore(dir, databaseURL: url)
        func sql(_ statement: String) async throws {
            switch backend {
            case .sqlite:
                let wrote = try run("sqlite3", [dir + "/catalog.sqlite", statement])
                #expect(wrote.status == 0, "\(wrote.stderr)")
            case .postgres:
                _ = try await PostgresServer.shared().psql(try #require(url), statement)
            }
        }
        let (id, revokedAt) = backend == .sqlite ? ("transactionId", "revokedAt") : ("transaction_id", "revoked_at")
        let empty = try #require(try await store.revocations(changedSince: nil))
        #expect(empty.transactionIds.isEmpty && empty.isComplete)
        #expect(try await store.revocations(changedSince: empty.position) == nil)

        _ = try await store.apply(notificationUUID: "n1", type: "REFUND", subtype: nil, transactionId: "t1", revoke: true, revokedAt: Date(), signedPayload: "x")
        let one = try #require(try await store.revocations(changedSince: empty.position))
        #expect(one.transactionIds == ["t1"] && !one.isComplete && one.position.version > empty.position.version)
        #expect(try await store.revocations(changedSince: one.position) == nil)
        // Asked from an older position, everything revoked since it; from none, the whole set.
        _ = try await store.apply(notificationUUID: "n1b", type: "REFUND", subtype: nil, transactionId: "t2", revoke: true, revokedAt: Date(), signedPayload: "x")
        let two = try #require(try await store.revocations(changedSince: one.position))
        #expect(two.transactionIds == ["t2"] && !two.isComplete)
        #expect(try await store.revocations(changedSince: empty.position)?.transactionIds == ["t1", "t2"])
        let whole = try #require(try await store.revocations(changedSince: nil))
        #expect(whole.transactionIds == ["t1", "t2"] && whole.isComplete && whole.position == two.position)
        // A notification that touches no revocation (a renewal) leaves the counters alone.
        _ = try await store.apply(notificationUUID: "n2", type: "DID_RENEW", subtype: nil, transactionId: "t3", revoke: nil, revokedAt: Date(), signedPayload: "x")
        #expect(try await store.revocations(changedSince: two.position) == nil)
        // A restore cannot be read as rows written since: the whole set.
        _ = try await store.apply(notificationUUID: "n3", type: "REFUND_REVERSED", subtype: nil, transactionId: "t1", revoke: false, revokedAt: Date(), signedPayload: "x")
        let restored = try #require(try await store.revocations(changedSince: two.position))
        #expect(restored.transactionIds == ["t2"] && restored.isComplete && restored.position.version > two.position.version)
        #expect(restored.position.removals > two.position.removals)

        // A writer that knows nothing of the counters (an operator's SQL, an older replica) moves
        // them too, and its rows are stamped: an insert is read as one, a delete sends back to the whole set.
        try await sql("INSERT INTO revocations (\(id), \(revokedAt)) VALUES ('t9', '2026-01-01 00:00:00.000')")
        let external = try #require(try await store.revocations(changedSince: restored.position))
        #expect(external.transactionIds == ["t9"] && !external.isComplete)
        #expect(try await store.revocations(changedSince: external.position) == nil)
        try await sql("UPDATE revocations SET \(revokedAt) = '2026-02-01 00:00:00.000' WHERE \(id) = 't2'")
        let updated = try #require(try await store.revocations(changedSince: external.position))
        #expect(updated.transactionIds == ["t2"] && !updated.isComplete)
        try await sql("DELETE FROM revocations WHERE \(id) = 't9'")
        let deleted = try #require(try await store.revocations(changedSince: updated.position))
        #expect(deleted.transactionIds == ["t2"] && deleted.isComplete)

        if backend == .sqlite {
            // A ledger written before revocations were stamped (an upgraded catalog): its rows
            // have no stamp, so only a whole read finds them; the next revocation is read alone.
            try await sql("UPDATE revocations SET changed = NULL")
            let upgraded = try #require(try await store.revocations(changedSince: nil))
            #expect(upgraded.transactionIds == ["t2"])
            _ = try await store.apply(notificationUUID: "n4", type: "REVOKE", subtype: nil, transactionId: "t4", revoke: true, revokedAt: Date(), signedPayload: "x")
            #expect(try await store.revocations(changedSince: upgraded.position)?.transactionIds == ["t4"])
        }
        await store.database.close()
    }

    @Test(
        "a replica that reads only what was revoked since its last look, while two others write at once, ends with the whole ledger",
        arguments: Backend.allCases)
    func revocationsReadFromPositionUnderConcurrentWriters(backend: Backend) async throws {
        let dir = FileManager.default.temporaryDirectory.path + "/stamps-" + UUID().uuidString
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let url = try await backend.freshURL()
        let reader = try await openStore(dir, databaseURL: url)
        // Two writers as two replicas would be (on PostgreSQL each with its own connections),
        // each with several transactions in flight: a stamp that did not follow commit order
        // would let the reader step past a row committed after it looked.
        let writers = [try await openStore(dir, databaseURL: url), try await openStore(dir, databaseURL: url)]
        let finished = WritersFinished()
        let writing = Task {
            defer { finished.value.withLock { $0 = true } }
            try await withThrowingTaskGroup(of: Void.self) { group in
                for (w, writer) in writers.enumerated() {
                    for lane in 0..<4 {
                        group.addTask {
                            for i in 0..<40 {
                                let id = "w\(w)-\(lane)-\(i)"
                                _ = try await writer.apply(
                                    notificationUUID: "n-" + id, type: "REFUND", subtype: nil, transactionId: id, revoke: true, revokedAt: Date(), signedPayload: "x")
                                // Now and then a refund reversed: the reader goes back to the whole set.
                                if lane == 0, i % 20 == 19 {
                                    let earlier = "w\(w)-\(lane)-\(i - 7)"
                                    _ = try await writer.apply(
                                        notificationUUID: "r-" + earlier, type: "REFUND_REVERSED", subtype: nil, transactionId: earlier, revoke: false,
                                        revokedAt: Date(), signedPayload: "x")
                                }
                            }
                        }
                    }
                }
                try await group.waitForAll()
            }
        }
        var held = Set<String>(), position: RevocationPosition? = nil, incremental = 0
        func look() async throws {
            guard let snapshot = try await reader.revocations(changedSince: position) else { return }
            if snapshot.isComplete {
                held = snapshot.transactionIds
            } else {
                held.formUnion(snapshot.transactionIds)
                incremental += 1
            }
            position = snapshot.position
        }
        while !finished.value.withLock({ $0 }) { try await look() }
        try await writing.value
        try await look()
        let whole = try #require(try await reader.revocations(changedSince: nil))
        // 2 writers x 4 lanes x 40 refunds, 2 of each writer's first lane reversed.
        let expected = 2 * 4 * 40 - 2 * 2
        #expect(whole.transactionIds.count == expected)
        let missed = whole.transactionIds.subtracting(held), extra = held.subtracting(whole.transactionIds)
        #expect(missed.isEmpty && extra.isEmpty, "missed \(missed.sorted()), kept \(extra.sorted())")
        #expect(incremental > 0)
        for writer in writers { await writer.database.close() }
        await reader.database.close()
    }

    @Test("old notifications are pruned in batches by age; newer ones and the revocations they made stay", arguments: Backend.allCases)
    func pruneNotifications(backend: Backend) async throws {
        let dir = FileManager.default.temporaryDirectory.path + "/prune-" + UUID().uuidString
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let store = try await openStore(dir, databaseURL: try await backend.freshURL())
        let now = Date()
        let old = now.addingTimeInterval(-500 * 86_400)
        for i in 0..<7 {
            _ = try await store.apply(
                notificationUUID: "old-\(i)", type: "REFUND", subtype: nil, transactionId: "t\(i)", revoke: true, revokedAt: old, signedPayload: "x", now: old)
        }
        _ = try await store.apply(notificationUUID: "new", type: "DID_RENEW", subtype: nil, transactionId: "t9", revoke: nil, revokedAt: now, signedPayload: "x", now: now)
        #expect(try await store.pruneNotifications(receivedBefore: now.addingTimeInterval(-400 * 86_400), batch: 3) == 7)
        #expect(try await store.notificationCount() == 1)
        #expect(try await store.revokedTransactionIds().count == 7)
        #expect(try await store.pruneNotifications(receivedBefore: now.addingTimeInterval(-400 * 86_400)) == 0)
        await store.database.close()
    }

    @Test(
        "readiness: a ready verdict is kept while the catalog is unchanged, the newest archive looked at each time; a change checks every archive; a not-ready verdict is kept while the archive it named first is still missing",
        arguments: Backend.allCases)
    func readinessKept(backend: Backend) async throws {
        let sample = try SampleProduct()
        defer { sample.remove() }
        let store = try await openStore(sample.dir + "/data", databaseURL: try await backend.freshURL())
        let v1 = try sample.pack("1.0", into: "v1"), v2 = try sample.pack("1.1", into: "v2")
        _ = try await store.publish(archiveAt: v1.archivePath, manifest: v1.manifest)
        _ = try await store.publish(archiveAt: v2.archivePath, manifest: v2.manifest)
        #expect(await store.readinessProblems().isEmpty)

        // An older archive deleted by hand: not looked for until the catalog changes (or 10 s pass).
        let older = store.archivePath(sha256: v1.manifest.archiveSHA256)
        try FileManager.default.moveItem(atPath: older, toPath: older + ".away")
        #expect(await store.readinessProblems().isEmpty)
        _ = try await store.setRollout(productId: "com.example.levels1", contentVersion: "1.1", percent: 100)
        #expect(await store.readinessProblems().first?.contains(v1.manifest.archiveSHA256) == true)
        try FileManager.default.moveItem(atPath: older + ".away", toPath: older)
        #expect(await store.readinessProblems().isEmpty)

        // The newest one, as a lost mount takes them all: seen at once.
        let newest = store.archivePath(sha256: v2.manifest.archiveSHA256)
        try FileManager.default.moveItem(atPath: newest, toPath: newest + ".away")
        #expect(await store.readinessProblems().first?.contains(v2.manifest.archiveSHA256) == true)
        // Ready for downloads asks the same of the archives; with the database answering it
        // reports no trouble.
        let downloads = await store.readiness(for: .downloads)
        #expect(!downloads.isReady && downloads.problems.first?.contains(v2.manifest.archiveSHA256) == true && downloads.databaseTrouble == nil)
        try FileManager.default.moveItem(atPath: newest + ".away", toPath: newest)
        #expect(await store.readiness(for: .downloads) == .init(problems: [], databaseTrouble: nil))

        // A "not ready" is kept while the archive it named first is still missing, that one
        // looked at each time: another lost meanwhile is not looked for (a balancer probing a
        // replica it took out would otherwise have it read the whole catalog each time).
        try FileManager.default.moveItem(atPath: newest, toPath: newest + ".away")
        let unready = await store.readinessProblems()
        #expect(unready.first?.hasPrefix("1 published version(s)") == true && unready.first?.contains(v2.manifest.archiveSHA256) == true, "\(unready)")
        try FileManager.default.moveItem(atPath: older, toPath: older + ".away")
        #expect(await store.readinessProblems() == unready)
        // Once it is back, the next answer looks at every archive; once all are, ready at once.
        try FileManager.default.moveItem(atPath: newest + ".away", toPath: newest)
        let next = await store.readinessProblems()
        #expect(next.first?.hasPrefix("1 published version(s)") == true && next.first?.contains(v1.manifest.archiveSHA256) == true, "\(next)")
        try FileManager.default.moveItem(atPath: older + ".away", toPath: older)
        #expect(await store.readinessProblems().isEmpty)
        await store.database.close()
    }
}

/// Set once the writers of a concurrency test are done.
final class WritersFinished: Sendable {
    let value = Mutex(false)
}

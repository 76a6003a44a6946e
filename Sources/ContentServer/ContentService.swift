import AppStoreServerClient
import AsyncHTTPClient
import CatalogPostgres
import ContentArchive
import ContentCatalog
import ContentDelivery
import Crypto
import DownloadGrants
import DurableFiles
import Foundation
import IAPProtocol
import Logging
import NIOCore
import NIOHTTP1
import PurchaseVerification
import ReceiptVerification
import Synchronization

/// The server's shared state: catalog and ledger, verifier, grant keys, and the in-memory views
/// the content path needs to answer without blocking (revoked transactions, open archives).
final class ContentService: ContentResolver, Sendable {
    let configuration: ServerConfiguration
    let store: ContentStore
    let verifier: SignedDataVerifier
    let receiptChecker: ReceiptChecker
    /// Read again when the file changes (``reloadGrantKeys()``): keys rotate without a restart.
    let grantKeys: GrantKeys
    /// Archives this replica lacks, fetched from the replica that received them.
    let peers: PeerArchives
    /// The server's own requests (other replicas, verifyReceipt); shut down with the server.
    let outbound: HTTPClient
    let metrics = ServerMetrics()
    /// The port actually bound (differs from the configuration's when that is 0).
    let boundPort = Mutex(0)
    private let revoked: Mutex<Revocations>
    /// Orders refreshes: the one that started last decides, whichever read finishes first.
    private let refreshTickets = Atomic<UInt64>(0)

    /// The revoked transaction ids in memory; `position` is the ledger's counters they were read
    /// at (``RevocationSnapshot``), so an unchanged ledger is not read again and a changed one
    /// only from there.
    struct Revocations {
        var ids: RevokedTransactions
        var position: RevocationPosition?
        var ticket: UInt64 = 0
    }
    /// Changes with every change to `revoked` and when files are closed: connections reuse
    /// their last resolution only while it holds (`ContentResolver.reuseStamp`).
    private let stamp = Atomic<UInt64>(0)
    private struct FileKey: Hashable {
        let sha256: String
        let eventLoop: ObjectIdentifier
        let manifest: Bool
    }

    /// Each with the loop it was opened for, which alone may close it (see ``forgetFiles(sha256s:)``),
    /// and the file it is (device, inode), to tell when the path names another (a repair).
    private let openFiles = Mutex<[FileKey: (file: ServedFile, loop: any EventLoop, identity: FileIdentity)]>([:])
    /// What the catalog says each published archive is, by SHA-256: its size and its manifest's
    /// digest, to refuse a damaged file rather than serve it under the published ETag (which an
    /// edge would cache for a month). Read with the catalog (``noteCatalog(_:)``).
    private let published = Mutex<[String: (size: Int64, manifestSHA256: String?, origin: String?)]>([:])
    /// When each damaged file was last logged: once a minute, not once per request.
    private let damageLogged = Mutex<[String: ContinuousClock.Instant]>([:])
    /// Tokens whose HMAC was checked, with their grants. A download sends the same token with
    /// every range request, and checking it again was a tenth of the server's CPU for 4 KiB
    /// ranges. Only exact tokens that verified are kept, and expiry and revocation are still
    /// checked on every request. The lookup gives no timing oracle on a valid token's bytes:
    /// Swift's hashing is seeded per process, so a forged token lands in another bucket and is
    /// never compared with a real one. Bounded: emptied when full.
    private let verifiedGrants = Mutex<[String: Grant]>([:])
    private static let verifiedGrantsLimit = 4096

    init(configuration: ServerConfiguration) async throws {
        self.configuration = configuration
        // The files are read before anything else, so a wrong --ca-file is said first; the
        // client itself is made after the last step that can fail, so none is left unclosed.
        let trust = try OutboundHTTP.trust(configuration.additionalTrustRootFiles)
        store = try await ContentStore.open(
            dataDirectory: configuration.dataDirectory, archivesDirectory: configuration.archivesDirectory, databaseURL: configuration.databaseURL)
        if let first = store.removedLeftoverUploads.first {
            Logger(label: "iap-server.store").notice(
                "removed \(store.removedLeftoverUploads.count) unfinished upload(s) an earlier run had left, \(first) first")
        }
        verifier = SignedDataVerifier(
            configuration: .init(
                bundles: configuration.bundles, trustRoots: configuration.trustRoots,
                environments: configuration.environments))
        // Receipts chain to Apple Inc. Root (built in) or to an extra root (the sandbox's
        // receipt-root.cer); Apple Root CA - G3 signs StoreKit 2 data only.
        let localReceipts = try ReceiptVerifier(
            bundles: configuration.bundles, trustRoots: configuration.trustRoots.filter { $0 != AppleRoots.rootCAG3 },
            environments: configuration.environments)
        grantKeys = try GrantKeys(path: configuration.grantKeysPath)
        let snapshot = try await store.revocations(changedSince: nil)
        revoked = Mutex(Revocations(ids: RevokedTransactions(snapshot?.transactionIds ?? []), position: snapshot?.position))
        outbound = OutboundHTTP.client(trust)
        receiptChecker = ReceiptChecker(
            mode: configuration.receiptVerification,
            local: localReceipts,
            apple: VerifyReceiptClient(
                productionURL: configuration.verifyReceiptURL, sandboxURL: configuration.verifyReceiptSandboxURL,
                sharedSecret: configuration.receiptSharedSecret, timeout: configuration.verifyReceiptTimeout, httpClient: outbound),
            bundles: configuration.bundles, environments: configuration.environments)
        peers = PeerArchives(store: store, grants: grantKeys, ownURL: configuration.advertiseURL, http: outbound, logger: Logger(label: "iap-server.peers"))
        noteCatalog(try await store.database.versions(productId: nil))
    }

    /// Takes in one version as read for a grant or a publish, before the next catalog read.
    func noteVersion(_ version: PublishedVersion) {
        guard version.removedAt == nil else { return }
        published.withLock { $0[version.sha256] = (version.size, version.manifestSHA256, version.originURL) }
    }

    /// Takes in the catalog as read (at start, and by each catch-up that reads it).
    func noteCatalog(_ versions: [PublishedVersion]) {
        let entries = versions.filter { $0.removedAt == nil }.map { ($0.sha256, (size: $0.size, manifestSHA256: $0.manifestSHA256, origin: $0.originURL)) }
        published.withLock { $0 = Dictionary(entries, uniquingKeysWith: { first, _ in first }) }
    }

    /// Whether a transaction's access was cut (in memory, refreshed from the ledger).
    func isRevoked(_ transactionId: String) -> Bool { revoked.withLock { $0.ids.contains(transactionId) } }

    func markRevoked(_ transactionId: String, _ value: Bool) {
        revoked.withLock { state in
            if value { state.ids.insert(transactionId) } else { state.ids.remove(transactionId) }
            // Inside the lock: a request that reads the new stamp sees the new set.
            stamp.add(1, ordering: .sequentiallyConsistent)
        }
    }

    /// For grants: the in-memory set, then the ledger itself, so a revocation written by
    /// `iap-server reconcile` or another replica refuses a new grant at once, not at the next
    /// refresh; one found there is added to the set, so the content path refuses at once too.
    func isRevokedInLedger(_ transactionId: String) async throws(CatalogError) -> Bool {
        if isRevoked(transactionId) { return true }
        guard try await store.isRevoked(transactionId: transactionId) else { return false }
        markRevoked(transactionId, true)
        return true
    }

    /// Picks up revocations written by other replicas (sharing the data folder or the database):
    /// a look at the ledger's counters, then the revocations written since the last look, or the
    /// whole set when one was restored since or `force` says (announcements may have been missed).
    func refreshRevocations(force: Bool = false) async throws {
        let ticket = refreshTickets.add(1, ordering: .sequentiallyConsistent).newValue
        let known = force ? nil : revoked.withLock { $0.position }
        guard let snapshot = try await store.revocations(changedSince: known) else { return }
        // Outside the lock, which every content request takes.
        let complete = snapshot.isComplete ? RevokedTransactions(snapshot.transactionIds) : nil
        revoked.withLock { state in
            // A read that began before another finished later must not undo what that one read,
            // and what was revoked since `known` adds only to the set read at `known`: a set read
            // since covers it already (or a restore after it).
            guard ticket > state.ticket, complete != nil || state.position == known else { return }
            // A whole set read (at a restore, rare) counts as a change without comparing a
            // million ids under this lock: connections resolve their next request afresh.
            var changed = complete != nil
            if let complete {
                state.ids = complete
            } else {
                // In place: a copy of a million ids is what the read from `known` saves.
                for id in snapshot.transactionIds where state.ids.insert(id) { changed = true }
            }
            if changed { stamp.add(1, ordering: .sequentiallyConsistent) }
            state.position = snapshot.position
            state.ticket = ticket
        }
    }

    /// Reads the grant key file again if it changed. Tokens checked with the old keys are
    /// forgotten, so a retired key's grants are refused from the next request on; a file that
    /// cannot be used leaves the keys in force, and says why once.
    func reloadGrantKeys() {
        let log = Logger(label: "iap-server.grants")
        switch grantKeys.reloadIfChanged() {
        case nil:
            return
        case .success(let ring):
            verifiedGrants.withLock { cache in
                cache.removeAll()
                stamp.add(1, ordering: .sequentiallyConsistent)
            }
            log.notice(
                "read the grant keys again from \(grantKeys.path): new grants are signed with '\(ring.activeKeyId)'; grants signed with \(ring.keyIds.map { "'\($0)'" }.joined(separator: ", ")) are accepted"
            )
        case .failure(let error):
            log.error("\(error.message); the grant keys read before stay in force")
        }
    }

    /// Applies what the database announces (PostgreSQL: at once, as other replicas commit).
    func apply(_ change: RevocationChange) {
        switch change {
        // In the order the database sent them: a refund and its reversal must not swap.
        case .revoked(let id): markRevoked(id, true)
        case .restored(let id): markRevoked(id, false)
        case .published: Task { await catchUpArchives() }
        case .resynchronize:
            Task {
                try? await refreshRevocations(force: true)
                await catchUpArchives(force: true)
            }
        }
    }

    // MARK: ContentResolver (runs on the event loop)

    var reuseStamp: UInt64? { stamp.load(ordering: .sequentiallyConsistent) }

    func resolve(key token: Substring, name: Substring, on eventLoop: any EventLoop) -> ContentResolution {
        let now = Date()
        let grant: Grant
        switch check(token: token, now: now) {
        case .failure(let refusal): return .refuse(refusal.status, refusal.error)
        case .success(let valid): grant = valid
        }
        // The manifest is served under the same grant as its archive, for delta updates.
        let manifest = name.hasSuffix(Route.manifestSuffix)
        let what = manifest ? "manifest" : "archive"
        let file: ServedFile
        switch openFile(sha256: grant.sha256, manifest: manifest, for: eventLoop) {
        case .missing:
            // Another replica's upload not fetched yet: its origin serves meanwhile (PeerArchives).
            if let origin = foreignOrigin(grant.sha256) { return .redirect(origin + Route.contentPrefix + token + "/" + name) }
            return .refuse(.notFound, APIError(.noContent, "the \(what) for \(grant.productId) \(grant.contentVersion) is not on this server"))
        case .damaged(let problem):
            // Other loops may hold the file open from before: they stop serving it now, not at the next beat.
            forgetFiles(sha256s: [grant.sha256])
            let origin = foreignOrigin(grant.sha256)
            if logDamage(grant, problem: problem), origin != nil {
                // This replica's copy of another's upload is fetched again now, not at the next beat.
                Task { await catchUpArchives(force: true) }
            }
            if let origin { return .redirect(origin + Route.contentPrefix + token + "/" + name) }
            metrics.damagedArchiveRefused()
            return .refuse(
                .serviceUnavailable,
                APIError(
                    .archiveDamaged,
                    "the \(what) for \(grant.productId) \(grant.contentVersion) is damaged on this server, and the operator is told: try again later"))
        case .file(let opened):
            file = opened
        }
        return .file(
            file, fileName: "\(grant.productId)-\(grant.contentVersion)" + (manifest ? Route.manifestSuffix : ".zip"),
            freshFor: grant.expiresAt - Int64(now.timeIntervalSince1970))
    }

    /// A content request's refusal: its status and error body.
    struct GrantRefusal: Error {
        let status: HTTPResponseStatus
        let error: APIError
    }

    /// Whether a grant token lets its holder download now: signed by a key of the ring, not
    /// expired, its transaction not revoked. Runs on the event loop for every content request
    /// and for every grant check an edge asks.
    func check(token: Substring, now: Date) -> Result<Grant, GrantRefusal> {
        let key = String(token)
        let grant: Grant
        if let known = verifiedGrants.withLock({ $0[key] }), Int64(now.timeIntervalSince1970) < known.expiresAt {
            grant = known
        } else {
            let (ring, generation) = grantKeys.current
            switch ring.verify(token, now: now) {
            case .failure(let error):
                return .failure(GrantRefusal(status: .unauthorized, error: APIError(APIErrorCode(rawValue: error.code), error.description)))
            case .success(let value):
                grant = value
            }
            verifiedGrants.withLock { cache in
                // Checked by a ring read again since (a key retired): not kept.
                guard grantKeys.current.generation == generation else { return }
                if cache.count >= Self.verifiedGrantsLimit { cache.removeAll(keepingCapacity: true) }
                cache[key] = grant
            }
        }
        if isRevoked(grant.transactionId) {
            return .failure(
                GrantRefusal(
                    status: .forbidden,
                    error: APIError(.revoked, "transaction \(grant.transactionId) was refunded or revoked: its content can no longer be downloaded")))
        }
        return .success(grant)
    }

    private enum OpenedFile {
        case file(ServedFile)
        case missing
        /// On disk, but not what was published: what differs.
        case damaged(String)
    }

    /// The replica that received the archive, when it is not this one: where this replica
    /// fetches its copy from (a replica with an archive folder of its own).
    private func foreignOrigin(_ sha256: String) -> String? {
        published.withLock { $0[sha256]?.origin }.flatMap { $0 == configuration.advertiseURL ? nil : $0 }
    }

    /// Logs a damaged file at most once a minute per archive, with what differs and the fix;
    /// whether it logged.
    private func logDamage(_ grant: Grant, problem: String) -> Bool {
        let now = ContinuousClock.now
        let due = damageLogged.withLock { logged in
            if let last = logged[grant.sha256], now - last < .seconds(60) { return false }
            logged[grant.sha256] = now
            return true
        }
        guard due else { return false }
        Logger(label: "iap-server.store").error(
            "refusing to serve a damaged file: \(problem); publish the version's archive again to repair it (iap-server check lists every damaged version)",
            metadata: ["productId": "\(grant.productId)", "contentVersion": "\(grant.contentVersion)", "sha256": "\(grant.sha256)"])
        return true
    }

    /// Archives are immutable and named by hash, so each is opened once per event loop and the
    /// handle kept (a handle shared between loops fails with EBUSY under concurrent transfers).
    /// A manifest's ETag is its own SHA-256, computed once when it is opened (it is small). A
    /// file whose size (an archive) or digest (a manifest) is not the published one is damaged:
    /// served, it would fail every download's check under the published ETag.
    private func openFile(sha256: String, manifest: Bool, for eventLoop: any EventLoop) -> OpenedFile {
        let key = FileKey(sha256: sha256, eventLoop: ObjectIdentifier(eventLoop), manifest: manifest)
        if let file = openFiles.withLock({ $0[key]?.file }) { return .file(file) }
        guard Hex.isSHA256(sha256.utf8) else { return .missing }
        let path = manifest ? store.manifestPath(sha256: sha256) : store.archivePath(sha256: sha256)
        var info = stat()
        var etag = sha256
        let expected = published.withLock { $0[sha256] }
        // There but not readable (its permissions): the operator's to fix, not gone, which a
        // device takes for good.
        func unreadable(_ code: Int32) -> OpenedFile {
            .damaged("\(path) cannot be read (\(errnoDescription(code))): give the server's user read access to it")
        }
        if manifest {
            guard let data = FileManager.default.contents(atPath: path) else {
                return access(path, F_OK) == 0 ? unreadable(access(path, R_OK) == 0 ? EIO : errno) : .missing
            }
            etag = Hex.encode(SHA256.hash(data: data))
            if let want = expected?.manifestSHA256, etag != want {
                return .damaged("\(path) has SHA-256 \(etag), not the published \(want)")
            }
        }
        guard stat(path, &info) == 0 else { return .missing }
        let handle: NIOFileHandle
        do {
            // FileRegion (sendfile) takes only an NIOFileHandle; NIO has no non-deprecated way to make one yet.
            handle = try NIOFileHandle(_deprecatedPath: path)
        } catch {
            return unreadable((error as? IOError)?.errnoCode ?? EIO)
        }
        if !manifest, let want = expected?.size, Int64(info.st_size) != want {
            try? handle.close()
            return .damaged("\(path) is \(info.st_size) bytes, not the \(want) published")
        }
        // Other bytes at the published size, which a read found in this very file (the periodic
        // read, or any process using the folder: `check`, a replica sharing it).
        if !manifest, let digest = store.recordedDigest(sha256: sha256, stamp: FileIdentity(info)) {
            try? handle.close()
            return .damaged("\(path) has SHA-256 \(digest), not the published \(sha256) (damaged on disk)")
        }
        let file = ServedFile(
            handle: handle, size: UInt64(info.st_size), etag: "\"\(etag)\"",
            modified: Date(timeIntervalSince1970: TimeInterval(info.st_mtim.tv_sec)),
            contentType: manifest ? "application/json" : "application/zip")
        return openFiles.withLock { files in
            if let existing = files[key] {
                try? handle.close()
                return .file(existing.file)
            }
            files[key] = (file, eventLoop, FileIdentity(info))
            return .file(file)
        }
    }

    /// Lets go of a kept file found shorter than when it was opened, so the request's second
    /// resolution opens the path afresh (and refuses or redirects, naming the damage).
    func fileCutShort(_ file: ServedFile) {
        let shas = openFiles.withLock { files in Set(files.filter { $0.value.file === file }.map(\.key.sha256)) }
        forgetFiles(sha256s: shas)
    }

    /// Closes the kept handles whose path now names another file, or none, or one of another
    /// size than published, or one another process found damaged: an archive repaired
    /// (published again, renamed over the damaged one), deleted by hand, cut short in place, or
    /// found rotten by `iap-server check` or a replica sharing the folder. The next request opens
    /// the path afresh and is served, refused or redirected by what is there. A `stat` and a
    /// look for a damage record per kept file, each beat.
    func checkKeptFiles() {
        let kept = openFiles.withLock { files in files.map { ($0.key, $0.value.identity) } }
        let sizes = published.withLock { $0 }
        var stale = Set<String>()
        for (key, identity) in kept where !stale.contains(key.sha256) {
            var info = stat()
            let path = key.manifest ? store.manifestPath(sha256: key.sha256) : store.archivePath(sha256: key.sha256)
            if stat(path, &info) != 0 || UInt64(info.st_dev) != identity.device || UInt64(info.st_ino) != identity.inode
                || (!key.manifest && sizes[key.sha256].map { $0.size != Int64(info.st_size) } ?? false)
                // Found damaged by another process's read (`check`, a replica sharing the folder).
                || (!key.manifest && store.recordedDigest(sha256: key.sha256, stamp: FileIdentity(info)) != nil)
            {
                stale.insert(key.sha256)
            }
        }
        forgetFiles(sha256s: stale)
    }

    /// One pass of the periodic read (``ServerConfiguration/archiveCheckInterval``): every
    /// published archive on this replica, one at a time. Each newly found damaged is let go of
    /// (its kept handles closed, so the next request opens it afresh and is refused), logged with
    /// the fix and counted; a replica with an archive folder of its own then fetches a good copy
    /// from the replica that received it. Stops between archives when the task is cancelled.
    func findRottenArchives() async {
        guard let versions = try? await store.database.versions(productId: nil) else { return }
        var found = false
        for version in versions where version.removedAt == nil {
            if Task.isCancelled { return }
            guard let damage = await store.findRot(in: version) else { continue }
            found = true
            forgetFiles(sha256s: [version.sha256])
            metrics.rotFound()
            let refetched = foreignOrigin(version.sha256).map { "; this replica fetches its copy again from \($0)" } ?? ""
            Logger(label: "iap-server.store").error(
                "found an archive damaged on disk: content requests for it are refused (503 archive-damaged) until it is repaired\(refetched): \(damage.message(for: version, in: store))",
                metadata: ["productId": "\(version.productId)", "contentVersion": "\(version.contentVersion)", "sha256": "\(version.sha256)"])
        }
        metrics.archiveCheckPassed()
        if found { await catchUpArchives(force: true) }
    }

    /// Brings this replica's archive folder in line with the catalog: fetches what it lacks
    /// from other replicas, deletes removed versions' archives and closes their kept handles.
    func catchUpArchives(force: Bool = false) async {
        await peers.catchUp(force: force, read: { noteCatalog($0) }, removed: { forgetFiles(sha256s: $0) })
    }

    /// Closes the kept handles of removed archives, so that their disk space is freed and no
    /// request is served from them again (new requests find no file: 404 `no-content`). Each
    /// handle is closed on its own event loop: a transfer in flight from it then fails at its
    /// next write, which checks the handle on that thread, and can never send from another
    /// file that reused the descriptor, as a close from another thread could make it.
    func forgetFiles(sha256s: Set<String>) {
        guard !sha256s.isEmpty else { return }
        let forgotten = openFiles.withLock { files in
            let matching = files.filter { sha256s.contains($0.key.sha256) }
            for key in matching.keys { files[key] = nil }
            return Array(matching.values)
        }
        guard !forgotten.isEmpty else { return }
        // Connections stop reusing a resolution that names one of these handles.
        stamp.add(1, ordering: .sequentiallyConsistent)
        for (file, loop, _) in forgotten { loop.execute { try? file.handle.close() } }
    }

    func closeFiles() {
        stamp.add(1, ordering: .sequentiallyConsistent)
        openFiles.withLock { files in
            for (file, _, _) in files.values { try? file.handle.close() }
            files.removeAll()
        }
    }
}

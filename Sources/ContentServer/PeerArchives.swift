import AsyncHTTPClient
import ContentCatalog
import Crypto
import DownloadGrants
import DurableFiles
import Foundation
import IAPProtocol
import Logging
import NIOCore
import Synchronization

/// Archives for replicas that share no archive folder: each published version names the replica
/// that received it (its `--advertise-url`), and a replica without the archive fetches it from
/// there over the ordinary content path, under a grant it signs itself with the shared keys,
/// checks size and SHA-256 (and the manifest's), and renames it into its folder. Until then,
/// content requests for it are redirected (307) to that replica (``ContentService``), so none
/// fails meanwhile.
final class PeerArchives: Sendable {
    private let store: ContentStore
    private let grants: GrantKeys
    private let ownURL: String?
    private let http: HTTPClient
    private let logger: Logger
    private let inFlight = Mutex<Set<String>>([])
    /// The catalog's ``ChangeCounter/versions`` at the last pass that left nothing to fetch, and
    /// when that pass was: an unchanged catalog is not read again, but for a pass a minute,
    /// which finds an archive deleted by hand.
    private let settled = Mutex<(counter: Int64, at: ContinuousClock.Instant)?>(nil)
    static let fullPassInterval: Duration = .seconds(60)

    init(store: ContentStore, grants: GrantKeys, ownURL: String?, http: HTTPClient, logger: Logger) {
        self.store = store
        self.grants = grants
        self.ownURL = ownURL
        self.http = http
        self.logger = logger
    }

    /// Reads the catalog (handed to `read`) and fetches every archive this replica lacks from its origin. Called
    /// at start and every few seconds (with the revocation reload), and when a request misses.
    /// Removed versions' archives are deleted from this replica's folder (the replica that
    /// removed one did so already, as does one sharing its folder) and `removed` is told which,
    /// to close what it keeps open.
    func catchUp(force: Bool = false, read: ([PublishedVersion]) -> Void = { _ in }, removed: (Set<String>) -> Void = { _ in }) async {
        let counter = try? await store.database.changeCounter(.versions)
        if !force, let counter, let last = settled.withLock({ $0 }), last.counter == counter, ContinuousClock.now - last.at < Self.fullPassInterval {
            return
        }
        guard let versions = try? await store.database.versions(productId: nil) else { return }
        // What `/readyz?for=downloads` looks for should the database go away next.
        if let counter { store.noteVersionsRead(versions, atCounter: counter) }
        read(versions)
        let gone = ContentStore.removedArchives(versions)
        if !gone.isEmpty {
            // Deleted first: a request between the two could otherwise open a file about to go.
            let freed = await store.deleteArchives(gone)
            if freed > 0 { logger.notice("deleted the archives of removed versions", metadata: ["bytes": "\(freed)"]) }
            removed(gone)
        }
        // Missing here, here with another size than published (a copy cut short), or with other
        // bytes that a read found (the periodic read, `ContentService.findRottenArchives`, or
        // `iap-server check` on this folder): this replica's copy is only a copy, so the origin's
        // replaces it.
        // Another replica's uploads only, looked at first: with a shared folder there are none,
        // and no file is looked at.
        let missing = versions.filter { version in
            version.removedAt == nil && version.originURL.map { $0 != ownURL } == true && needsFetch(version)
        }
        for version in missing { await fetch(version) }
        // Settled only when every fetch landed: one that failed is tried again at the next beat.
        let left = missing.contains { needsFetch($0) }
        settled.withLock { $0 = left ? nil : counter.map { ($0, ContinuousClock.now) } }
    }

    /// Whether this replica lacks the archive or its manifest, or holds an archive of another
    /// size than published or found with other bytes (`archiveOnly`: the archive alone).
    private func needsFetch(_ version: PublishedVersion, archiveOnly: Bool = false) -> Bool {
        switch store.damage(of: version, readingContents: false, includingManifest: !archiveOnly).0 {
        case .missing, .wrongSize, .wrongDigest, .unreadable, .manifestMissing: true
        case nil, .manifestWrongDigest: false
        }
    }

    private func fetch(_ version: PublishedVersion) async {
        guard let origin = version.originURL else { return }
        guard inFlight.withLock({ $0.insert(version.sha256).inserted }) else { return }
        defer { _ = inFlight.withLock { $0.remove(version.sha256) } }
        let token = grants.ring.mint(
            Grant(
                transactionId: "replica-fetch", productId: version.productId, contentVersion: version.contentVersion, sha256: version.sha256,
                expiresAt: Int64(Date().timeIntervalSince1970) + 3600))
        do {
            if let manifestSHA = version.manifestSHA256, access(store.manifestPath(sha256: version.sha256), R_OK) != 0 {
                let url = origin + Route.manifest(token: token, productId: version.productId, contentVersion: version.contentVersion)
                // Manifests are small (a few MiB for tens of thousands of entries): checked in memory.
                let data = Data(buffer: try await get(url).body.collect(upTo: 256 << 20))
                try check(url, sha256: Hex.encode(SHA256.hash(data: data)), size: Int64(data.count), expected: manifestSHA, expectedSize: nil)
                try store.storeManifest(data, archiveSHA256: version.sha256)
            }
            let damaged = access(store.archivePath(sha256: version.sha256), F_OK) == 0
            if needsFetch(version, archiveOnly: true) {
                try await fetchArchive(
                    origin + Route.content(token: token, productId: version.productId, contentVersion: version.contentVersion), version,
                    replacing: damaged)
            }
            if damaged {
                logger.notice(
                    "replaced a damaged copy of an archive with its origin's", metadata: ["sha256": "\(version.sha256)", "origin": "\(origin)"])
            } else {
                logger.info("fetched an archive from its origin", metadata: ["sha256": "\(version.sha256)", "origin": "\(origin)"])
            }
        } catch {
            logger.warning(
                "cannot fetch an archive from its origin; requests for it are redirected there, and the fetch is tried again",
                metadata: ["sha256": "\(version.sha256)", "origin": "\(origin)", "error": "\(OutboundHTTP.describe(error, url: origin))"])
        }
    }

    struct FetchError: Error, CustomStringConvertible {
        let description: String
    }

    private func get(_ url: String) async throws -> HTTPClientResponse {
        let response = try await http.execute(HTTPClientRequest(url: url), timeout: .seconds(3600))
        guard response.status == .ok else { throw FetchError(description: "\(url) answered \(response.status.code)") }
        return response
    }

    private func check(_ url: String, sha256: String, size: Int64, expected: String, expectedSize: Int64?) throws {
        guard sha256 == expected, expectedSize.map({ $0 == size }) ?? true else {
            throw FetchError(description: "\(url) sent \(size) bytes with SHA-256 \(sha256), not the published \(expected): refused")
        }
    }

    /// Streams the archive into the uploads folder, hashing as it arrives, and hands it to the
    /// store (which syncs and renames it as it does uploads) only when size and SHA-256 match.
    private func fetchArchive(_ url: String, _ version: PublishedVersion, replacing: Bool) async throws {
        let upload = store.claimUpload()
        let temporary = upload.path
        guard FileManager.default.createFile(atPath: temporary, contents: nil), let file = FileHandle(forWritingAtPath: temporary) else {
            upload.release()
            throw FetchError(description: "cannot create \(temporary)")
        }
        upload.lock()
        defer {
            try? file.close()
            unlink(temporary)  // gone already once adopted
            upload.release()
        }
        var hasher = SHA256()
        var received: Int64 = 0
        // In large writes, as uploads: this replica serves the file from the page cache next.
        let writes = GatheredWrites { buffer in try buffer.withUnsafeReadableBytes { try file.write(contentsOf: $0) } }
        for try await buffer in try await get(url).body {
            buffer.withUnsafeReadableBytes { hasher.update(bufferPointer: $0) }
            received += Int64(buffer.readableBytes)
            if received > version.size { throw FetchError(description: "\(url) sent more than the \(version.size) bytes published") }
            try writes.append(buffer)
        }
        try writes.flush()
        try check(url, sha256: Hex.encode(hasher.finalize()), size: received, expected: version.sha256, expectedSize: version.size)
        try await store.adoptArchive(at: temporary, sha256: version.sha256, replacing: replacing)
    }
}

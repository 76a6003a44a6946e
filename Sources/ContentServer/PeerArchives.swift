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
/// content requests for it are redirected (307) to that replica, so none fails meanwhile.
final class PeerArchives: Sendable {
    private let store: ContentStore
    private let grants: GrantKeyRing
    private let ownURL: String?
    private let logger: Logger
    /// Where to send requests for an archive this replica lacks: SHA-256 → the origin's base URL.
    private let origins = Mutex<[String: String]>([:])
    private let inFlight = Mutex<Set<String>>([])

    init(store: ContentStore, grants: GrantKeyRing, ownURL: String?, logger: Logger) {
        self.store = store
        self.grants = grants
        self.ownURL = ownURL
        self.logger = logger
    }

    /// The origin to redirect a request for `sha256` to, when this replica lacks the archive and
    /// another has it; starts fetching it. Never blocks (runs on the event loop).
    func redirect(sha256: String) -> String? {
        guard let origin = origins.withLock({ $0[sha256] }) else { return nil }
        return origin
    }

    /// Reads the catalog and fetches every archive this replica lacks from its origin. Called
    /// at start and every few seconds (with the revocation reload), and when a request misses.
    func catchUp() async {
        guard let versions = try? await store.database.versions(productId: nil) else { return }
        var missing: [PublishedVersion] = []
        for version in versions where access(store.archivePath(sha256: version.sha256), R_OK) != 0 {
            guard let origin = version.originURL, origin != ownURL else { continue }
            missing.append(version)
        }
        origins.withLock { map in
            map = Dictionary(missing.map { ($0.sha256, $0.originURL!) }, uniquingKeysWith: { first, _ in first })
        }
        for version in missing { await fetch(version) }
    }

    private func fetch(_ version: PublishedVersion) async {
        guard let origin = version.originURL else { return }
        guard inFlight.withLock({ $0.insert(version.sha256).inserted }) else { return }
        defer { _ = inFlight.withLock { $0.remove(version.sha256) } }
        let token = grants.mint(
            Grant(
                transactionId: "replica-fetch", productId: version.productId, contentVersion: version.contentVersion, sha256: version.sha256,
                expiresAt: Int64(Date().timeIntervalSince1970) + 3600))
        do {
            if let manifestSHA = version.manifestSHA256 {
                try await download(
                    origin + Route.manifest(token: token, productId: version.productId, contentVersion: version.contentVersion), size: nil,
                    sha256: manifestSHA, to: store.manifestPath(sha256: version.sha256))
            }
            try await download(
                origin + Route.content(token: token, productId: version.productId, contentVersion: version.contentVersion), size: version.size,
                sha256: version.sha256, to: store.archivePath(sha256: version.sha256))
            origins.withLock { _ = $0.removeValue(forKey: version.sha256) }
            logger.info("fetched an archive from its origin", metadata: ["sha256": "\(version.sha256)", "origin": "\(origin)"])
        } catch {
            logger.warning(
                "cannot fetch an archive from its origin; requests for it are redirected there, and the fetch is tried again",
                metadata: ["sha256": "\(version.sha256)", "origin": "\(origin)", "error": "\(error)"])
        }
    }

    struct FetchError: Error, CustomStringConvertible {
        let description: String
    }

    /// Streams `url` into a temporary file beside `path`, hashing as it arrives; renames it into
    /// place only when size and SHA-256 are the published ones.
    private func download(_ url: String, size: Int64?, sha256: String, to path: String) async throws {
        if access(path, R_OK) == 0 { return }
        let temporary = store.temporaryUploadPath()
        guard let file = FileHandle(forWritingAtPath: temporary) ?? (FileManager.default.createFile(atPath: temporary, contents: nil) ? FileHandle(forWritingAtPath: temporary) : nil)
        else { throw FetchError(description: "cannot create \(temporary)") }
        var renamed = false
        defer {
            try? file.close()
            if !renamed { unlink(temporary) }
        }
        let response = try await HTTPClient.shared.execute(HTTPClientRequest(url: url), timeout: .seconds(3600))
        guard response.status == .ok else { throw FetchError(description: "\(url) answered \(response.status.code)") }
        var hasher = SHA256()
        var received: Int64 = 0
        for try await buffer in response.body {
            try buffer.withUnsafeReadableBytes { bytes in
                hasher.update(bufferPointer: bytes)
                try file.write(contentsOf: bytes)
            }
            received += Int64(buffer.readableBytes)
            if let size, received > size { throw FetchError(description: "\(url) sent more than the \(size) bytes published") }
        }
        let digest = Hex.encode(hasher.finalize())
        guard digest == sha256, size.map({ $0 == received }) ?? true else {
            throw FetchError(description: "\(url) sent \(received) bytes with SHA-256 \(digest), not the published \(sha256): refused")
        }
        try file.synchronize()
        chmod(temporary, 0o444)
        guard rename(temporary, path) == 0 else { throw FetchError(description: "cannot rename into \(path): \(String(cString: strerror(errno)))") }
        renamed = true
        try? Directory.sync((path as NSString).deletingLastPathComponent)
    }
}

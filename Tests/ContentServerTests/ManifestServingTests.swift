import ContentArchive
import Crypto
import Foundation
import IAPTestSupport
import Testing

extension ServerTests {
    @Test("the grant names the manifest and its SHA-256; it is served under the grant, with ranges, and cut by a refund", arguments: Backend.allCases)
    func manifestUnderGrant(backend: Backend) async throws {
        let tmp = try TemporaryFolder()
        let (store, server, data) = try start(tmp, database: backend == .postgres ? try await PostgresServer.shared().createDatabase() : nil)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp).status == 201)
        let purchase = try store.purchase(productId: product)
        let granted = try grant(purchase.signedTransaction, server: server, tmp: tmp)
        let download = try #require((granted.json["downloads"] as? [[String: Any]])?.first)
        let manifestURL = try #require(download["manifestURL"] as? String)
        let manifestSHA = try #require(download["manifestSHA256"] as? String)
        #expect(manifestURL.hasSuffix("/\(product)-1.0.manifest.json"))

        let fetched = try curl([manifestURL], folder: tmp)
        #expect(fetched.status == 200)
        #expect(fetched.headers["content-type"] == "application/json")
        #expect(fetched.headers["etag"] == "\"\(manifestSHA)\"")
        #expect(SHA256.hash(data: fetched.body).map { String(format: "%02x", $0) }.joined() == manifestSHA)
        // What the server serves is what it computed from the archive: every derivable field of
        // the packer's manifest, chunk hashes included.
        let served = try ArchiveManifest.decode(fetched.body, source: "served")
        #expect(served.entries == packed.manifest.entries.map(\.derivable))
        #expect(served.archiveSHA256 == packed.manifest.archiveSHA256)
        #expect(FileManager.default.fileExists(atPath: data + "/archives/\(packed.manifest.archiveSHA256).manifest.json"))

        let range = try curl(["-r", "0-99", "-H", "If-Range: \"\(manifestSHA)\"", manifestURL], folder: tmp)
        #expect(range.status == 206 && range.body == fetched.body.prefix(100))
        // A forged token gets nothing, manifest or archive.
        let forged = manifestURL.replacingOccurrences(of: "/v1/content/", with: "/v1/content/x")
        #expect(try curl([forged], folder: tmp).status == 401)

        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        let cut = try curl([manifestURL], folder: tmp)
        #expect(cut.status == 403 && cut.errorCode == "revoked")
        #expect(server.stop() == 0)
    }
}

extension ServerTests {
    @Test("what caches need: Repr-Digest with the archive's SHA-256, If-Modified-Since answered 304; /readyz names a missing archive", arguments: Backend.allCases)
    func cacheHeadersAndReadiness(backend: Backend) async throws {
        let tmp = try TemporaryFolder()
        let (store, server, data) = try start(tmp, database: backend == .postgres ? try await PostgresServer.shared().createDatabase() : nil)
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp).status == 201)
        let purchase = try store.purchase(productId: product)
        let download = try #require((try grant(purchase.signedTransaction, server: server, tmp: tmp).json["downloads"] as? [[String: Any]])?.first)
        let url = try #require(download["url"] as? String)

        let full = try curl([url], folder: tmp)
        let digest = Data(SHA256.hash(data: full.body)).base64EncodedString()
        #expect(full.headers["repr-digest"] == "sha-256=:\(digest):")
        let ranged = try curl(["-r", "0-99", url], folder: tmp)
        #expect(ranged.status == 206 && ranged.headers["repr-digest"] == "sha-256=:\(digest):")
        let lastModified = try #require(full.headers["last-modified"])
        let notModified = try curl(["-H", "If-Modified-Since: \(lastModified)", url], folder: tmp)
        #expect(notModified.status == 304 && notModified.body.isEmpty)
        #expect(notModified.headers["etag"] == full.headers["etag"])
        // If-None-Match decides when both are sent (RFC 9110 §13.2.2).
        #expect(try curl(["-H", "If-Modified-Since: \(lastModified)", "-H", "If-None-Match: \"other\"", url], folder: tmp).status == 200)
        #expect(try curl(["-H", "If-Modified-Since: Thu, 01 Jan 1970 00:00:00 GMT", url], folder: tmp).status == 200)

        #expect(try curl([server.base + "/readyz"], folder: tmp).json["status"] as? String == "ready")
        let archive = data + "/archives/\(packed.manifest.archiveSHA256).zip"
        try FileManager.default.moveItem(atPath: archive, toPath: archive + ".away")
        let missing = try curl([server.base + "/readyz"], folder: tmp)
        #expect(missing.status == 503 && missing.errorCode == "not-ready")
        #expect(missing.text.contains(packed.manifest.archiveSHA256))
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200)
        try FileManager.default.moveItem(atPath: archive + ".away", toPath: archive)
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200)
        #expect(server.stop() == 0)
    }
}

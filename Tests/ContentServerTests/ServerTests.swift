import ContentArchive
import ContentCatalog
import DownloadGrants
import Foundation
import IAPTestSupport
import PurchaseVerification
import SandboxStore
import Testing

@Suite("iap-server over real HTTP", .serialized, .onTestThreads)
struct ServerTests {
    let bundleId = "com.example.app"
    let product = "com.example.cosmos.levels1"
    let adminToken = "admin-token-for-tests-0123456789"

    struct World {
        let tmp: TemporaryFolder
        let store: SandboxStore
        let server: ServerProcess
        let archive: PackResult
        let data: String
    }

    /// `database`: a PostgreSQL URL for the catalog instead of the data folder's SQLite file.
    func start(_ tmp: TemporaryFolder, data: String? = nil, database: String? = nil, extra: [String] = []) throws -> (SandboxStore, ServerProcess, String) {
        let sandboxDir = tmp.sub("sandbox")
        let store =
            FileManager.default.fileExists(atPath: sandboxDir + "/store.json")
            ? try SandboxStore(folder: sandboxDir) : try SandboxStore.initialize(folder: sandboxDir, bundleId: bundleId)
        try adminToken.write(toFile: tmp.sub("admin-token"), atomically: true, encoding: .utf8)
        chmod(tmp.sub("admin-token"), 0o600)
        let dataDir = data ?? tmp.sub("data")
        let server = try ServerProcess(
            data: dataDir,
            arguments: [
                "--bundle-id", bundleId, "--trust-root", store.rootCertificatePath, "--environment", "sandbox",
                "--admin-token-file", tmp.sub("admin-token"),
            ] + (database.map { ["--database", $0] } ?? []) + extra, folder: tmp)
        return (store, server, dataDir)
    }

    func packSample(_ tmp: TemporaryFolder, version: String = "1.0") throws -> PackResult {
        let content = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("content/com.example.cosmos.levels1/Contents").path
        return try ArchivePacker.pack(
            folder: content,
            options: .init(
                productId: try ProductIdentifier(product), contentVersion: try ContentVersion(version), outputDirectory: tmp.sub("out-\(version)")))
    }

    func upload(_ archive: String, server: ServerProcess, tmp: TemporaryFolder, token: String? = nil, manifest: ArchiveManifest? = nil) throws -> HTTPResult {
        var args = ["-X", "PUT", "-T", archive, "-H", "Authorization: Bearer \(token ?? adminToken)"]
        if let manifest {
            let encoded = manifest.jsonData().base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_").replacingOccurrences(of: "=", with: "")
            args += ["-H", "IAP-Manifest: \(encoded)"]
        }
        return try curl(args + [server.base + "/v1/admin/archives"], folder: tmp)
    }

    func grant(_ signed: String, server: ServerProcess, tmp: TemporaryFolder, version: String? = nil) throws -> HTTPResult {
        var body: [String: Any] = ["signedTransaction": signed]
        if let version { body["contentVersion"] = version }
        return try postJSON(server.base + "/v1/downloads", body, folder: tmp)
    }

    /// Where the server keeps its catalog in a test: the data folder's SQLite file, or PostgreSQL.
    enum Backend: String, CaseIterable, Sendable {
        case sqlite, postgres
    }

    @Test("publish, buy, grant, download with every kind of range, refund, and access is cut", arguments: Backend.allCases)
    func purchasePath(backend: Backend) async throws {
        let tmp = try TemporaryFolder()
        let database = backend == .postgres ? try await PostgresServer.shared().createDatabase() : nil
        let (store, server, _) = try start(tmp, database: database)
        let packed = try packSample(tmp)
        let archiveBytes = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
        let size = archiveBytes.count

        #expect(try curl([server.base + "/v1/products/\(product)"], folder: tmp).status == 404)
        let published = try upload(packed.archivePath, server: server, tmp: tmp, manifest: packed.manifest)
        #expect(published.status == 201, "\(published.text)")
        #expect(try upload(packed.archivePath, server: server, tmp: tmp).status == 200)
        let info = try curl([server.base + "/v1/products/\(product)"], folder: tmp)
        #expect(info.json["contentVersion"] as? String == "1.0")
        #expect(info.json["sha256"] as? String == packed.manifest.archiveSHA256)
        #expect(info.json["contentLength"] as? Int == size)

        let purchase = try store.purchase(productId: product)
        let granted = try grant(purchase.signedTransaction, server: server, tmp: tmp)
        #expect(granted.status == 200, "\(granted.text)")
        let download = try #require((granted.json["downloads"] as? [[String: Any]])?.first)
        let url = try #require(download["url"] as? String)
        #expect(download["sha256"] as? String == packed.manifest.archiveSHA256)

        let full = try curl([url], folder: tmp)
        #expect(full.status == 200)
        #expect(full.body == archiveBytes)
        #expect(full.headers["accept-ranges"] == "bytes")
        let etag = try #require(full.headers["etag"])
        #expect(etag == "\"\(packed.manifest.archiveSHA256)\"")
        let lastModified = try #require(full.headers["last-modified"])

        let head = try curl(["-I", url], folder: tmp)
        #expect(head.status == 200)
        #expect(head.headers["content-length"] == String(size) && head.headers["etag"] == etag)
        // HEAD sends no body: the next response on the same connection follows the headers directly.
        let path = String(url.dropFirst(server.base.count))
        let exchange = try rawExchange(port: server.port, "HEAD \(path) HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", folder: tmp)
        let firstEnd = try #require(exchange.range(of: "\r\n\r\n"))
        #expect(exchange[firstEnd.upperBound...].hasPrefix("HTTP/1.1 200 OK"))

        let first = try curl(["-r", "0-9", url], folder: tmp)
        #expect(first.status == 206 && first.body == archiveBytes.prefix(10))
        #expect(first.headers["content-range"] == "bytes 0-9/\(size)")
        let open = try curl(["-r", "\(size - 100)-", url], folder: tmp)
        #expect(open.status == 206 && open.body == archiveBytes.suffix(100))
        let suffix = try curl(["-H", "Range: bytes=-50", url], folder: tmp)
        #expect(suffix.status == 206 && suffix.body == archiveBytes.suffix(50))
        let clamped = try curl(["-r", "\(size - 10)-\(size + 5000)", url], folder: tmp)
        #expect(clamped.status == 206 && clamped.headers["content-range"] == "bytes \(size - 10)-\(size - 1)/\(size)")
        let beyond = try curl(["-r", "\(size + 10)-", url], folder: tmp)
        #expect(beyond.status == 416 && beyond.headers["content-range"] == "bytes */\(size)")
        let multi = try curl(["-r", "100-199,0-9", url], folder: tmp)
        #expect(multi.status == 206)
        #expect(multi.headers["content-type"]?.hasPrefix("multipart/byteranges; boundary=") == true)
        #expect(multi.text.contains("Content-Range: bytes 0-9/\(size)") && multi.text.contains("Content-Range: bytes 100-199/\(size)"))
        #expect(multi.headers["content-length"] == String(multi.body.count))
        #expect(try curl(["-H", "Range: bytes=abc", url], folder: tmp).status == 200)
        #expect(try curl(["-H", "Range: items=0-9", url], folder: tmp).status == 200)
        let many = "bytes=" + (0..<1000).map { "\($0 * 2)-\($0 * 2)" }.joined(separator: ",")
        #expect(try curl(["-H", "Range: \(many)", url], folder: tmp).status == 200)
        #expect(try curl(["-r", "0-9", "-H", "If-Range: \(etag)", url], folder: tmp).status == 206)
        #expect(try curl(["-r", "0-9", "-H", "If-Range: \(lastModified)", url], folder: tmp).status == 206)
        let changed = try curl(["-r", "0-9", "-H", "If-Range: \"something-else\"", url], folder: tmp)
        #expect(changed.status == 200 && changed.body == archiveBytes)
        #expect(try curl(["-H", "If-None-Match: \(etag)", url], folder: tmp).status == 304)

        // Many transfers of the same archive at once, spread over the event loops, all succeed.
        let requests = (0..<48).flatMap { i in ["-r", "\(i * 100)-\(i * 100 + 4095)", "-o", "/dev/null", url] }
        let parallel = try run("curl", ["-s", "--parallel", "--parallel-max", "16", "-w", "%{http_code} %{size_download}\n"] + requests)
        let lines = parallel.stdout.split(separator: "\n")
        #expect(lines.count == 48 && lines.allSatisfy { $0 == "206 4096" }, "\(lines)")

        // curl -C - resumes a partial file.
        let partial = tmp.sub("partial.zip")
        try archiveBytes.prefix(1234).write(to: URL(fileURLWithPath: partial))
        try run("curl", ["-s", "-C", "-", "-o", partial, url])
        #expect(try Data(contentsOf: URL(fileURLWithPath: partial)) == archiveBytes)

        // A refund after the grant: the content URL and new grants are refused at once.
        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        let notified = try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp)
        #expect(notified.status == 200 && notified.json["status"] as? String == "applied")
        let cut = try curl([url], folder: tmp)
        #expect(cut.status == 403 && cut.errorCode == "revoked")
        let regrant = try grant(purchase.signedTransaction, server: server, tmp: tmp)
        #expect(regrant.status == 403 && regrant.errorCode == "revoked")
        for _ in 0..<100 {
            let replay = try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp)
            #expect(replay.status == 200 && replay.json["status"] as? String == "duplicate")
        }
        let ledger = try await openStore(tmp.sub("data"), databaseURL: database)
        #expect(try await ledger.notificationCount() == 1)
        #expect(try await ledger.database.grantCount() == 1)
        await ledger.database.close()
        let metrics = try curl([server.base + "/metrics"], folder: tmp)
        #expect(metrics.text.contains("iap_content_bytes_served_total"))
        #expect(metrics.text.contains("iap_grants_total{outcome=\"granted\"} 1"))
        #expect(server.stop() == 0)
    }

    @Test("each grant, refusal, notification and catalog change is one log line with its reason; request text cannot forge a line, and no proof or token is logged")
    func decisionLog() throws {
        let tmp = try TemporaryFolder()
        let (store, server, _) = try start(tmp)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp).status == 201)
        let purchase = try store.purchase(productId: product)
        let id = try #require(purchase.transaction.transactionId)
        let granted = try grant(purchase.signedTransaction, server: server, tmp: tmp)
        let url = try #require((granted.json["downloads"] as? [[String: Any]])?.first?["url"] as? String)
        // The pinned version is the client's own text, and the refusal's reason quotes it.
        let forged = "9.9\n2026-01-01T00:00:00+0000 info iap-server: forged [ContentServer] download granted"
        #expect(try grant(purchase.signedTransaction, server: server, tmp: tmp, version: forged).status == 404)
        #expect(try postJSON(server.base + "/v1/downloads", ["signedTransaction": "abc"], folder: tmp).status == 400)
        let refund = try store.refund(transactionId: id)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        #expect(try grant(purchase.signedTransaction, server: server, tmp: tmp).status == 403)
        // The refund reversed: access comes back, and the log says so (not "revoked").
        var reversal = refund.notification
        reversal.notificationType = .refundReversed
        reversal.notificationUUID = UUID().uuidString.lowercased()
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": try store.sign(reversal)], folder: tmp).status == 200)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp, token: "not-the-admin-token").status == 401)
        #expect(server.stop() == 0)

        let lines = try String(contentsOfFile: server.log, encoding: .utf8).split(separator: "\n").map(String.init)
        func line(_ message: String, _ fields: String...) -> String? {
            lines.first { $0.hasSuffix("] " + message) && fields.allSatisfy($0.contains) }
        }
        #expect(line("version published", "productId=\(product)", "contentVersion=1.0", "sha256=\(packed.manifest.archiveSHA256)") != nil, "\(lines)")
        #expect(line("download granted", "transactionId=\(id)", "productId=\(product)", "contentVersion=1.0", "environment=Sandbox", "proof=signed-transaction") != nil)
        let refusedVersion = try #require(line("download refused", "code=no-content", "transactionId=\(id)"))
        #expect(refusedVersion.contains("version 9.9\\n2026-01-01"), "\(refusedVersion)")
        #expect(!lines.contains { $0.hasPrefix("2026-01-01T00:00:00+0000") }, "a client's text made a line of its own")
        #expect(line("download refused", "code=malformed", "proof=signed-transaction") != nil)
        #expect(line("App Store notification", "type=REFUND", "transactionId=\(id)", "notificationUUID=\(refund.notification.notificationUUID ?? "")", "outcome=applied: access revoked") != nil)
        #expect(line("App Store notification", "type=REFUND", "outcome=duplicate") != nil)
        #expect(line("App Store notification", "type=REFUND_REVERSED", "transactionId=\(id)", "outcome=applied: access restored") != nil)
        #expect(line("download refused", "code=revoked", "transactionId=\(id)") != nil)
        #expect(lines.contains { $0.contains(" warning ") && $0.contains("reason=wrong bearer token") && $0.hasSuffix("admin request refused") })
        // Nothing to replay or to download with.
        let token = try #require(url.split(separator: "/").first { $0.hasPrefix("k1.") })
        let log = lines.joined(separator: "\n")
        #expect(!log.contains(purchase.signedTransaction) && !log.contains(refund.signedPayload) && !log.contains(token) && !log.contains(adminToken))
    }

    @Test("bad input gets the right status and a clear error; the server stays up and keeps its state")
    func badInput() throws {
        let tmp = try TemporaryFolder()
        let (store, server, data) = try start(tmp)
        let v1 = try packSample(tmp), v2 = try packSample(tmp, version: "1.1")
        #expect(try upload(v1.archivePath, server: server, tmp: tmp).status == 201)

        let wrongToken = try upload(v1.archivePath, server: server, tmp: tmp, token: "wrong-token-wrong-token")
        #expect(wrongToken.status == 401)
        #expect(wrongToken.headers["www-authenticate"] == "Bearer realm=\"iap-server admin\", error=\"invalid_token\"")
        var lying = v2.manifest
        lying.entries[2].sha256 = String(repeating: "0", count: 64)
        let liar = try upload(v2.archivePath, server: server, tmp: tmp, manifest: lying)
        #expect(liar.status == 400 && liar.errorCode == "invalid-archive", "\(liar.text)")
        try Data("definitely not a zip".utf8).write(to: URL(fileURLWithPath: tmp.sub("junk.zip")))
        #expect(try upload(tmp.sub("junk.zip"), server: server, tmp: tmp).status == 400)
        #expect(try upload(v2.archivePath, server: server, tmp: tmp).status == 201)
        let older = try upload(v1.archivePath, server: server, tmp: tmp)
        #expect(older.status == 200, "identical bytes of a published version are a no-op")
        let v0 = try packSample(tmp, version: "0.9")
        let conflict = try upload(v0.archivePath, server: server, tmp: tmp)
        #expect(conflict.status == 409 && conflict.errorCode == "conflict")

        let purchase = try store.purchase(productId: product)
        let pinned = try grant(purchase.signedTransaction, server: server, tmp: tmp, version: "1.0")
        #expect((pinned.json["downloads"] as? [[String: Any]])?.first?["contentVersion"] as? String == "1.0")
        #expect(try grant(purchase.signedTransaction, server: server, tmp: tmp, version: "7.0").status == 404)
        let latest = try grant(purchase.signedTransaction, server: server, tmp: tmp)
        let url = try #require(((latest.json["downloads"] as? [[String: Any]])?.first?["url"] as? String))
        #expect(url.hasSuffix("/\(product)-1.1.zip"))

        // Malformed, unverifiable and refused proofs.
        #expect(try curl(["-X", "POST", "--data-binary", "{not json", server.base + "/v1/downloads"], folder: tmp).status == 400)
        #expect(try postJSON(server.base + "/v1/downloads", ["signedTransaction": "a.b.c"], folder: tmp).status == 400)
        let big = tmp.sub("big.json")
        try Data(("{\"signedTransaction\": \"" + String(repeating: "A", count: 400_000) + "\"}").utf8).write(to: URL(fileURLWithPath: big))
        #expect(try curl(["-X", "POST", "--data-binary", "@" + big, server.base + "/v1/downloads"], folder: tmp).status == 413)
        // Announced as 100 GB, one byte sent: refused at once, not after waiting for the rest.
        let announced = try rawExchange(
            port: server.port, "POST /v1/downloads HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\nConnection: close\r\n\r\n{", folder: tmp)
        #expect(announced.hasPrefix("HTTP/1.1 413 ") && announced.contains("\"too-large\""), "\(announced)")
        // A head that is not HTTP gets the error envelope, not a bare 400 (a flood: below); a body
        // that is not valid HTTP is malformed, not too large.
        let badField = try rawExchange(port: server.port, "GET /healthz HTTP/1.1\r\nHost: x\r\nBad Field: y\r\n\r\n", folder: tmp)
        #expect(badField.hasPrefix("HTTP/1.1 400 ") && badField.contains("\"malformed\""), "\(badField)")
        let badChunk = try rawExchange(
            port: server.port, "POST /v1/downloads HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n", folder: tmp)
        #expect(badChunk.hasPrefix("HTTP/1.1 400 ") && badChunk.contains("could not be read"), "\(badChunk)")
        let stranger = try SandboxCertificateAuthority.generate()
        var foreign = Transaction(
            transactionId: "1", originalTransactionId: "1", bundleId: bundleId, productId: product,
            purchaseDate: Date(), type: .nonConsumable, environment: .sandbox, signedDate: Date())
        let untrusted = try grant(try stranger.sign(foreign), server: server, tmp: tmp)
        #expect(untrusted.status == 401 && untrusted.errorCode == "untrusted-chain")
        foreign.bundleId = "com.example.other"
        let otherApp = try grant(try store.authority.sign(foreign), server: server, tmp: tmp)
        #expect(otherApp.status == 403 && otherApp.errorCode == "wrong-bundle-id")
        let unsold = try store.purchase(productId: "com.example.nothing")
        #expect(try grant(unsold.signedTransaction, server: server, tmp: tmp).status == 404)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": "x.y.z"], folder: tmp).status == 400)

        // Forged, expired and traversing content URLs.
        let token = url.components(separatedBy: "/v1/content/")[1].components(separatedBy: "/")[0]
        var forgedBytes = Array(token.utf8)
        forgedBytes[forgedBytes.count - 3] = forgedBytes[forgedBytes.count - 3] == UInt8(ascii: "A") ? UInt8(ascii: "B") : UInt8(ascii: "A")
        #expect(try curl([server.base + "/v1/content/" + String(decoding: forgedBytes, as: UTF8.self) + "/x.zip"], folder: tmp).status == 401)
        let keys = try GrantKeyRing.loadOrCreate(path: data + "/grant-keys.json")
        let expired = keys.mint(
            Grant(
                transactionId: purchase.transaction.transactionId!, productId: product, contentVersion: "1.1",
                sha256: v2.manifest.archiveSHA256, expiresAt: Int64(Date().timeIntervalSince1970) - 5))
        let expiredResult = try curl([server.base + "/v1/content/\(expired)/x.zip"], folder: tmp)
        #expect(expiredResult.status == 401 && expiredResult.errorCode == "grant-expired")
        #expect(try curl(["--path-as-is", server.base + "/v1/content/../../catalog.sqlite"], folder: tmp).status == 401)
        #expect(try curl(["--path-as-is", server.base + "/v1/../grant-keys.json"], folder: tmp).status == 404)
        #expect(try curl(["-X", "DELETE", url], folder: tmp).status == 405)
        // An API path asked with a method it does not answer is 405 with Allow, not 404; HEAD
        // works wherever GET does; a path that is nowhere is 404 naming it.
        for (method, path, allow) in [("GET", "/v1/downloads", "POST"), ("POST", "/healthz", "GET, HEAD"), ("DELETE", "/v1/products/\(product)", "GET, HEAD")] {
            let wrong = try curl(["-X", method, server.base + path], folder: tmp)
            #expect(wrong.status == 405 && wrong.headers["allow"] == allow && wrong.errorCode == "method-not-allowed", "\(method) \(path): \(wrong.text)")
        }
        #expect(try curl(["-I", server.base + "/healthz"], folder: tmp).status == 200)
        #expect(try curl(["-I", server.base + "/v1/products/\(product)"], folder: tmp).status == 200)
        let nowhere = try curl([server.base + "/v1/nothing"], folder: tmp)
        #expect(nowhere.status == 404 && nowhere.text.contains("nothing is served at /v1/nothing"), "\(nowhere.text)")

        // A header flood is answered 431 with the envelope naming the limits, and the server carries on.
        let flood = (0..<300).flatMap { ["-H", "X-Flood-\($0): \(String(repeating: "v", count: 100))"] }
        let flooded = try curl(flood + [url], folder: tmp)
        #expect(flooded.status == 431 && flooded.errorCode == "too-large" && flooded.text.contains("100 header fields"), "\(flooded.text)")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200)
        #expect(try curl([url], folder: tmp).status == 200)

        // SIGTERM exits cleanly; a restart keeps the catalog.
        #expect(server.stop() == 0)
        let (_, again, _) = try start(tmp, data: data)
        let info = try curl([again.base + "/v1/products/\(product)"], folder: tmp)
        #expect((info.json["versions"] as? [[String: Any]])?.count == 2)
        #expect(try grant(purchase.signedTransaction, server: again, tmp: tmp).status == 200)
        #expect(again.stop() == 0)
    }
}

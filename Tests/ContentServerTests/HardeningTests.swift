import ContentArchive
import ContentCatalog
import Foundation
import IAPTestSupport
import SandboxStore
import Testing

@Suite("iap-server against slow clients, multipart uploads and failing storage", .serialized, .onTestThreads)
struct HardeningTests {
    let bundleId = "com.example.app"
    let product = "com.example.cosmos.levels1"
    let adminToken = "admin-token-for-tests-0123456789"

    func pack(_ tmp: TemporaryFolder, version: String) throws -> PackResult {
        let content = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("content/\(product)/Contents").path
        return try ArchivePacker.pack(
            folder: content,
            options: .init(
                productId: try ProductIdentifier(product), contentVersion: try ContentVersion(version), outputDirectory: tmp.sub("out-\(version)")))
    }

    func start(_ tmp: TemporaryFolder, extra: [String] = [], launcher: [String] = []) throws -> (SandboxStore, ServerProcess) {
        let sandbox = tmp.sub("sandbox")
        let store =
            FileManager.default.fileExists(atPath: sandbox + "/store.json")
            ? try SandboxStore(folder: sandbox) : try SandboxStore.initialize(folder: sandbox, bundleId: bundleId)
        try adminToken.write(toFile: tmp.sub("admin-token"), atomically: true, encoding: .utf8)
        let server = try ServerProcess(
            data: tmp.sub("data"),
            arguments: [
                "--bundle-id", bundleId, "--trust-root", store.rootCertificatePath, "--environment", "sandbox",
                "--admin-token-file", tmp.sub("admin-token"),
            ] + extra, folder: tmp, launcher: launcher)
        return (store, server)
    }

    /// A server started with `extra`, version 1.0 published, and the download URL granted for one purchase of it.
    func grantedDownload(_ tmp: TemporaryFolder, extra: [String]) throws -> (server: ServerProcess, v1: PackResult, url: String) {
        let (store, server) = try start(tmp, extra: extra)
        let v1 = try pack(tmp, version: "1.0")
        #expect(try multipart(server, tmp, ["archive=@\(v1.archivePath)"]).status == 201)
        let grant = try postJSON(
            server.base + "/v1/downloads", ["signedTransaction": try store.purchase(productId: product).signedTransaction], folder: tmp)
        let url = try #require((grant.json["downloads"] as? [[String: Any]])?.first?["url"] as? String, "\(grant.text)")
        return (server, v1, url)
    }

    func multipart(_ server: ServerProcess, _ tmp: TemporaryFolder, _ parts: [String], headers: [String] = []) throws -> HTTPResult {
        try curl(
            ["-X", "PUT", "-H", "Authorization: Bearer \(adminToken)"] + headers + parts.flatMap { ["-F", $0] }
                + [server.base + "/v1/admin/archives"], folder: tmp)
    }

    /// A client that sends `requestLine` and one header, then one byte every 0.25 s for up to 20 s,
    /// never finishing the head; prints "closed" when the server cuts it off.
    static func lorisScript(requestLine: String) -> String {
        """
        import socket, sys, time
        s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))
        s.sendall(b"\(requestLine) HTTP/1.1\\r\\nHost: x\\r\\n")
        s.settimeout(0.25)
        start = time.monotonic()
        while time.monotonic() - start < 20:
            try:
                s.sendall(b"X")
                if s.recv(100) == b"":
                    print("closed"); sys.exit(0)
            except socket.timeout:
                continue
            except OSError:
                print("closed"); sys.exit(0)
        print("still open")
        """
    }

    func leftovers(_ tmp: TemporaryFolder) -> [String] {
        (try? FileManager.default.contentsOfDirectory(atPath: tmp.sub("data/tmp"))) ?? []
    }

    /// Packs a product whose archive is over `megabytes` MiB (one incompressible file), so that
    /// an upload spans several of the server's gathered writes.
    func packLarge(_ tmp: TemporaryFolder, version: String, megabytes: Int) throws -> PackResult {
        let folder = tmp.sub("large-\(version)")
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        var generator = SystemRandomNumberGenerator()
        let words = (0..<((megabytes << 20) + 12_345) / 8).map { _ in generator.next() as UInt64 }
        try words.withUnsafeBytes { try Data($0).write(to: URL(fileURLWithPath: folder + "/media.bin")) }
        try Data("level \(version)".utf8).write(to: URL(fileURLWithPath: folder + "/level.txt"))
        return try ArchivePacker.pack(
            folder: folder,
            options: .init(
                productId: try ProductIdentifier(product), contentVersion: try ContentVersion(version), outputDirectory: tmp.sub("out-\(version)")))
    }

    @Test("iap-server publish stopped by SIGTERM while copying into the store leaves no upload file and publishes nothing")
    func interruptedPublish() async throws {
        let tmp = try TemporaryFolder()
        // 256 MiB of zeros, stored: a copy into the store and its fsync long enough to be caught.
        let folder = tmp.sub("big")
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        #expect(FileManager.default.createFile(atPath: folder + "/zeros.bin", contents: nil))
        let handle = try #require(FileHandle(forWritingAtPath: folder + "/zeros.bin"))
        try handle.truncate(atOffset: 256 << 20)
        try handle.close()
        var options = PackOptions(productId: try ProductIdentifier(product), contentVersion: try ContentVersion("1.0"), outputDirectory: tmp.sub("out"))
        options.level = 0
        options.sync = false
        let packed = try ArchivePacker.pack(folder: folder, options: options)
        let (caught, process) = try interrupt(
            productsDirectory() + "/iap-server", ["publish", "--data", tmp.sub("data"), packed.archivePath],
            with: SIGTERM, stderrPath: tmp.sub("stderr.txt")
        ) { leftovers(tmp).contains { $0.hasPrefix("upload-") } }
        try #require(caught, "publish ended before its copy was seen in the uploads folder")
        #expect(process.terminationStatus == 128 + SIGTERM)
        #expect(leftovers(tmp).isEmpty, "left behind: \(leftovers(tmp))")
        #expect(try String(contentsOfFile: tmp.sub("stderr.txt"), encoding: .utf8).contains("iap-server: stopped by SIGTERM"))
        #expect(try await ContentStore(dataDirectory: tmp.sub("data")).database.versions(productId: nil).isEmpty)
    }

    @Test("iap-server catalog on a data folder never published to lists nothing and makes nothing; a data folder that is a file is named as such")
    func catalogOnlyLooks() throws {
        let tmp = try TemporaryFolder()
        let missing = tmp.sub("typo")
        let text = try run(productsDirectory() + "/iap-server", ["catalog", "--data", missing])
        #expect(text.status == 0 && text.stdout.contains("nothing published yet"), "\(text.stdout) \(text.stderr)")
        let json = try run(productsDirectory() + "/iap-server", ["catalog", "--data", missing, "--json"])
        #expect(json.status == 0 && json.jsonArray?.isEmpty == true, "\(json.stdout)")
        #expect(!FileManager.default.fileExists(atPath: missing), "listing the catalog made its data folder")

        let file = try tmp.write("data-file", "not a folder")
        let archive = try packLarge(tmp, version: "1.0", megabytes: 1).archivePath
        let publish = try run(productsDirectory() + "/iap-server", ["publish", "--data", file, archive])
        #expect(publish.status == 3 && publish.stderr.contains("the data folder (--data): \(file) exists and is not a folder"), "\(publish.stderr)")
    }

    @Test("uploads larger than the server's gathered writes are stored byte for byte, in both forms")
    func largeUploadsAreStoredWhole() throws {
        let tmp = try TemporaryFolder()
        let (_, server) = try start(tmp)
        let v1 = try packLarge(tmp, version: "1.0", megabytes: 9), v2 = try packLarge(tmp, version: "1.1", megabytes: 6)
        let put = try curl(
            ["-X", "PUT", "-T", v1.archivePath, "-H", "Authorization: Bearer \(adminToken)", server.base + "/v1/admin/archives"], folder: tmp)
        #expect(put.status == 201, "\(put.text)")
        let form = try multipart(server, tmp, ["archive=@\(v2.archivePath)"])
        #expect(form.status == 201, "\(form.text)")
        for packed in [v1, v2] {
            let stored = tmp.sub("data/archives/\(packed.manifest.archiveSHA256).zip")
            #expect(FileManager.default.contentsEqual(atPath: stored, andPath: packed.archivePath), "\(stored)")
        }
        #expect(leftovers(tmp).isEmpty)
        #expect(server.stop() == 0)
    }

    @Test("multipart uploads: archive and manifest parts are checked like the header form; malformed bodies are refused and leave nothing")
    func multipartUploads() throws {
        let tmp = try TemporaryFolder()
        let (_, server) = try start(tmp)
        let v1 = try pack(tmp, version: "1.0"), v2 = try pack(tmp, version: "1.1")
        let published = try multipart(server, tmp, ["archive=@\(v1.archivePath)", "manifest=@\(v1.manifestPath);type=application/json"])
        #expect(published.status == 201, "\(published.text)")
        #expect(published.json["sha256"] as? String == v1.manifest.archiveSHA256)

        var lying = v2.manifest
        lying.entries[1].sha256 = String(repeating: "0", count: 64)
        let liar = tmp.sub("lying.manifest.json")
        try lying.jsonData().write(to: URL(fileURLWithPath: liar))
        let lie = try multipart(server, tmp, ["archive=@\(v2.archivePath)", "manifest=@\(liar)"])
        #expect(lie.status == 400 && lie.errorCode == "invalid-archive", "\(lie.text)")
        let stray = try multipart(server, tmp, ["archive=@\(v2.archivePath)", "notes=hello"])
        #expect(stray.status == 400 && stray.errorCode == "invalid-multipart" && stray.text.contains("'notes'"))
        let noArchive = try multipart(server, tmp, ["manifest=@\(v2.manifestPath)"])
        #expect(noArchive.status == 400 && noArchive.text.contains("no complete part named 'archive'"))
        let encoded = v2.manifest.jsonData().base64EncodedString().replacingOccurrences(of: "+", with: "-")
            .replacingOccurrences(of: "/", with: "_").replacingOccurrences(of: "=", with: "")
        let twice = try multipart(server, tmp, ["archive=@\(v2.archivePath)", "manifest=@\(v2.manifestPath)"], headers: ["-H", "IAP-Manifest: \(encoded)"])
        #expect(twice.status == 400 && twice.errorCode == "invalid-manifest")
        let mixed = try curl(
            [
                "-X", "PUT", "-H", "Authorization: Bearer \(adminToken)", "-H", "Content-Type: multipart/mixed; boundary=x",
                "--data-binary", "--x\r\n\r\nhi\r\n--x--\r\n", server.base + "/v1/admin/archives",
            ], folder: tmp)
        #expect(mixed.status == 400 && mixed.errorCode == "invalid-multipart")
        // A body cut off inside the archive part, and one whose part headers never end.
        let archiveBytes = try Data(contentsOf: URL(fileURLWithPath: v2.archivePath))
        let cut = "--b\r\nContent-Disposition: form-data; name=\"archive\"\r\n\r\n" + String(decoding: archiveBytes.prefix(1000), as: UTF8.self)
        let truncated = try rawExchange(
            port: server.port,
            "PUT /v1/admin/archives HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \(adminToken)\r\n"
                + "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: \(cut.utf8.count)\r\nConnection: close\r\n\r\n" + cut, folder: tmp)
        #expect(truncated.hasPrefix("HTTP/1.1 400") && truncated.contains("no complete part named 'archive'"), "\(truncated.prefix(300))")
        let endless = "--b\r\nX-Padding: " + String(repeating: "p", count: 100_000)
        let headerFlood = try rawExchange(
            port: server.port,
            "PUT /v1/admin/archives HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \(adminToken)\r\n"
                + "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: \(endless.utf8.count)\r\nConnection: close\r\n\r\n" + endless, folder: tmp)
        #expect(headerFlood.hasPrefix("HTTP/1.1 400") && headerFlood.contains("64 KiB"), "\(headerFlood.prefix(300))")

        #expect(leftovers(tmp).isEmpty, "uploads that failed left files: \(leftovers(tmp))")
        let upgraded = try multipart(server, tmp, ["archive=@\(v2.archivePath)"])
        #expect(upgraded.status == 201, "\(upgraded.text)")
        let info = try curl([server.base + "/v1/products/\(product)"], folder: tmp)
        #expect((info.json["versions"] as? [[String: Any]])?.count == 2)
        #expect(server.stop() == 0)
    }

    @Test("a slow-loris client trickling its request head is cut off; a slow download of a finished head is not")
    func slowClients() throws {
        let tmp = try TemporaryFolder()
        let (server, v1, url) = try grantedDownload(tmp, extra: ["--header-timeout", "2"])
        let script = try tmp.write("loris.py", Self.lorisScript(requestLine: "GET /healthz"))
        let loris = try run("python3", [script, String(server.port)])
        #expect(loris.stdout.contains("closed"), "\(loris.stdout) \(loris.stderr)")

        // A download that takes longer than the header timeout is not cut: the deadline only
        // covers the time to send a request head.
        let slow = try curl(["--limit-rate", "12K", url], folder: tmp)
        #expect(slow.status == 200 && slow.body.count == Int(v1.manifest.archiveSize))
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200)
        #expect(server.stop() == 0)
    }

    @Test("a request body that stalls is cut off after --idle-timeout without a byte; one that keeps coming is read and answered")
    func stalledBodies() throws {
        let tmp = try TemporaryFolder()
        let (_, server) = try start(tmp, extra: ["--idle-timeout", "2", "--header-timeout", "2"])
        // Each connection sends a POST head announcing 64 bytes, then its body at its own pace, and
        // says whether the server answered or closed (nothing within 30 s: "still open").
        let script = try tmp.write(
            "body.py",
            """
            import socket, sys, time
            s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))
            s.sendall(b"POST /v1/downloads HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\nContent-Length: 64\\r\\n\\r\\n{")
            gap = float(sys.argv[2])
            sent, start = 1, time.monotonic()
            s.settimeout(0.1)
            while time.monotonic() - start < 30:
                if gap > 0 and sent < 64 and time.monotonic() - start >= sent * gap:
                    try:
                        s.sendall(b" ")
                        sent += 1
                    except OSError:
                        print("closed"); sys.exit(0)
                try:
                    data = s.recv(200)
                except socket.timeout:
                    continue
                except OSError:
                    print("closed"); sys.exit(0)
                print(data.split(b"\\r\\n")[0].decode() if data else "closed"); sys.exit(0)
            print("still open")
            """)
        let stalled = try run("python3", [script, String(server.port), "0"])
        #expect(stalled.stdout.contains("closed"), "\(stalled.stdout) \(stalled.stderr)")
        // 63 more bytes, one every 0.1 s: 6 s in all, three times the timeout, never 2 s apart.
        let trickled = try run("python3", [script, String(server.port), "0.1"])
        #expect(trickled.stdout.contains("HTTP/1.1 400"), "\(trickled.stdout) \(trickled.stderr)")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200)
        #expect(server.stop() == 0)
    }

    @Test("Expect: 100-continue is answered 100 once a request's head passes its checks; a refused one gets its answer and sends no body")
    func expectContinue() throws {
        let tmp = try TemporaryFolder()
        let (_, server) = try start(tmp)
        let v1 = try pack(tmp, version: "1.0")
        func send(_ arguments: [String]) throws -> ProcessResult {
            // curl -v writes the answers it got to stderr; it sends the body only after a 100 (or after a second).
            try run("curl", ["-s", "-v", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Expect: 100-continue"] + arguments)
        }
        let url = server.base + "/v1/admin/archives"
        let uploaded = try send(["-T", v1.archivePath, "-H", "Authorization: Bearer \(adminToken)", url])
        #expect(uploaded.stdout == "201" && uploaded.stderr.contains("< HTTP/1.1 100 Continue"), "\(uploaded.stderr)")
        let refused = try send(["-T", v1.archivePath, "-H", "Authorization: Bearer wrong-wrong-wrong-wrong", url])
        #expect(refused.stdout == "401" && !refused.stderr.contains("100 Continue"), "\(refused.stderr)")
        let tooLarge = try send(["-X", "PUT", "-H", "Content-Length: 3000000000", "-H", "Authorization: Bearer \(adminToken)", "--data-binary", "x", url])
        #expect(tooLarge.stdout == "413" && !tooLarge.stderr.contains("100 Continue"), "\(tooLarge.stderr)")
        let grant = try send(["-H", "Content-Type: application/json", "--data-binary", "{\"signedTransaction\": \"a.b.c\"}", server.base + "/v1/downloads"])
        #expect(grant.stdout == "400" && grant.stderr.contains("< HTTP/1.1 100 Continue"), "\(grant.stderr)")
        // An HTTP/1.0 client cannot read an interim answer: its expectation is ignored (RFC 9110 §10.1.1).
        let old = try send(["-0", "-H", "Content-Type: application/json", "--data-binary", "{\"signedTransaction\": \"a.b.c\"}", server.base + "/v1/downloads"])
        #expect(old.stdout == "400" && !old.stderr.contains("100 Continue"), "\(old.stderr)")
        #expect(server.stop() == 0)
    }

    @Test("a full disk: uploads get 507 and notifications 503, nothing half-applied; once space is back both work")
    func fullDisk() async throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp)
        let v1 = try pack(tmp, version: "1.0"), v2 = try pack(tmp, version: "1.1")
        #expect(try multipart(server, tmp, ["archive=@\(v1.archivePath)"]).status == 201)
        let purchase = try store.purchase(productId: product)
        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        // The kernel's file-size limit on the running server makes every write fail as a full disk would.
        #expect(try run("prlimit", ["--pid", String(server.process.processIdentifier), "--fsize=1:unlimited"]).status == 0)
        let upload = try multipart(server, tmp, ["archive=@\(v2.archivePath)"])
        #expect(upload.status == 507 && upload.errorCode == "insufficient-storage", "\(upload.text)")
        let notified = try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp)
        #expect(notified.status == 503 && notified.errorCode == "storage", "\(notified.text)")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200, "the server stays up")
        #expect(try curl([server.base + "/v1/products/\(product)"], folder: tmp).status == 200)

        #expect(try run("prlimit", ["--pid", String(server.process.processIdentifier), "--fsize=unlimited:unlimited"]).status == 0)
        #expect(leftovers(tmp).isEmpty)
        #expect(try await ContentStore(dataDirectory: tmp.sub("data")).notificationCount() == 0, "the refused notification left no trace")
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        let cut = try postJSON(server.base + "/v1/downloads", ["signedTransaction": purchase.signedTransaction], folder: tmp)
        #expect(cut.status == 403 && cut.errorCode == "revoked")
        #expect(try multipart(server, tmp, ["archive=@\(v2.archivePath)"]).status == 201)
        #expect(server.stop() == 0)
    }

    @Test(
        "an archive the server's user cannot read: 503 archive-damaged naming the permission (not 404, which a device takes for gone), /readyz and check as that user say so; readable again, it is served"
    )
    func unreadableArchive() throws {
        let tmp = try TemporaryFolder()
        var (store, server) = try start(tmp)
        let v1 = try pack(tmp, version: "1.0")
        #expect(try multipart(server, tmp, ["archive=@\(v1.archivePath)"]).status == 201)
        let purchase = try store.purchase(productId: product)
        #expect(server.stop() == 0)
        // Root reads any file, so the server runs as nobody, and the archive is made unreadable to it.
        #expect(try run("chown", ["-R", "65534:65534", tmp.path]).status == 0)
        let archive = tmp.sub("data/archives/\(v1.manifest.archiveSHA256).zip")
        #expect(chmod(archive, 0o000) == 0)
        let asNobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        (store, server) = try start(tmp, launcher: asNobody)
        let granted = try postJSON(server.base + "/v1/downloads", ["signedTransaction": purchase.signedTransaction], folder: tmp)
        let url = try #require((granted.json["downloads"] as? [[String: Any]])?.first?["url"] as? String)
        let refused = try curl([url], folder: tmp)
        #expect(refused.status == 503 && refused.errorCode == "archive-damaged", "\(refused.status) \(refused.text)")
        let ready = try curl([server.base + "/readyz"], folder: tmp)
        #expect(ready.status == 503 && ready.text.contains("Permission denied"), "\(ready.text)")
        let check = try run("setpriv", Array(asNobody.dropFirst()) + [productsDirectory() + "/iap-server", "check", "--data", tmp.sub("data")])
        #expect(check.status == 1 && check.stdout.contains("cannot read \(archive): Permission denied"), "\(check.stdout) \(check.stderr)")
        let log = try String(contentsOfFile: server.log, encoding: .utf8)
        #expect(log.contains("\(archive) cannot be read (Permission denied): give the server's user read access to it"))

        #expect(chmod(archive, 0o444) == 0)
        #expect(try curl([url], folder: tmp).body == (try Data(contentsOf: URL(fileURLWithPath: v1.archivePath))))
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200)
        #expect(server.stop() == 0)
    }

    @Test("a read-only catalog: the server starts, reads work, writes get 503 naming the fix, and nothing is lost")
    func readOnlyCatalog() throws {
        let tmp = try TemporaryFolder()
        var (store, server) = try start(tmp)
        let v1 = try pack(tmp, version: "1.0"), v2 = try pack(tmp, version: "1.1")
        #expect(try multipart(server, tmp, ["archive=@\(v1.archivePath)"]).status == 201)
        let purchase = try store.purchase(productId: product)
        #expect(server.stop() == 0)
        // Root writes any file, so the server runs as nobody over a catalog it may not write.
        #expect(try run("chown", ["-R", "65534:65534", tmp.path]).status == 0)
        #expect(chmod(tmp.sub("data/catalog.sqlite"), 0o444) == 0)
        (store, server) = try start(tmp, launcher: ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
        let info = try curl([server.base + "/v1/products/\(product)"], folder: tmp)
        #expect(info.status == 200 && (info.json["versions"] as? [[String: Any]])?.count == 1)
        let upload = try multipart(server, tmp, ["archive=@\(v2.archivePath)"])
        #expect(upload.status == 503 && upload.text.contains("writable"), "\(upload.text)")
        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        let notified = try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp)
        #expect(notified.status == 503 && notified.text.contains("writable"), "\(notified.text)")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200)
        #expect(leftovers(tmp).isEmpty)
        #expect(server.stop() == 0)

        #expect(chmod(tmp.sub("data/catalog.sqlite"), 0o644) == 0)
        (_, server) = try start(tmp)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        #expect(try multipart(server, tmp, ["archive=@\(v2.archivePath)"]).status == 201)
        let after = try curl([server.base + "/v1/products/\(product)"], folder: tmp)
        #expect((after.json["versions"] as? [[String: Any]])?.count == 2, "what was published before is still there")
        #expect(server.stop() == 0)
    }
}

extension HardeningTests {
    @Test("a download in flight when the server is told to stop (SIGTERM) finishes before the server exits")
    func shutdownDrainsDownloads() throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp)
        // 24 MiB stored: more than loopback socket buffers hold, so the server is still sending
        // when it is told to stop.
        let noise = try #require(FileHandle(forReadingAtPath: "/dev/urandom")?.readData(ofLength: 24 << 20))
        _ = try tmp.write("big/noise.bin", noise)
        let big = try ArchivePacker.pack(
            folder: tmp.sub("big"),
            options: .init(
                productId: try ProductIdentifier("com.example.big"), contentVersion: try ContentVersion("1.0"),
                outputDirectory: tmp.sub("out-big"), level: 0))
        let upload = ["-X", "PUT", "-T", big.archivePath, "-H", "Authorization: Bearer \(adminToken)", server.base + "/v1/admin/archives"]
        #expect(try curl(upload, folder: tmp).status == 201)
        let purchase = try store.purchase(productId: "com.example.big")
        let grant = try postJSON(server.base + "/v1/downloads", ["signedTransaction": purchase.signedTransaction], folder: tmp)
        let url = try #require((grant.json["downloads"] as? [[String: Any]])?.first?["url"] as? String)

        // One download answered by the fast path, one by the HTTP/1 pipeline behind it (the
        // connection is handed over by a first, non-content request).
        let outputs = [tmp.sub("fast.zip"), tmp.sub("pipeline.zip")]
        let clients = try [
            ["-o", outputs[0], url],
            ["-o", "/dev/null", server.base + "/healthz", "-o", outputs[1], url],
        ].map { arguments in try launch("curl", ["-sS", "--fail", "--limit-rate", "8M"] + arguments) }
        // Told to stop once both have their first megabyte.
        func size(_ path: String) -> Int { ((try? FileManager.default.attributesOfItem(atPath: path)[.size]) as? Int) ?? 0 }
        let deadline = Date().addingTimeInterval(20)
        while Date() < deadline, outputs.contains(where: { size($0) < 1 << 20 }) { usleep(10_000) }
        kill(server.process.processIdentifier, SIGTERM)
        for (client, output) in zip(clients, outputs) {
            let clientDeadline = Date().addingTimeInterval(30)
            while client.isRunning && Date() < clientDeadline { usleep(20_000) }
            forceStop(client)
            #expect(client.terminationStatus == 0, "curl was cut off: \(output)")
            #expect(FileManager.default.contentsEqual(atPath: output, andPath: big.archivePath), "\(output)")
        }
        #expect(server.stop() == 0)
    }
}

extension HardeningTests {
    /// `iap-server serve` on `tmp`'s data and sandbox root with `arguments`, expected to refuse
    /// to start. Bounded (coreutils' timeout): a server that started by mistake never exits.
    func refusedServe(_ tmp: TemporaryFolder, _ arguments: [String], environment: [String: String]? = nil) throws -> ProcessResult {
        try run(
            "timeout",
            [
                "30", productsDirectory() + "/iap-server", "serve", "--data", tmp.sub("data"), "--bundle-id", bundleId, "--trust-root",
                tmp.sub("sandbox") + "/root.cer", "--environment", "sandbox",
            ] + arguments, environment: environment)
    }

    /// The (tid, timeslices run) of each thread of `pid` whose name starts with `prefix`.
    func threads(of pid: Int32, named prefix: String) -> [(tid: String, slices: Int)] {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")) ?? []
        return tasks.sorted().compactMap { tid in
            let comm = (try? String(contentsOfFile: "/proc/\(pid)/task/\(tid)/comm", encoding: .utf8)) ?? ""
            guard comm.hasPrefix(prefix), let stat = try? String(contentsOfFile: "/proc/\(pid)/task/\(tid)/schedstat", encoding: .utf8),
                let slices = stat.split(separator: " ").last.flatMap({ Int($0.trimmingCharacters(in: .whitespacesAndNewlines)) })
            else { return nil }
            return (tid, slices)
        }
    }

    @Test("--event-loops 1 serves every connection from one thread of its own and stops cleanly; a bad count is refused by name")
    func eventLoops() throws {
        let tmp = try TemporaryFolder()
        let (server, _, url) = try grantedDownload(tmp, extra: ["--event-loops", "1"])
        // NIO names the threads of a group it was asked for NIO-ELT-…, the shared group's NIO-SGLTN-….
        let loops = threads(of: server.process.processIdentifier, named: "NIO-ELT-")
        try #require(loops.count == 1, "\(loops)")
        for i in 0..<20 {
            let part = try curl(["-r", "\(i * 100)-\(i * 100 + 99)", url], folder: tmp)
            #expect(part.status == 206 && part.body.count == 100)
        }
        // Each new connection woke the loop at least once: it is the one serving them.
        let after = threads(of: server.process.processIdentifier, named: "NIO-ELT-")
        #expect(after.count == 1 && after[0].slices - loops[0].slices >= 20, "\(loops) then \(after)")
        #expect(server.stop() == 0)

        // A count taken by mistake would start a server whose output does not name the option.
        for bad in ["0", "many", "5000"] {
            let refused = try refusedServe(tmp, ["--event-loops", bad])
            #expect(refused.status != 0 && refused.stderr.contains("--event-loops"), "\(bad): \(refused.stderr)")
        }
        let fromEnvironment = try refusedServe(tmp, [], environment: ["IAP_EVENT_LOOPS": "-1"])
        #expect(fromEnvironment.status != 0 && fromEnvironment.stderr.contains("IAP_EVENT_LOOPS"), "\(fromEnvironment.stderr)")
    }

    @Test("out of file descriptors, the server says so in its log and metrics, keeps listening and serves again once connections close; its soft open-file limit is raised to the hard one")
    func openFileLimit() throws {
        let tmp = try TemporaryFolder()
        // Soft and hard limits both 64: nothing to raise, and 120 connections exhaust it. Two
        // loops whatever the cores: each loop holds descriptors of its own.
        let (_, server) = try start(tmp, extra: ["--event-loops", "2"], launcher: ["prlimit", "--nofile=64:64", "--"])
        let release = tmp.sub("release")
        let flood = try launch(
            "python3",
            [
                "-c",
                """
                import os, socket, sys, time
                held = [socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5) for _ in range(120)]
                deadline = time.monotonic() + 30
                while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline: time.sleep(0.05)
                for s in held: s.close()
                """,
                "\(server.port)", release,
            ])
        let warning = "cannot accept connections: this process has reached its open-file limit (64)"
        let deadline = Date().addingTimeInterval(30)
        func logged() -> Bool { ((try? String(contentsOfFile: server.log, encoding: .utf8)) ?? "").contains(warning) }
        while !logged() && Date() < deadline && flood.isRunning { usleep(50_000) }
        #expect(logged(), "\((try? String(contentsOfFile: server.log, encoding: .utf8)) ?? "")")
        _ = FileManager.default.createFile(atPath: release, contents: nil)
        flood.waitUntilExit()
        #expect(flood.terminationStatus == 0, "the kernel queued every connection")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200, "served again once the connections closed")
        let metrics = try curl([server.base + "/metrics"], folder: tmp).text
        let failures = metrics.split(separator: "\n").first { $0.hasPrefix("iap_accept_failures_total{reason=\"process-limit\"}") }
        #expect(failures.flatMap { $0.split(separator: " ").last.flatMap { Int($0) } }.map { $0 >= 1 } == true, "\(failures ?? "no counter")")
        #expect(server.stop() == 0)

        // A soft limit under the hard one is raised to it.
        let raised = try TemporaryFolder()
        let (_, second) = try start(raised, launcher: ["prlimit", "--nofile=64:4096", "--"])
        let limits = try String(contentsOfFile: "/proc/\(second.process.processIdentifier)/limits", encoding: .utf8)
        let openFiles = limits.split(separator: "\n").first { $0.hasPrefix("Max open files") }?.split(separator: " ", omittingEmptySubsequences: true)
        #expect(openFiles.map { Array($0.suffix(3)) } == ["4096", "4096", "files"], "\(limits)")
        #expect(second.stop() == 0)
    }

    @Test("download URLs start with --public-url less its trailing slash; listening on all addresses without one is warned about")
    func publicURL() throws {
        let tmp = try TemporaryFolder()
        let (server, _, url) = try grantedDownload(tmp, extra: ["--public-url", "https://cdn.example.com/"])
        #expect(url.hasPrefix("https://cdn.example.com/v1/content/"), "\(url)")
        let log = try String(contentsOfFile: server.log, encoding: .utf8)
        #expect(!log.contains("which no device can reach"), "\(log)")
        #expect(server.stop() == 0)

        let open = try TemporaryFolder()
        let (_, everywhere) = try start(open, extra: ["--host", "0.0.0.0"])
        #expect(try curl([everywhere.base + "/healthz"], folder: open).status == 200)
        let warned = try String(contentsOfFile: everywhere.log, encoding: .utf8)
        #expect(warned.contains("download URLs will name http://0.0.0.0:<port>, which no device can reach: give --public-url"), "\(warned)")
        #expect(everywhere.stop() == 0)
    }

    @Test("a port in use, an address not of this machine, an unresolvable host, a non-number in a numeric variable and a base URL without a scheme are refused by name")
    func listenAndNumberErrors() throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp)
        let port = server.port
        for (arguments, message) in [
            (["--port", "\(port)"], "port \(port) on 127.0.0.1 is in use by another process"),
            (["--port", "\(port)", "--event-loops", "1"], "port \(port) on 127.0.0.1 is in use by another process"),
            // TEST-NET-1 (RFC 5737): never an address of this machine.
            (["--host", "192.0.2.1", "--port", "0"], "192.0.2.1 is not an address of this machine"),
            (["--host", "nosuch.invalid", "--port", "0"], "cannot resolve --host nosuch.invalid"),
        ] {
            let refused = try refusedServe(tmp, arguments)
            #expect(refused.status == 1 && refused.stderr.contains(message), "\(arguments): \(refused.stderr)")
            #expect(!refused.stderr.contains("errno"), "\(refused.stderr)")
        }
        // The sandbox's App Store Server API says the same of a port in use.
        let sandbox = try run("timeout", ["30", productsDirectory() + "/iap-sandbox", "serve", "--dir", store.folder, "--port", "\(port)"])
        #expect(sandbox.status == 1 && sandbox.stderr.contains("port \(port) on 127.0.0.1 is in use by another process"), "\(sandbox.stderr)")
        for (variable, value, flag) in [("IAP_PORT", "80a", "--port"), ("IAP_TOKEN_TTL", "1h", "--token-ttl"), ("IAP_HEADER_TIMEOUT", "ten", "--header-timeout")] {
            // The flag would win over the variable.
            let refused = try refusedServe(tmp, variable == "IAP_PORT" ? [] : ["--port", "0"], environment: [variable: value])
            #expect(refused.status != 0 && refused.stderr.contains("\(flag) (\(variable))") && refused.stderr.contains("'\(value)'"), "\(variable): \(refused.stderr)")
        }
        for (flag, value) in [("--public-url", "content.example.com"), ("--public-url", "https://x.example.com/?a=1"), ("--advertise-url", "10.0.0.5:8080")] {
            let refused = try refusedServe(tmp, ["--port", "0", flag, value])
            #expect(refused.status != 0 && refused.stderr.contains("\(flag) (") && refused.stderr.contains("http(s) URL"), "\(flag) \(value): \(refused.stderr)")
        }
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200, "the running server kept its port")
        #expect(server.stop() == 0)
    }

    @Test(
        "a bundle id that cannot be one (empty, a stray space from an environment file, an empty part, a slash) is refused by name before anything starts or is made: serve, verify and iap-sandbox init"
    )
    func bundleIdentifiers() throws {
        let tmp = try TemporaryFolder()
        let server = productsDirectory() + "/iap-server"
        let cases: [([String], [String: String]?, String)] = [
            (["--bundle-id", ""], nil, "--bundle-id '' is not a bundle identifier: it is empty"),
            ([], ["IAP_BUNDLE_ID": "com.example.app "], "IAP_BUNDLE_ID 'com.example.app ' is not a bundle identifier: it holds whitespace"),
            (["--bundle-id", "com..example"], nil, "it has an empty part between periods"),
        ]
        for (arguments, environment, says) in cases {
            let refused = try run("timeout", ["30", server, "serve", "--data", tmp.sub("data"), "--port", "0"] + arguments, environment: environment)
            #expect(refused.status == 64 && refused.stderr.contains(says) && refused.stderr.contains("such as com.example.app"), "\(arguments): \(refused.stderr)")
        }
        #expect(!FileManager.default.fileExists(atPath: tmp.sub("data")), "a refused start made its data folder")

        let jws = try tmp.write("t.jws", "a.b.c")
        let verify = try run(server, ["verify", jws, "--bundle-id", "com.example/app"])
        #expect(verify.status == 64 && verify.stderr.contains("it holds '/'"), "\(verify.stderr)")

        let sandbox = productsDirectory() + "/iap-sandbox"
        let refusedInit = try run(sandbox, ["init", "--dir", tmp.sub("store"), "--bundle-id", "\tcom.example.app"])
        #expect(refusedInit.status == 64 && refusedInit.stderr.contains("it holds whitespace"), "\(refusedInit.stderr)")
        #expect(!FileManager.default.fileExists(atPath: tmp.sub("store")))
        // Letters, digits, '-', '.' and the '_' some older apps carry are taken.
        let taken = try run(sandbox, ["init", "--dir", tmp.sub("store"), "--bundle-id", "com.Example-2.my_app"])
        #expect(taken.status == 0, "\(taken.stderr)")
    }
}

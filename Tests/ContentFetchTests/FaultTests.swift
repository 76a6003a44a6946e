import ContentArchive
import ContentFetch
import DownloadGrants
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@Suite("iap-fetch under faults", .serialized, .onTestThreads)
struct FaultTests {
    let product = "com.example.big"

    /// A shop with one 12 MiB product, bought.
    struct Setup {
        let shop: Shop
        let transactionId: String
        var tmp: TemporaryFolder { shop.tmp }
        var store: SandboxStore { shop.store }
        var server: ServerProcess { shop.server }
        var payload: Data { shop.payloads["com.example.big"]! }
        var content: String { shop.content }
        var queue: String { shop.queue }
        var downloadId: String { "\(transactionId)-com.example.big" }
    }

    /// A 12 MiB product bought and half-downloaded: the client was stopped with `signal` once
    /// 4 MiB were recorded (SIGKILL by default).
    func halfDownloaded(signal: Int32 = SIGKILL, serverArguments: [String] = [], exitStatus: UnsafeMutablePointer<Int32>? = nil) throws -> Setup {
        let shop = try Shop(products: [product: .random(12 << 20)], serverArguments: serverArguments)
        let setup = Setup(shop: shop, transactionId: try shop.store.purchase(productId: product).transaction.transactionId!)
        let (client, _) = try shop.startClient(["--limit-rate", "4M"])
        let journal = try DownloadJournal(contentDirectory: setup.content)
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline, (journal.load(setup.downloadId)?.recordedLength ?? 0) < 4 << 20 { usleep(2_000) }
        kill(client.processIdentifier, signal)
        client.waitUntilExit()
        exitStatus?.pointee = client.terminationStatus
        #expect((journal.load(setup.downloadId)?.recordedLength ?? 0) >= 4 << 20)
        return setup
    }

    func fetch(_ s: Setup, prefix: [String] = []) throws -> ProcessResult {
        try s.shop.fetch(prefix: prefix)
    }

    func finishedAt(_ s: Setup) throws -> Date? { try FileTransactionQueue(folder: s.queue).transaction(s.transactionId)?.finishedAt }

    func installedPayload(_ s: Setup) -> Data? { s.shop.installed(product) }

    @Test("a grant that expired while the client was away is renewed, and the download continues")
    func expiredGrant() throws {
        let s = try halfDownloaded()
        let journal = try DownloadJournal(contentDirectory: s.content)
        var record = try #require(journal.load(s.downloadId))
        let keys = try GrantKeyRing.loadOrCreate(path: s.tmp.sub("data/grant-keys.json"))
        let expired = keys.mint(
            Grant(
                transactionId: s.transactionId, productId: product, contentVersion: "1.0", sha256: record.sha256,
                expiresAt: Int64(Date().timeIntervalSince1970) - 60))
        record.url = s.server.base + "/v1/content/\(expired)/x.zip"
        try journal.save(record)
        let result = try fetch(s)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(installedPayload(s) == s.payload)
        #expect(try finishedAt(s) != nil)
    }

    @Test("corrupted bytes on disk fail the SHA-256 check: fetched again from the damaged chunk, never installed or finished corrupt")
    func corruption() throws {
        let s = try halfDownloaded()
        let partial = try DownloadJournal(contentDirectory: s.content).partialPath(s.downloadId)
        let handle = try #require(FileHandle(forUpdatingAtPath: partial))
        try handle.seek(toOffset: 3_500_000)
        let byte = try #require(try handle.read(upToCount: 1)).first!
        try handle.seek(toOffset: 3_500_000)
        try handle.write(contentsOf: Data([byte ^ 0xFF]))
        try handle.close()
        let result = try fetch(s)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stdout.contains("\"integrity\""), "the mismatch was not reported")
        // The manifest's chunk hashes locate the damage: only what follows the damaged 1 MiB chunk
        // (the fourth of payload.bin) is fetched again.
        let payload = try #require(s.shop.manifests[product]?.entries.first { $0.path == "Contents/payload.bin" })
        #expect(result.stdout.contains("fetching again from byte \(payload.dataOffset + 3 << 20),"), "\(result.stdout)")
        #expect(installedPayload(s) == s.payload)
        #expect(try finishedAt(s) != nil)
    }

    @Test("a refund during the download ends it with the reason and deletes its bytes; nothing is installed and the transaction stays unfinished")
    func refundMidDownload() throws {
        let s = try halfDownloaded()
        let journal = try DownloadJournal(contentDirectory: s.content)
        #expect(FileManager.default.fileExists(atPath: journal.partialPath(s.downloadId)))
        #expect(FileManager.default.fileExists(atPath: journal.manifestPath(s.downloadId)))
        let refund = try s.store.refund(transactionId: s.transactionId)
        #expect(try postJSON(s.server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: s.tmp).status == 200)
        let result = try fetch(s)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stderr.contains("refunded or revoked"))
        // The download observers saw ends, failed with the reason's code.
        let updates = result.stdout.split(separator: "\n").compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
        #expect(updates.contains { $0["state"] as? String == "failed" && ($0["error"] as? [String: Any])?["code"] as? String == "revoked" }, "\(result.stdout)")
        #expect(installedPayload(s) == nil)
        #expect(try finishedAt(s) == nil)
        // The 4 MiB and more already fetched would only wait for a refund reversal.
        let record = try #require(journal.load(s.downloadId))
        #expect(record.state == .failed && record.error?.code == .revoked && record.recordedLength == 0)
        #expect(!FileManager.default.fileExists(atPath: journal.partialPath(s.downloadId)))
        #expect(!FileManager.default.fileExists(atPath: journal.manifestPath(s.downloadId)))
    }

    @Test("the archive's disk blocks are reserved before its bytes are fetched: a killed download holds them, its file only as long as what was written")
    func reservesSpace() throws {
        let s = try halfDownloaded()
        let journal = try DownloadJournal(contentDirectory: s.content)
        let record = try #require(journal.load(s.downloadId))
        var status = stat()
        #expect(stat(journal.partialPath(s.downloadId), &status) == 0)
        #expect(Int64(status.st_size) < record.expectedLength)
        #expect(Int64(status.st_blocks) * 512 >= record.expectedLength, "\(status.st_blocks) blocks of 512 bytes")
        let result = try fetch(s)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(installedPayload(s) == s.payload)
    }

    @Test("Ctrl-C pauses: journal saved, state paused, exit 130; the next run resumes")
    func interrupt() throws {
        var status: Int32 = 0
        let s = try halfDownloaded(signal: SIGINT, exitStatus: &status)
        #expect(status == 130)
        let record = try #require(try DownloadJournal(contentDirectory: s.content).load(s.downloadId))
        #expect(record.state == .paused)
        #expect(try finishedAt(s) == nil)
        let result = try fetch(s)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(installedPayload(s) == s.payload)
    }

    /// A proxy in front of the server that answers the first grant request and the first request
    /// for an archive 503 with `Retry-After: 2`, passes everything else through, and logs each request's
    /// time, method, path and answer.
    static let busyProxy = """
        import http.client, http.server, sys, time
        upstream, port, log = int(sys.argv[1]), int(sys.argv[2]), open(sys.argv[3], "a", buffering=1)
        refused = set()
        class Proxy(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            def log_message(self, *args): pass
            def handle_one(self):
                kind = "grant" if self.path.startswith("/v1/downloads") else "archive" if self.path.endswith(".zip") else "other"
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if kind != "other" and kind not in refused:
                    refused.add(kind)
                    log.write(f"{time.monotonic()} {kind} 503\\n")
                    self.send_response(503); self.send_header("Retry-After", "2"); self.send_header("Content-Length", "0"); self.end_headers()
                    return
                log.write(f"{time.monotonic()} {kind} pass\\n")
                connection = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                connection.request(self.command, self.path, body=body or None, headers=headers)
                answer = connection.getresponse()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"): self.send_header(k, v)
                self.end_headers()
                while chunk := answer.read(1 << 16): self.wfile.write(chunk)
            do_GET = do_POST = do_HEAD = handle_one
        http.server.ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()
        """

    @Test("a server that answers 503 with Retry-After is asked again when it said, for the grant and for the archive")
    func retryAfter() async throws {
        let proxyPort = try freePort()
        let shop = try Shop(products: [product: .random(2 << 20)], serverArguments: ["--public-url", "http://127.0.0.1:\(proxyPort)"])
        let id = try shop.store.purchase(productId: product).transaction.transactionId!
        let script = try shop.tmp.write("proxy.py", Self.busyProxy)
        let log = shop.tmp.sub("proxy.log")
        let proxy = try launch("python3", [script, String(shop.server.port), String(proxyPort), log])
        defer { forceStop(proxy) }
        let up = await waitUntil(.seconds(10)) { (try? curl(["http://127.0.0.1:\(proxyPort)/healthz"], folder: shop.tmp).status) == 200 }
        #expect(up != nil, "the proxy did not start")

        let result = try run(
            productsDirectory() + "/iap-fetch",
            ["run", "--server", "http://127.0.0.1:\(proxyPort)", "--queue", shop.queue, "--content-dir", shop.content, "--json"])
        #expect(result.status == 0, "\(result.stderr)")
        #expect(shop.installed(product) == shop.payloads[product])
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(id)?.finishedAt != nil)
        #expect(result.stdout.contains("the server is unavailable for now (503)") && result.stdout.contains("trying again in 2 s, as it asked"), "\(result.stdout)")
        // Each refused kind was asked again no sooner than the server said (the backoff alone waits 0.25-0.5 s).
        let lines = try String(contentsOfFile: log, encoding: .utf8).split(separator: "\n").map { $0.split(separator: " ") }
        for kind in ["grant", "archive"] {
            let times = lines.filter { $0[1] == Substring(kind) }.compactMap { Double($0[0]) }
            try #require(times.count >= 2, "\(kind): \(lines)")
            #expect(times[1] - times[0] >= 2, "\(kind) asked again after \(times[1] - times[0]) s")
        }
    }

    @Test("the server restarting mid-download: the client retries and completes with identical bytes")
    func serverRestart() throws {
        let s = try halfDownloaded()
        let (client, _) = try s.shop.startClient(["--limit-rate", "4M"])
        let journal = try DownloadJournal(contentDirectory: s.content)
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline, (journal.load(s.downloadId)?.recordedLength ?? 0) < 8 << 20 { usleep(2_000) }
        // Kill the server without warning and start it again on the same port.
        try s.server.killKeepingPort()
        let again = try ServerProcess(
            data: s.tmp.sub("data"), arguments: s.shop.serverArguments + ["--port", String(s.server.port)],
            folder: s.tmp, fixedPort: true)
        #expect(again.port == s.server.port)
        client.waitUntilExit()
        #expect(client.terminationStatus == 0)
        #expect(installedPayload(s) == s.payload)
        #expect(try finishedAt(s) != nil)
        #expect(again.stop() == 0)
    }

    @Test("a server down for longer than five tries take: the client keeps trying it, and completes once it is back")
    func serverDownForAWhile() throws {
        let s = try halfDownloaded()
        try s.server.killKeepingPort()
        let outPath = s.tmp.sub("updates.ndjson")
        _ = FileManager.default.createFile(atPath: outPath, contents: nil)
        let out = try #require(FileHandle(forWritingAtPath: outPath))
        defer { try? out.close() }
        let client = try launch(
            productsDirectory() + "/iap-fetch", ["run", "--server", s.server.base, "--queue", s.queue, "--content-dir", s.content, "--json"], stdout: out)
        defer { if client.isRunning { kill(client.processIdentifier, SIGKILL) } }
        // Refused more often than the five attempts a download gets for other errors: before,
        // the download failed here.
        func refusals() -> Int {
            let text = (try? String(contentsOfFile: outPath, encoding: .utf8)) ?? ""
            return text.split(separator: "\n").filter { $0.contains("\"waiting\"") && $0.lowercased().contains("connection refused") }.count
        }
        let deadline = Date().addingTimeInterval(50)
        while client.isRunning, Date() < deadline, refusals() < 6 { usleep(20_000) }
        #expect(client.isRunning, "iap-fetch gave up while the server was down")
        #expect(refusals() >= 6)
        let again = try ServerProcess(
            data: s.tmp.sub("data"), arguments: s.shop.serverArguments + ["--port", String(s.server.port)], folder: s.tmp, fixedPort: true)
        client.waitUntilExit()
        #expect(client.terminationStatus == 0)
        #expect(installedPayload(s) == s.payload)
        #expect(try finishedAt(s) != nil)
        #expect(again.stop() == 0)
    }

    @Test(
        "a server down through the whole patience fails the transactions running then, which wait it out side by side; the others fail at once with that reason; the next run fetches them"
    )
    func unreachableForTheWholeRun() async throws {
        let (shop, _) = try Shop.everyOneBought(["com.example.a", "com.example.b", "com.example.c"], size: 1 << 20)
        try shop.server.killKeepingPort()
        var configuration = FetchConfiguration(server: shop.server.base, contentDirectory: shop.content)
        configuration.unreachablePatience = .seconds(2)
        configuration.parallelDownloads = 2
        let fetcher = try ContentFetcher(configuration: configuration, source: try FileTransactionQueue(folder: shop.queue))
        let summary = await fetcher.start()
        #expect(summary.finished.isEmpty)
        let messages = summary.failed.map(\.error.message)
        #expect(messages.count == 3, "\(messages)")
        #expect(messages.allSatisfy { $0.contains("cannot reach \(shop.server.base): connection refused") }, "\(messages)")
        // The two that ran at once each waited; the third, after them, did not wait again.
        #expect(messages.filter { $0.contains("tried for 2 s for an earlier transaction of this run") }.count == 1, "\(messages)")
        let again = try ServerProcess(
            data: shop.tmp.sub("data"), arguments: shop.serverArguments + ["--port", String(shop.server.port)], folder: shop.tmp, fixedPort: true)
        let second = await fetcher.start()
        #expect(second.failed.isEmpty, "\(second.failed.map(\.error.message))")
        #expect(second.finished.count == 3)
        await fetcher.shutdown()
        #expect(again.stop() == 0)
    }

    @Test("a full disk fails the download cleanly: nothing half-installed, transaction unfinished, resumable afterwards")
    func diskFull() throws {
        let s = try halfDownloaded()
        // A file-size limit (in 512-byte blocks, 6 MiB) makes the kernel refuse further writes, as a full disk does.
        let full = try fetch(s, prefix: ["ulimit -f 12288"])
        #expect(full.status == 1, "\(full.stderr)")
        #expect(full.stderr.contains("free disk space") || full.stderr.contains("cannot write"))
        #expect(installedPayload(s) == nil)
        #expect(!FileManager.default.fileExists(atPath: s.content + "/com.example.big/1.0"))
        #expect(try finishedAt(s) == nil)
        let again = try fetch(s)
        #expect(again.status == 0, "\(again.stderr)")
        #expect(installedPayload(s) == s.payload)
    }
}

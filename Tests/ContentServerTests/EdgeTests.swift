import ContentArchive
import Foundation
import IAPProtocol
import IAPTestSupport
import SandboxStore
import Testing

/// The shipped nginx configuration in front of replicas on PostgreSQL: the edge serves repeated
/// bytes from its cache, yet every request's grant is checked by a replica.
@Suite("nginx in front of replicas", .serialized, .onTestThreads)
struct EdgeTests {
    let product = "com.example.edge.pack"
    let adminToken = ReplicaFixture.adminToken

    struct Edge {
        let tmp: TemporaryFolder
        let sandbox: SandboxStore
        let replicas: [ServerProcess]
        let nginx: NginxServer
        let archive: PackResult
    }

    /// Three replicas (download URLs naming the edge), nginx in front, and a published archive of
    /// `megabytes` MiB of incompressible content, uploaded through the edge.
    func edge(megabytes: Int, http: String = "") async throws -> Edge {
        let tmp = try TemporaryFolder()
        let url = try await PostgresServer.shared().createDatabase()
        let sandbox = try ReplicaFixture.sandbox(tmp)
        let edgePort = try freePort()
        let replicas = try (0..<3).map { index in
            try ReplicaFixture.replica(tmp, "replica-\(index)", sandbox: sandbox, databaseURL: url, extra: ["--public-url", "http://127.0.0.1:\(edgePort)"])
        }
        let nginx = try NginxServer(replicaPorts: replicas.map(\.port), folder: tmp, port: edgePort, http: http)
        let random = try #require(FileHandle(forReadingAtPath: "/dev/urandom")).readData(ofLength: megabytes << 20)
        try tmp.write("content/data/blob.bin", random)
        try tmp.write("content/readme.txt", "edge test\n")
        let archive = try ArchivePacker.pack(
            folder: tmp.sub("content"),
            options: .init(productId: try ProductIdentifier(product), contentVersion: try ContentVersion("1.0"), outputDirectory: tmp.sub("out")))
        let published = try curl(
            ["-X", "PUT", "-T", archive.archivePath, "-H", "Authorization: Bearer \(adminToken)", nginx.base + "/v1/admin/archives"], folder: tmp)
        #expect(published.status == 201, "\(published.text)")
        return Edge(tmp: tmp, sandbox: sandbox, replicas: replicas, nginx: nginx, archive: archive)
    }

    /// Archive bytes the replicas sent, from their own metrics.
    func bytesFromReplicas(_ edge: Edge) throws -> Int {
        try edge.replicas.reduce(0) { total, replica in
            let text = try curl([replica.base + "/metrics"], folder: edge.tmp).text
            let values = text.split(separator: "\n").filter { $0.hasPrefix("iap_content_bytes_served_total") }.compactMap { $0.split(separator: " ").last.flatMap { Double($0) } }
            return total + Int(values.reduce(0, +))
        }
    }

    func buyAndGrant(_ edge: Edge) throws -> (SandboxStore.Purchase, String) {
        let purchase = try edge.sandbox.purchase(productId: product)
        let granted = try postJSON(edge.nginx.base + "/v1/downloads", ["signedTransaction": purchase.signedTransaction], folder: edge.tmp)
        #expect(granted.status == 200, "\(granted.text)")
        let url = try #require(((granted.json["downloads"] as? [[String: Any]])?.first)?["url"] as? String)
        #expect(url.hasPrefix(edge.nginx.base), "download URLs name the edge")
        return (purchase, url)
    }

    @Test("20 buyers download one archive through nginx: after the first, the bytes come from the edge; forged and refunded grants are refused there")
    func cachingEdge() async throws {
        let edge = try await edge(megabytes: 3)
        let bytes = try Data(contentsOf: URL(fileURLWithPath: edge.archive.archivePath))
        var urls: [(SandboxStore.Purchase, String)] = []
        for _ in 0..<20 { urls.append(try buyAndGrant(edge)) }
        for (index, (_, url)) in urls.enumerated() {
            let got = try curl([url], folder: edge.tmp)
            #expect(got.status == 200 && got.body == bytes, "download \(index)")
            if index == 0 {
                #expect(got.headers["cache-control"]?.hasPrefix("private, max-age=") == true)
                #expect(got.headers["cache-control"]?.contains("immutable") == true)
                #expect(got.headers["repr-digest"] != nil)
            }
        }
        let fromReplicas = try bytesFromReplicas(edge)
        // The first download fills the cache slice by slice; the other 19 never reach a replica.
        #expect(fromReplicas <= bytes.count + (64 << 10), "replicas sent \(fromReplicas) bytes for 20 downloads of \(bytes.count)")
        let ranged = try curl(["-H", "Range: bytes=1048000-1049999", urls[3].1], folder: edge.tmp)
        #expect(ranged.status == 206 && ranged.body == bytes[1_048_000..<1_050_000])
        let lastModified = try #require(try curl(["-I", urls[4].1], folder: edge.tmp).headers["last-modified"])
        #expect(try curl(["-H", "If-Modified-Since: \(lastModified)", urls[4].1], folder: edge.tmp).status == 304)

        // A forged token is refused at the edge although the bytes are cached, with the server's error.
        let parts = urls[5].1.components(separatedBy: "/v1/content/")
        var token = Array(parts[1].prefix { $0 != "/" })
        token[token.count - 2] = token[token.count - 2] == "A" ? "B" : "A"
        let forged = parts[0] + "/v1/content/" + String(token) + parts[1].drop { $0 != "/" }
        let refused = try curl([forged], folder: edge.tmp)
        #expect(refused.status == 401, "\(refused.text)")
        #expect(refused.errorCode?.hasPrefix("grant-") == true, "\(refused.text)")

        // A refund posted through the edge: the same URL is refused within the grant check's second.
        let (purchase, url) = urls[6]
        let refund = try edge.sandbox.refund(transactionId: purchase.transaction.transactionId!)
        #expect(try postJSON(edge.nginx.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: edge.tmp).status == 200)
        let cut = try await waitUntil(.seconds(10)) { try curl(["-o", "/dev/null", url], folder: edge.tmp).status == 403 }
        #expect(cut != nil, "the edge still serves a refunded transaction")
        #expect(try curl([urls[7].1], folder: edge.tmp).status == 200, "other buyers are unaffected")

        // The access log names every content request without its grant: reading it gives no one a working URL.
        let log = try String(contentsOfFile: edge.nginx.accessLog, encoding: .utf8)
        #expect(log.components(separatedBy: "\"GET /v1/content/<grant>/\(product)-1.0.zip HTTP/1.1\" 200").count > 20, "\(log.prefix(2000))")
        for (_, url) in urls {
            let token = url.components(separatedBy: "/v1/content/")[1].prefix { $0 != "/" }
            #expect(!log.contains(token), "a grant is in the access log")
        }
    }

    @Test("the edge's answers lint clean (REDbot, httplint): cached archives with ranges and preconditions, refusals, the API behind it")
    func edgeLint() async throws {
        let edge = try await edge(megabytes: 2)
        let (_, url) = try buyAndGrant(edge)
        let (refunded, refundedURL) = try buyAndGrant(edge)
        let refund = try edge.sandbox.refund(transactionId: refunded.transaction.transactionId!)
        #expect(try postJSON(edge.nginx.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: edge.tmp).status == 200)
        let path = String(url.dropFirst(edge.nginx.base.count))
        let first = try curl([url], folder: edge.tmp)
        let etag = try #require(first.headers["etag"]), lastModified = try #require(first.headers["last-modified"])
        let cut = try await waitUntil(.seconds(10)) { try curl(["-o", "/dev/null", refundedURL], folder: edge.tmp).status == 403 }
        #expect(cut != nil, "the edge still serves a refunded transaction")

        typealias Exchange = HTTPLint.Exchange
        let exchanges =
            HTTPLint.archiveExchanges(path: path, etag: etag, lastModified: lastModified) + [
                Exchange(name: "range across two cached slices", method: "GET", target: path, headers: [["Range", "bytes=1048000-1049999"]], status: 206),
                Exchange(name: "refunded grant", method: "GET", target: String(refundedURL.dropFirst(edge.nginx.base.count)), status: 403),
                Exchange(name: "product", method: "GET", target: "/v1/products/\(product)"),
                Exchange(name: "grant, empty body", method: "POST", target: "/v1/downloads", headers: [["Content-Type", "application/json"]], body: "{}", status: 400),
            ]
        let results = try HTTPLint.run(
            port: edge.nginx.port, exchanges: exchanges, probes: [HTTPLint.Probe(name: "REDbot: archive through the edge", url: url)], folder: edge.tmp)
        HTTPLint.judge(results, exchanges: exchanges, where: "nginx edge")
        #expect(results.first { $0.name == "two ranges" }?.byteranges?.withContentRange == 2)
    }

    @Test("kill -9 of a replica mid-download: iap-fetch finishes through nginx on another, with identical bytes")
    func replicaKilledMidDownload() async throws {
        let edge = try await edge(megabytes: 12)
        let (purchase, _) = try buyAndGrant(edge)
        try purchase.signedTransaction.write(toFile: edge.tmp.sub("tx.jws"), atomically: true, encoding: .utf8)
        let content = edge.tmp.sub("installed")
        let fetch = try launch(
            productsDirectory() + "/iap-fetch",
            ["get", "--server", edge.nginx.base, "--transaction", edge.tmp.sub("tx.jws"), "--content-dir", content, "--limit-rate", "2M"],
            stdout: FileHandle(forWritingAtPath: try edge.tmp.write("fetch.out", ""))!, stderr: FileHandle(forWritingAtPath: try edge.tmp.write("fetch.err", ""))!)
        // Kill one replica once a few MiB have arrived (nginx spreads the slices over all three). The
        // watching runs on a thread of its own: under a full test run the shared pool may be
        // busy for longer than the download takes.
        let (fetchPid, replicaPid) = (fetch.processIdentifier, edge.replicas[0].process.processIdentifier)
        let killedMidDownload = try await offThread { () -> Bool in
            func received() -> Int {
                let files = FileManager.default.enumerator(atPath: content)?.allObjects as? [String] ?? []
                return files.reduce(0) { total, file in
                    var info = stat()
                    return total + (lstat(content + "/" + file, &info) == 0 && (info.st_mode & S_IFMT) == S_IFREG ? Int(info.st_blocks) * 512 : 0)
                }
            }
            let deadline = Date().addingTimeInterval(60)
            while received() < 2 << 20, Date() < deadline, kill(fetchPid, 0) == 0 { usleep(5_000) }
            let running = kill(fetchPid, 0) == 0
            kill(replicaPid, SIGKILL)
            return running
        }
        #expect(killedMidDownload, "the download ended before the replica could be killed")
        fetch.waitUntilExit()
        let err = (try? String(contentsOfFile: edge.tmp.sub("fetch.err"), encoding: .utf8)) ?? ""
        #expect(fetch.terminationStatus == 0, "\(err)")
        let installed = try Data(contentsOf: URL(fileURLWithPath: content + "/\(product)/1.0/Contents/data/blob.bin"))
        #expect(installed == (try Data(contentsOf: URL(fileURLWithPath: edge.tmp.sub("content/data/blob.bin")))))
        // Every request iap-fetch made names it, so the edge's log tells which clients ask.
        let agent = "\"iap-fetch/\(IAPContentVersion.current)\""
        let log = try String(contentsOfFile: edge.nginx.accessLog, encoding: .utf8).split(separator: "\n")
        let ranges = log.filter { $0.contains("/v1/content/") }
        #expect(!ranges.isEmpty && ranges.allSatisfy { $0.contains(agent) }, "\(ranges)")
        #expect(log.contains { $0.contains("POST /v1/downloads") && $0.contains(agent) }, "\(log)")
    }
}

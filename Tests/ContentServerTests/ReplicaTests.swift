import ContentArchive
import Foundation
import IAPTestSupport
import SandboxStore
import Testing

/// The sandbox and `iap-server` arguments every replica test shares.
enum ReplicaFixture {
    static let bundleId = "com.example.app"
    static let adminToken = "admin-token-for-tests-0123456789"

    /// The sandbox store in `tmp/sandbox` (created once), the admin token file and `tmp/shared`.
    static func sandbox(_ tmp: TemporaryFolder) throws -> SandboxStore {
        try tmp.write("admin-token", adminToken)
        try FileManager.default.createDirectory(atPath: tmp.sub("shared"), withIntermediateDirectories: true)
        return FileManager.default.fileExists(atPath: tmp.sub("sandbox/store.json"))
            ? try SandboxStore(folder: tmp.sub("sandbox")) : try SandboxStore.initialize(folder: tmp.sub("sandbox"), bundleId: bundleId)
    }

    /// A replica on `databaseURL` with the grant keys in `tmp/shared`, and the archive folder
    /// there too when `sharedArchives`; `extra` adds or sets options.
    static func replica(
        _ tmp: TemporaryFolder, _ name: String, sandbox: SandboxStore, databaseURL: String, sharedArchives: Bool = true, extra: [String] = [],
        fixedPort: Bool = false
    ) throws -> ServerProcess {
        try ServerProcess(
            data: tmp.sub(name),
            arguments: [
                "--bundle-id", bundleId, "--trust-root", sandbox.rootCertificatePath, "--environment", "sandbox",
                "--admin-token-file", tmp.sub("admin-token"), "--database", databaseURL, "--grant-keys", tmp.sub("shared/grant-keys.json"),
            ] + (sharedArchives ? ["--archives", tmp.sub("shared/archives")] : []) + extra,
            folder: tmp, fixedPort: fixedPort)
    }
}

/// Several `iap-server` processes sharing one PostgreSQL database, one archive folder and one
/// grant key file: any replica grants, serves and takes notifications for all.
@Suite("Replicas on PostgreSQL", .serialized, .onTestThreads)
struct ReplicaTests {
    let product = "com.example.cosmos.levels1"
    let adminToken = ReplicaFixture.adminToken

    /// Replicas that reload revocations only hourly, so that only PostgreSQL's announcement can
    /// make one refuse a refund another received.
    func startReplicas(_ tmp: TemporaryFolder, databaseURL: String, count: Int) throws -> (SandboxStore, [ServerProcess]) {
        let sandbox = try ReplicaFixture.sandbox(tmp)
        let replicas = try (0..<count).map { index in
            try ReplicaFixture.replica(tmp, "replica-\(index)", sandbox: sandbox, databaseURL: databaseURL, extra: ["--revocation-refresh", "3600"])
        }
        return (sandbox, replicas)
    }

    func packSample(_ tmp: TemporaryFolder, version: String = "1.0", product: String? = nil) throws -> PackResult {
        let product = product ?? self.product
        let content = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("content/\(product)/Contents").path
        return try ArchivePacker.pack(
            folder: content,
            options: .init(productId: try ProductIdentifier(product), contentVersion: try ContentVersion(version), outputDirectory: tmp.sub("out-\(product)-\(version)")))
    }

    /// Whether `replica` says the database away (`iap_database_answering 0`, its keeper's finding) within 30 s.
    func databaseAway(on replica: ServerProcess, _ tmp: TemporaryFolder) async throws -> Bool {
        try await waitUntil(.seconds(30)) { try curl([replica.base + "/metrics"], folder: tmp).text.contains("\niap_database_answering 0.0\n") } != nil
    }

    func upload(_ archive: String, to server: ServerProcess, _ tmp: TemporaryFolder) throws -> HTTPResult {
        try curl(["-X", "PUT", "-T", archive, "-H", "Authorization: Bearer \(adminToken)", server.base + "/v1/admin/archives"], folder: tmp)
    }

    /// The download URL a grant from `granting` names, pointed at `serving` instead.
    func grantURL(_ signed: String, from granting: ServerProcess, servedBy serving: ServerProcess, _ tmp: TemporaryFolder) throws -> String {
        let granted = try postJSON(granting.base + "/v1/downloads", ["signedTransaction": signed], folder: tmp)
        #expect(granted.status == 200, "\(granted.text)")
        let url = try #require(((granted.json["downloads"] as? [[String: Any]])?.first)?["url"] as? String)
        return serving.base + url.dropFirst(granting.base.count)
    }

    @Test("three replicas: publish on A, grant on B, download from C; a refund posted to A cuts C through NOTIFY; one ledger")
    func threeReplicas() async throws {
        let tmp = try TemporaryFolder()
        let url = try await PostgresServer.shared().createDatabase()
        let (sandbox, replicas) = try startReplicas(tmp, databaseURL: url, count: 3)
        let (a, b, c) = (replicas[0], replicas[1], replicas[2])
        let packed = try packSample(tmp)
        let bytes = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))

        #expect(try upload(packed.archivePath, to: a, tmp).status == 201)
        for replica in replicas {
            #expect(try curl([replica.base + "/v1/products/\(product)"], folder: tmp).json["sha256"] as? String == packed.manifest.archiveSHA256)
            #expect(try curl([replica.base + "/readyz"], folder: tmp).status == 200)
        }
        let purchase = try sandbox.purchase(productId: product)
        let onC = try grantURL(purchase.signedTransaction, from: b, servedBy: c, tmp)
        let whole = try curl([onC], folder: tmp)
        #expect(whole.status == 200 && whole.body == bytes)
        let range = try curl(["-H", "Range: bytes=100-199", onC], folder: tmp)
        #expect(range.status == 206 && range.body == bytes[100..<200])

        let refund = try sandbox.refund(transactionId: purchase.transaction.transactionId!)
        #expect(try postJSON(a.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        let cut = try await waitUntil(.seconds(10)) { try curl([onC], folder: tmp).status == 403 }
        #expect(cut != nil, "C still serves a refunded transaction's URL")
        let regrant = try postJSON(c.base + "/v1/downloads", ["signedTransaction": purchase.signedTransaction], folder: tmp)
        #expect(regrant.status == 403 && regrant.errorCode == "revoked")
        // The same notification posted to another replica is a duplicate: one row, applied once.
        #expect(try postJSON(b.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        let server = try await PostgresServer.shared()
        #expect(try await server.psql(url, "SELECT COUNT(*) FROM notifications") == "1")
        #expect(try await server.psql(url, "SELECT transaction_id FROM revocations") == purchase.transaction.transactionId!)
        #expect(try await server.psql(url, "SELECT COUNT(*) FROM grants") == "1")
    }

    @Test("PostgreSQL restarted mid-run: grants get 503 while it is down, downloads go on, replicas recover by themselves, nothing acknowledged is lost")
    func databaseRestart() async throws {
        let tmp = try TemporaryFolder()
        let database = try await PostgresServer.start()
        let url = try await database.createDatabase()
        let (sandbox, replicas) = try startReplicas(tmp, databaseURL: url, count: 2)
        let (a, b) = (replicas[0], replicas[1])
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, to: a, tmp).status == 201)
        let first = try sandbox.purchase(productId: product), second = try sandbox.purchase(productId: product)
        let firstURL = try grantURL(first.signedTransaction, from: a, servedBy: b, tmp)
        let refundBefore = try sandbox.refund(transactionId: second.transaction.transactionId!)
        #expect(try postJSON(a.base + "/v1/notifications", ["signedPayload": refundBefore.signedPayload], folder: tmp).status == 200)

        #expect(try curl([a.base + "/metrics"], folder: tmp).text.contains("\niap_database_answering 1.0\n"))
        try await database.stop()
        let refused = try postJSON(a.base + "/v1/downloads", ["signedTransaction": first.signedTransaction], folder: tmp)
        #expect(refused.status == 503 && refused.errorCode == "storage" && refused.headers["retry-after"] == "5", "\(refused.headers) \(refused.text)")
        #expect(try curl([a.base + "/readyz"], folder: tmp).status == 503)
        // A grant the replica can check itself is still served.
        #expect(try curl(["-o", "/dev/null", firstURL], folder: tmp).status == 200)
        // The metric an operator alerts on: the keeper finds the database away within seconds.
        #expect(try await databaseAway(on: a, tmp), "iap_database_answering did not drop to 0")
        // Known away, a grant's 503 comes after one short question to the database, not after a
        // 10 s deadline for each of three (it took 30 s), and is counted.
        let quick = try postJSON(a.base + "/v1/downloads", ["signedTransaction": first.signedTransaction], folder: tmp)
        #expect(quick.status == 503 && quick.text.contains("(asked for 1.0 seconds while it is away)"), "\(quick.text)")
        #expect(try curl([a.base + "/metrics"], folder: tmp).text.contains(#"iap_grants_total{outcome="storage"} 2"#))
        // An upload is refused before its body: nothing could be published.
        let newer = try packSample(tmp, version: "1.1")
        let refusedUpload = try curl(
            ["-X", "PUT", "-T", newer.archivePath, "-H", "Expect: 100-continue", "-H", "Authorization: Bearer \(adminToken)", a.base + "/v1/admin/archives"], folder: tmp)
        #expect(refusedUpload.status == 503 && refusedUpload.headers["retry-after"] == "5" && refusedUpload.text.contains("upload again once it does"), "\(refusedUpload.text)")
        #expect(tmp.files(in: "shared/archives/.uploads").isEmpty, "an upload file was left")
        // Ready for downloads all the same, naming the database: a balancer probing that keeps
        // every replica while the shared database is away. A lost archive still takes it out.
        let forDownloads = try curl([a.base + "/readyz?for=downloads"], folder: tmp)
        #expect(forDownloads.status == 200 && forDownloads.text.contains(#""database":"PostgreSQL at"#), "\(forDownloads.text)")
        #expect(try curl([b.base + "/readyz?for=downloads"], folder: tmp).status == 200)
        let stored = tmp.sub("shared/archives/\(packed.manifest.archiveSHA256).zip")
        #expect(rename(stored, stored + ".away") == 0)
        let lost = try curl([a.base + "/readyz?for=downloads"], folder: tmp)
        #expect(lost.status == 503 && lost.errorCode == "not-ready" && lost.text.contains(packed.manifest.archiveSHA256) && lost.text.contains("PostgreSQL at"), "\(lost.text)")
        #expect(rename(stored + ".away", stored) == 0)
        #expect(try curl([a.base + "/readyz?for=downloads"], folder: tmp).status == 200)

        try await database.restart()
        let recovered = try await waitUntil(.seconds(30)) {
            try postJSON(a.base + "/v1/downloads", ["signedTransaction": first.signedTransaction], folder: tmp).status == 200
        }
        #expect(recovered != nil, "the replica did not recover after PostgreSQL came back")
        let back = try curl([a.base + "/readyz?for=downloads"], folder: tmp)
        #expect(back.status == 200 && !back.text.contains("database"), "\(back.text)")
        #expect(try curl([a.base + "/readyz"], folder: tmp).status == 200)
        #expect(try curl([a.base + "/metrics"], folder: tmp).text.contains("\niap_database_answering 1.0\n"))
        #expect(try await database.psql(url, "SELECT COUNT(*) FROM notifications") == "1")
        #expect(try await database.psql(url, "SELECT transaction_id FROM revocations") == second.transaction.transactionId!)
        #expect(try await database.psql(url, "SELECT transaction_id FROM grants") == first.transaction.transactionId!)
        // B listens again: a refund posted to A after the restart still reaches it.
        let refundAfter = try sandbox.refund(transactionId: first.transaction.transactionId!)
        #expect(try postJSON(a.base + "/v1/notifications", ["signedPayload": refundAfter.signedPayload], folder: tmp).status == 200)
        // B's pool reconnects on its own backoff, or its keeper replaces it, maybe later than A's:
        // the same bound as A's recovery.
        let cut = try await waitUntil(.seconds(30)) { try curl([firstURL], folder: tmp).status == 403 }
        #expect(cut != nil, "B did not hear of the refund after PostgreSQL restarted")
        try await database.stop(mode: "immediate")
    }

    @Test("iap-fetch rides out a database restart: the grant's 503 asks for 5 s (Retry-After), iap-fetch waits that long between tries, and downloads once the database is back")
    func fetchThroughDatabaseRestart() async throws {
        let tmp = try TemporaryFolder()
        let database = try await PostgresServer.start()
        let url = try await database.createDatabase()
        let (sandbox, replicas) = try startReplicas(tmp, databaseURL: url, count: 1)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, to: replicas[0], tmp).status == 201)
        let purchase = try sandbox.purchase(productId: product)
        try purchase.signedTransaction.write(toFile: tmp.sub("tx.jws"), atomically: true, encoding: .utf8)

        try await database.stop()
        let output = tmp.sub("fetch.out")
        _ = FileManager.default.createFile(atPath: output, contents: nil)
        let fetch = try launch(
            productsDirectory() + "/iap-fetch",
            ["get", "--server", replicas[0].base, "--transaction", tmp.sub("tx.jws"), "--content-dir", tmp.sub("installed")],
            stdout: FileHandle(forWritingAtPath: output)!, stderr: FileHandle(forWritingAtPath: output)!)
        defer { forceStop(fetch) }
        func said() -> String { (try? String(contentsOfFile: output, encoding: .utf8)) ?? "" }
        let told = await waitUntil(.seconds(30)) { said().contains("(503) for the grant of transaction") }
        #expect(told != nil && said().contains("trying again in 5 s, as it asked"), "\(said())")
        try await database.restart()
        let ended = await waitUntil(.seconds(60)) { !fetch.isRunning }
        #expect(ended != nil && fetch.terminationStatus == 0, "\(said())")
        let installed = tmp.sub("installed/\(product)/1.0/ContentInfo.plist")
        #expect(FileManager.default.fileExists(atPath: installed), "\(said())")
        try await database.stop(mode: "immediate")
    }

    @Test("a StoreKit 1 restore while the database is away answers 503 with Retry-After at once, not 200 with every product skipped")
    func restoreThroughDatabaseOutage() async throws {
        let tmp = try TemporaryFolder()
        let database = try await PostgresServer.start()
        let url = try await database.createDatabase()
        let sandbox = try ReplicaFixture.sandbox(tmp)
        _ = try sandbox.receiptAuthority()
        let replica = try ReplicaFixture.replica(tmp, "replica", sandbox: sandbox, databaseURL: url, extra: ["--trust-root", sandbox.receiptRootCertificatePath])
        for id in [product, "com.example.soundkit.drums"] {
            #expect(try upload(try packSample(tmp, product: id).archivePath, to: replica, tmp).status == 201)
            _ = try sandbox.purchase(productId: id)
        }
        let restore = ["receipt": Data(try sandbox.receipt()).base64EncodedString()]
        let before = try postJSON(replica.base + "/v1/downloads", restore, folder: tmp)
        #expect(before.status == 200 && (before.json["downloads"] as? [Any])?.count == 2, "\(before.text)")

        try await database.stop()
        #expect(try await databaseAway(on: replica, tmp), "iap_database_answering did not drop to 0")
        let during = try postJSON(replica.base + "/v1/downloads", restore, folder: tmp)
        #expect(during.status == 503 && during.errorCode == "storage" && during.headers["retry-after"] == "5", "\(during.status) \(during.text)")
    }

    @Test("no shared archive folder: a replica fetches the archive from the one that received it (SHA-256 checked), redirecting requests there meanwhile; damaged bytes are refused")
    func peerFetch() async throws {
        let tmp = try TemporaryFolder()
        let url = try await PostgresServer.shared().createDatabase()
        let sandbox = try ReplicaFixture.sandbox(tmp)
        func replica(_ name: String, port: Int? = nil) throws -> ServerProcess {
            try ReplicaFixture.replica(
                tmp, name, sandbox: sandbox, databaseURL: url, sharedArchives: false,
                extra: port.map { ["--port", String($0), "--advertise-url", "http://127.0.0.1:\($0)"] } ?? [], fixedPort: port != nil)
        }
        let a = try replica("a", port: try freePort())
        var b = try replica("b")
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, to: a, tmp).status == 201)
        let bytes = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
        let purchase = try sandbox.purchase(productId: product)
        let onB = try grantURL(purchase.signedTransaction, from: b, servedBy: b, tmp)
        // At once: served by B, or redirected to A while B fetches; never an error.
        let followed = try curl(["-L", onB], folder: tmp)
        #expect(followed.status == 200 && followed.body == bytes)
        let fetched = try await waitUntil(.seconds(20)) { try curl([b.base + "/readyz"], folder: tmp).status == 200 }
        #expect(fetched != nil, "B never fetched the archive from A")
        let direct = try curl([onB], folder: tmp)
        #expect(direct.status == 200 && direct.body == bytes, "B serves the archive itself once fetched")
        #expect(tmp.files(in: "b/archives").contains(packed.manifest.archiveSHA256 + ".zip"))
        #expect(tmp.files(in: "b/archives").contains(packed.manifest.archiveSHA256 + ".manifest.json"))

        // A damaged copy at the origin: B refuses it, keeps redirecting, and /readyz says what is missing.
        #expect(b.stop() == 0)
        let v11 = try packSample(tmp, version: "1.1")
        #expect(try upload(v11.archivePath, to: a, tmp).status == 201)
        let stored = tmp.sub("a/archives/\(v11.manifest.archiveSHA256).zip")
        var damaged = try Data(contentsOf: URL(fileURLWithPath: stored))
        damaged[damaged.count / 2] ^= 0xFF
        chmod(stored, 0o644)
        try damaged.write(to: URL(fileURLWithPath: stored))
        b = try replica("b")
        let refused = await waitUntil(.seconds(20)) {
            ((try? String(contentsOfFile: b.log, encoding: .utf8)) ?? "").contains("not the published \(v11.manifest.archiveSHA256): refused")
        }
        #expect(refused != nil, "B did not refuse the damaged archive")
        #expect(!tmp.files(in: "b/archives").contains(v11.manifest.archiveSHA256 + ".zip"))
        let ready = try curl([b.base + "/readyz"], folder: tmp)
        #expect(ready.status == 503 && ready.text.contains(v11.manifest.archiveSHA256), "\(ready.text)")

        // The bad upload is rolled back and removed on A: B is ready again. A good 1.2 reaches B;
        // removed on A, B deletes its own copy when it hears of it.
        func admin(_ args: [String]) throws -> HTTPResult {
            try curl(["-H", "Authorization: Bearer \(adminToken)"] + args, folder: tmp)
        }
        func rollBackAndRemove(_ version: String) throws {
            let body = #"{"productId": "\#(product)", "contentVersion": "\#(version)", "rollBack": true}"#
            #expect(try admin(["-X", "POST", "-H", "Content-Type: application/json", "-d", body, a.base + "/v1/admin/rollouts"]).status == 200)
            #expect(try admin(["-X", "DELETE", a.base + "/v1/admin/archives/\(product)/\(version)"]).status == 200)
        }
        try rollBackAndRemove("1.1")
        #expect(try await waitUntil(.seconds(20)) { try curl([b.base + "/readyz"], folder: tmp).status == 200 } != nil, "B still waits for the removed archive")
        let v12 = try packSample(tmp, version: "1.2")
        #expect(try upload(v12.archivePath, to: a, tmp).status == 201)
        let copied = await waitUntil(.seconds(20)) { tmp.files(in: "b/archives").contains(v12.manifest.archiveSHA256 + ".zip") }
        #expect(copied != nil, "B never fetched 1.2")
        try rollBackAndRemove("1.2")
        let deleted = await waitUntil(.seconds(20)) { !tmp.files(in: "b/archives").contains(v12.manifest.archiveSHA256 + ".zip") }
        #expect(deleted != nil, "B kept its copy of the removed archive")
        #expect(tmp.files(in: "b/archives").contains(packed.manifest.archiveSHA256 + ".zip"), "B deleted a live archive")
    }

    /// Replicas A (the origin, advertised on `port`) and B (started with `bExtra`), each with an
    /// archive folder of its own on one PostgreSQL catalog; the sample uploaded to A, and B serving
    /// its own copy: A, B, the archive's bytes, a download URL on B, B's copy, its inode, A's port.
    func ownFolders(
        _ tmp: TemporaryFolder, bExtra: [String] = []
    ) async throws -> (a: ServerProcess, b: ServerProcess, bytes: Data, onB: String, copy: String, inode: Int, port: Int) {
        let url = try await PostgresServer.shared().createDatabase()
        let sandbox = try ReplicaFixture.sandbox(tmp)
        let port = try freePort()
        let a = try ReplicaFixture.replica(
            tmp, "a", sandbox: sandbox, databaseURL: url, sharedArchives: false, extra: ["--port", String(port), "--advertise-url", "http://127.0.0.1:\(port)"],
            fixedPort: true)
        let b = try ReplicaFixture.replica(tmp, "b", sandbox: sandbox, databaseURL: url, sharedArchives: false, extra: bExtra)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, to: a, tmp).status == 201)
        let bytes = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
        let onB = try grantURL(try sandbox.purchase(productId: product).signedTransaction, from: b, servedBy: b, tmp)
        let copy = tmp.sub("b/archives/\(packed.manifest.archiveSHA256).zip")
        let fetched = await waitUntil(.seconds(20)) { (try? curl([onB], folder: tmp))?.body == bytes }
        #expect(fetched != nil, "B never served its own copy")
        let inode = try #require(FileManager.default.attributesOfItem(atPath: copy)[.systemFileNumber] as? Int)
        return (a, b, bytes, onB, copy, inode, port)
    }

    @Test("no shared archive folder: a replica's own copy cut short is fetched again from the origin, its requests redirected there meanwhile, never refused")
    func peerCopyRepaired() async throws {
        let tmp = try TemporaryFolder()
        let (a, b, bytes, onB, copy, first, _) = try await ownFolders(tmp)

        chmod(copy, 0o644)
        #expect(truncate(copy, off_t(bytes.count / 3)) == 0)
        // From the first request on, B sends buyers to A (or serves a new copy): never a 503.
        let followed = try curl(["-L", onB], folder: tmp)
        #expect(followed.status == 200 && followed.body == bytes, "\(followed.status) \(followed.text.prefix(200))")
        let replaced = await waitUntil(.seconds(20)) {
            (try? FileManager.default.attributesOfItem(atPath: copy)[.size] as? Int) == bytes.count
                && (try? FileManager.default.attributesOfItem(atPath: copy)[.systemFileNumber] as? Int) != first
        }
        #expect(replaced != nil, "B did not fetch its copy again")
        // Logged once the new copy is in place: after the rename the check above saw.
        let logged = await waitUntil(.seconds(10)) {
            ((try? String(contentsOfFile: b.log, encoding: .utf8)) ?? "").contains("replaced a damaged copy of an archive with its origin's")
        }
        #expect(logged != nil, "B did not log the repair")
        let served = await waitUntil(.seconds(10)) { (try? curl([onB], folder: tmp)).map { $0.status == 200 && $0.body == bytes } ?? false }
        #expect(served != nil, "B does not serve its new copy itself")
        #expect(try curl([b.base + "/readyz"], folder: tmp).status == 200)
        #expect(a.stop() == 0 && b.stop() == 0)
    }

    @Test(
        "no shared archive folder: a replica's own copy with bytes damaged at its published size is found by its periodic read and fetched again from the origin, its requests redirected there meanwhile"
    )
    func peerCopyRotRepaired() async throws {
        let tmp = try TemporaryFolder()
        let (a, b, bytes, onB, copy, first, port) = try await ownFolders(tmp, bExtra: ["--archive-check-interval", "1"])

        // One byte flipped in place: the same file, the same size.
        chmod(copy, 0o644)
        let file = try #require(FileHandle(forUpdatingAtPath: copy))
        try file.seek(toOffset: UInt64(bytes.count / 3))
        try file.write(contentsOf: Data([bytes[bytes.count / 3] ^ 0xA5]))
        try file.close()
        let replaced = await waitUntil(.seconds(20)) {
            (try? FileManager.default.attributesOfItem(atPath: copy)[.systemFileNumber] as? Int) != first
                && (try? Data(contentsOf: URL(fileURLWithPath: copy))) == bytes
        }
        #expect(replaced != nil, "B did not fetch its copy again")
        var log = ""
        let logged = await waitUntil(.seconds(10)) {
            log = (try? String(contentsOfFile: b.log, encoding: .utf8)) ?? ""
            return log.contains("replaced a damaged copy of an archive with its origin's")
        }
        #expect(logged != nil && log.contains("found an archive damaged on disk") && log.contains("fetches its copy again from http://127.0.0.1:\(port)"), "\(log)")
        // Whatever B answered meanwhile, followed, was the published archive; now B serves it itself.
        let followed = try curl(["-L", onB], folder: tmp)
        #expect(followed.status == 200 && followed.body == bytes)
        let served = await waitUntil(.seconds(10)) { (try? curl([onB], folder: tmp)).map { $0.status == 200 && $0.body == bytes } ?? false }
        #expect(served != nil, "B does not serve its new copy itself")
        #expect(try curl([b.base + "/readyz"], folder: tmp).status == 200)
        #expect(a.stop() == 0 && b.stop() == 0)
    }

    @Test("a replica advertised over HTTPS with a private authority: refused by name without --ca-file, fetched (on HTTP/1.1) with it")
    func peerFetchOverHTTPS() async throws {
        let tmp = try TemporaryFolder()
        let url = try await PostgresServer.shared().createDatabase()
        let sandbox = try ReplicaFixture.sandbox(tmp)
        let authority = try TestCertificates(folder: tmp.sub("ca"))
        // A's only address for the others is a TLS edge in front of it, offering HTTP/2 too.
        let aPort = try freePort(), edgePort = try freePort()
        let a = try ReplicaFixture.replica(
            tmp, "a", sandbox: sandbox, databaseURL: url, sharedArchives: false,
            extra: ["--port", String(aPort), "--advertise-url", "https://127.0.0.1:\(edgePort)"], fixedPort: true)
        let edge = try NginxServer(
            replicaPorts: [aPort], folder: tmp, port: edgePort, certificate: try authority.server("edge", names: ["IP:127.0.0.1"]), http2: true)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, to: a, tmp).status == 201)
        let archive = packed.manifest.archiveSHA256 + ".zip"

        // A --ca-file that cannot be used stops the start, before the data folder is made.
        for (file, expected) in [(tmp.sub("missing.pem"), "cannot read the certificate authority file"), (packed.archivePath, "holds no PEM certificate")] {
            let refused = try run(productsDirectory() + "/iap-server", ["serve", "--data", tmp.sub("never"), "--bundle-id", ReplicaFixture.bundleId, "--ca-file", file])
            #expect(refused.status == 1 && refused.stderr.contains(expected) && refused.stderr.contains("--ca-file"), "\(refused.stderr)")
            #expect(!FileManager.default.fileExists(atPath: tmp.sub("never")))
        }

        var b = try ReplicaFixture.replica(tmp, "b", sandbox: sandbox, databaseURL: url, sharedArchives: false)
        let refused = await waitUntil(.seconds(20)) {
            ((try? String(contentsOfFile: b.log, encoding: .utf8)) ?? "").contains("is not trusted: start this replica with --ca-file")
        }
        #expect(refused != nil, "B did not say why it could not fetch: \((try? String(contentsOfFile: b.log, encoding: .utf8)) ?? "")")
        #expect(!tmp.files(in: "b/archives").contains(archive))
        #expect(b.stop() == 0)

        b = try ReplicaFixture.replica(tmp, "b", sandbox: sandbox, databaseURL: url, sharedArchives: false, extra: ["--ca-file", authority.authority])
        let fetched = await waitUntil(.seconds(20)) { tmp.files(in: "b/archives").contains(archive) }
        #expect(fetched != nil, "B never fetched the archive over HTTPS")
        #expect(try Data(contentsOf: URL(fileURLWithPath: tmp.sub("b/archives/" + archive))) == Data(contentsOf: URL(fileURLWithPath: packed.archivePath)))
        let log = try String(contentsOfFile: edge.accessLog, encoding: .utf8)
        #expect(log.contains("GET /v1/content/<grant>/\(product)-1.0.zip HTTP/1.1"), "\(log)")
        #expect(!log.contains("HTTP/2"), "\(log)")
    }
}

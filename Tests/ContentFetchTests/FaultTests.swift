import ContentArchive
import ContentFetch
import DownloadGrants
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@Suite("iap-fetch under faults", .serialized)
struct FaultTests {
    let product = "com.example.big"

    struct Setup {
        let tmp: TemporaryFolder
        let store: SandboxStore
        let server: ServerProcess
        let payload: Data
        let transactionId: String
        var content: String { tmp.sub("device") }
        var queue: String { tmp.sub("sandbox/queue") }
        var downloadId: String { "\(transactionId)-com.example.big" }
    }

    /// A 12 MiB product bought and half-downloaded: the client was stopped with `signal` once
    /// 4 MiB were durable (SIGKILL by default).
    func halfDownloaded(signal: Int32 = SIGKILL, serverArguments: [String] = [], exitStatus: UnsafeMutablePointer<Int32>? = nil) throws -> Setup {
        let tmp = try TemporaryFolder()
        try FileManager.default.createDirectory(atPath: tmp.sub("src"), withIntermediateDirectories: true)
        var generator = SystemRandomNumberGenerator()
        let payload = Data((0..<(12 << 20)).map { _ in UInt8.random(in: 0...255, using: &generator) })
        try payload.write(to: URL(fileURLWithPath: tmp.sub("src/payload.bin")))
        let store = try SandboxStore.initialize(folder: tmp.sub("sandbox"), bundleId: "com.example.app")
        let packed = try ArchivePacker.pack(folder: tmp.sub("src"), options: .init(
            productId: try ProductIdentifier(product), contentVersion: try ContentVersion("1.0"), outputDirectory: tmp.sub("archives"), level: 0))
        #expect(try run(productsDirectory() + "/iap-server", ["publish", "--data", tmp.sub("data"), packed.archivePath]).status == 0)
        let server = try ServerProcess(data: tmp.sub("data"), arguments: [
            "--bundle-id", "com.example.app", "--trust-root", store.rootCertificatePath, "--environment", "sandbox"] + serverArguments, folder: tmp)
        let purchase = try store.purchase(productId: product)
        let setup = Setup(tmp: tmp, store: store, server: server, payload: payload, transactionId: purchase.transaction.transactionId!)
        let client = Process()
        client.executableURL = URL(fileURLWithPath: productsDirectory() + "/iap-fetch")
        client.arguments = ["run", "--server", server.base, "--queue", setup.queue, "--content-dir", setup.content, "--limit-rate", "4M"]
        client.standardOutput = FileHandle.nullDevice
        client.standardError = FileHandle.nullDevice
        try client.run()
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
        let args = ["run", "--server", s.server.base, "--queue", s.queue, "--content-dir", s.content, "--json"]
        if prefix.isEmpty { return try run(productsDirectory() + "/iap-fetch", args) }
        return try run("sh", ["-c", prefix.joined(separator: " ") + "; exec \"$0\" \"$@\"", productsDirectory() + "/iap-fetch"] + args)
    }

    func finishedAt(_ s: Setup) throws -> Date? { try FileTransactionQueue(folder: s.queue).transaction(s.transactionId)?.finishedAt }

    func installedPayload(_ s: Setup) -> Data? {
        FileManager.default.contents(atPath: s.content + "/com.example.big/1.0/Contents/payload.bin")
    }

    @Test("a grant that expired while the client was away is renewed, and the download continues")
    func expiredGrant() throws {
        let s = try halfDownloaded()
        let journal = try DownloadJournal(contentDirectory: s.content)
        var record = try #require(journal.load(s.downloadId))
        let keys = try GrantKeyRing.loadOrCreate(path: s.tmp.sub("data/grant-keys.json"))
        let expired = keys.mint(Grant(transactionId: s.transactionId, productId: product, contentVersion: "1.0", sha256: record.sha256,
                                      expiresAt: Int64(Date().timeIntervalSince1970) - 60))
        record.url = s.server.base + "/v1/content/\(expired)/x.zip"
        try journal.save(record)
        let result = try fetch(s)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(installedPayload(s) == s.payload)
        #expect(try finishedAt(s) != nil)
    }

    @Test("corrupted bytes on disk fail the SHA-256 check: downloaded again, never installed or finished corrupt")
    func corruption() throws {
        let s = try halfDownloaded()
        let partial = try DownloadJournal(contentDirectory: s.content).partialPath(s.downloadId)
        let handle = try #require(FileHandle(forUpdatingAtPath: partial))
        try handle.seek(toOffset: 1_000_000)
        let byte = try #require(try handle.read(upToCount: 1)).first!
        try handle.seek(toOffset: 1_000_000)
        try handle.write(contentsOf: Data([byte ^ 0xFF]))
        try handle.close()
        let result = try fetch(s)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stdout.contains("\"integrity\""), "the mismatch was not reported")
        #expect(installedPayload(s) == s.payload)
        #expect(try finishedAt(s) != nil)
    }

    @Test("a refund during the download fails it with the reason; nothing is installed and the transaction stays unfinished")
    func refundMidDownload() throws {
        let s = try halfDownloaded()
        let refund = try s.store.refund(transactionId: s.transactionId)
        #expect(try postJSON(s.server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: s.tmp).status == 200)
        let result = try fetch(s)
        #expect(result.status == 1)
        #expect(result.stderr.contains("refunded or revoked"))
        #expect(installedPayload(s) == nil)
        #expect(try finishedAt(s) == nil)
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

    @Test("the server restarting mid-download: the client retries and completes with identical bytes")
    func serverRestart() throws {
        let s = try halfDownloaded()
        let client = Process()
        client.executableURL = URL(fileURLWithPath: productsDirectory() + "/iap-fetch")
        client.arguments = ["run", "--server", s.server.base, "--queue", s.queue, "--content-dir", s.content, "--limit-rate", "4M"]
        client.standardOutput = FileHandle.nullDevice
        client.standardError = FileHandle.nullDevice
        try client.run()
        let journal = try DownloadJournal(contentDirectory: s.content)
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline, (journal.load(s.downloadId)?.recordedLength ?? 0) < 8 << 20 { usleep(2_000) }
        // Kill the server without warning and start it again on the same port.
        kill(s.server.process.processIdentifier, SIGKILL)
        s.server.process.waitUntilExit()
        let again = try ServerProcess(data: s.tmp.sub("data"), arguments: [
            "--bundle-id", "com.example.app", "--trust-root", s.store.rootCertificatePath, "--environment", "sandbox",
            "--port", String(s.server.port)], folder: s.tmp, fixedPort: true)
        #expect(again.port == s.server.port)
        client.waitUntilExit()
        #expect(client.terminationStatus == 0)
        #expect(installedPayload(s) == s.payload)
        #expect(try finishedAt(s) != nil)
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

import ContentArchive
import ContentFetch
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@Suite("If-Range", .serialized, .onTestThreads)
struct IfRangeTests {
    func okResponses(_ server: ServerProcess, _ tmp: TemporaryFolder) throws -> Int {
        let metrics = try curl([server.base + "/metrics"], folder: tmp).text
        let line = metrics.split(separator: "\n").first { $0.hasPrefix("iap_content_responses_total{status=\"200\"}") }
        return line.flatMap { Int($0.split(separator: " ").last ?? "") } ?? 0
    }

    @Test("bytes on disk from another representation (a stale ETag): If-Range gets 200, the client starts over and installs the right bytes")
    func staleValidator() throws {
        let shop = try Shop(products: ["com.example.changing": .random(8 << 20)])
        let (tmp, server, queue, content) = (shop.tmp, shop.server, shop.queue, shop.content)
        let payload = shop.payloads["com.example.changing"]!
        let purchase = try shop.store.purchase(productId: "com.example.changing")
        let id = "\(purchase.transaction.transactionId!)-com.example.changing"
        let (client, _) = try shop.startClient(["--limit-rate", "4M"])
        let journal = try DownloadJournal(contentDirectory: content)
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline, (journal.load(id)?.recordedLength ?? 0) < 4 << 20 { usleep(2_000) }
        kill(client.processIdentifier, SIGKILL)
        client.waitUntilExit()

        // The partial bytes now claim to come from another representation, and are garbage.
        var record = try #require(journal.load(id))
        #expect(record.etag == "\"\(shop.manifests["com.example.changing"]!.archiveSHA256)\"")
        record.etag = "\"" + String(repeating: "0", count: 64) + "\""
        try journal.save(record)
        let partial = try #require(FileHandle(forUpdatingAtPath: journal.partialPath(id)))
        try partial.write(contentsOf: Data(repeating: 0xAB, count: 1 << 20))
        try partial.close()
        let fullResponsesBefore = try okResponses(server, tmp)

        let result = try shop.fetch()
        #expect(result.status == 0, "\(result.stderr)")
        // The resumed request was answered with the whole file (200), not a range appended to stale bytes.
        #expect(try okResponses(server, tmp) == fullResponsesBefore + 1)
        #expect(!result.stdout.contains("\"integrity\""), "it appended to the stale bytes instead of starting over")
        #expect(try Data(contentsOf: URL(fileURLWithPath: content + "/com.example.changing/1.0/Contents/payload.bin")) == payload)
        #expect(try FileTransactionQueue(folder: queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
        #expect(server.stop() == 0)
    }
}

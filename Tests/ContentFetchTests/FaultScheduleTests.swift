import ContentArchive
import ContentFetch
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@Suite("Fault schedule", .serialized, .onTestThreads)
struct FaultScheduleTests {
    /// Polls (bounded) until `condition` holds or `process` exits.
    func waitUntil(_ process: Process, timeout: TimeInterval = 60, _ condition: () -> Bool) -> Bool {
        let deadline = Date().addingTimeInterval(timeout)
        while Date() < deadline {
            if condition() { return true }
            if !process.isRunning { return condition() }
            usleep(1_000)
        }
        return false
    }

    func client(_ base: String, queue: String, content: String, killAt: String? = nil, limit: Bool = true) throws -> Process {
        try launch(
            productsDirectory() + "/iap-fetch",
            ["run", "--server", base, "--queue", queue, "--content-dir", content] + (limit ? ["--limit-rate", "8M"] : []),
            environment: killAt.map { ["IAP_FETCH_KILL_AT": $0] })
    }

    @Test("the client killed at ten points and the server twice: identical content, finished exactly once")
    func schedule() throws {
        let source = try TemporaryFolder()
        let payload = try #require(FileHandle(forReadingAtPath: "/dev/urandom")).readData(ofLength: 16 << 20)
        try source.write("src/payload.bin", payload)
        for i in 0..<800 { try source.write("src/notes/note-\(i).txt", "note \(i)\n") }
        let shop = try Shop(products: ["com.example.faults": .folder(source.sub("src"))])
        let (tmp, store, serverArguments) = (shop.tmp, shop.store, shop.serverArguments)
        var server = shop.server
        let port = server.port
        let purchase = try store.purchase(productId: "com.example.faults")
        let id = purchase.transaction.transactionId!
        let (queue, content) = (shop.queue, shop.content)
        let installed = content + "/com.example.faults/1.0"
        let journal = try DownloadJournal(contentDirectory: content)
        func durable() -> Int64 { journal.load("\(id)-com.example.faults")?.recordedLength ?? 0 }
        func finished() throws -> Date? { try FileTransactionQueue(folder: queue).transaction(id)?.finishedAt }
        var kills = 0

        // Seven kills during the download; the server is killed and restarted during two of the transfers.
        for (index, mib) in [2, 4, 6, 8, 10, 12, 14].enumerated() {
            let process = try client(server.base, queue: queue, content: content)
            #expect(waitUntil(process) { durable() >= Int64(mib) << 20 }, "no progress to \(mib) MiB")
            if index == 1 || index == 4 {
                try server.killKeepingPort()
                server = try ServerProcess(data: tmp.sub("data"), arguments: serverArguments + ["--port", String(port)], folder: tmp, fixedPort: true)
                let before = durable()
                #expect(waitUntil(process) { durable() > before }, "the client did not continue after the server restart")
            }
            kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
            kills += 1
            #expect(try finished() == nil && !FileManager.default.fileExists(atPath: installed))
        }

        // After the SHA-256 check, before installing.
        let verified = try client(server.base, queue: queue, content: content, killAt: "verified", limit: false)
        verified.waitUntilExit()
        #expect(verified.terminationReason == .uncaughtSignal)
        kills += 1
        #expect(try finished() == nil && !FileManager.default.fileExists(atPath: installed))

        // While its hidden folder is there (extracted as the archive arrives, here from the disk).
        let extracting = try client(server.base, queue: queue, content: content, limit: false)
        let caught = waitUntil(extracting) {
            ((try? FileManager.default.contentsOfDirectory(atPath: content + "/com.example.faults")) ?? []).contains { $0.hasPrefix(".1.0.streaming-") || $0.hasPrefix(".1.0.extracting-") }
        }
        kill(extracting.processIdentifier, SIGKILL)
        extracting.waitUntilExit()
        #expect(caught, "extraction was not interrupted")
        kills += 1
        #expect(try finished() == nil && !FileManager.default.fileExists(atPath: installed))

        // Installed, not yet finished.
        let beforeFinish = try client(server.base, queue: queue, content: content, killAt: "installed", limit: false)
        beforeFinish.waitUntilExit()
        #expect(beforeFinish.terminationReason == .uncaughtSignal)
        kills += 1
        #expect(try finished() == nil, "finished although killed before finishing")
        #expect(FileManager.default.fileExists(atPath: installed + "/ContentInfo.plist"))
        #expect(kills == 10)
        // A run killed after saving the install but before deleting the partial archive (which
        // now happens off the fetcher's actor) leaves it behind: the next run deletes it.
        let journalFolder = content + "/.iap-fetch"
        let record = try #require(try FileManager.default.contentsOfDirectory(atPath: journalFolder).first { $0.hasSuffix("-com.example.faults.json") })
        let leftover = journalFolder + "/" + record.dropLast(".json".count) + ".partial"
        try Data(count: 4096).write(to: URL(fileURLWithPath: leftover))

        // The last run finishes it; another changes nothing.
        let last = try run(productsDirectory() + "/iap-fetch", ["run", "--server", server.base, "--queue", queue, "--content-dir", content])
        #expect(last.status == 0, "\(last.stderr)")
        #expect(!FileManager.default.fileExists(atPath: leftover), "the partial archive of an installed download was left behind")
        #expect(try Data(contentsOf: URL(fileURLWithPath: installed + "/Contents/payload.bin")) == payload)
        #expect(try run("diff", ["-r", source.sub("src"), installed + "/Contents"]).status == 0)
        let finishedAt = try #require(try finished())
        #expect(try run(productsDirectory() + "/iap-fetch", ["run", "--server", server.base, "--queue", queue, "--content-dir", content]).status == 0)
        #expect(try finished() == finishedAt)
        #expect(try FileManager.default.contentsOfDirectory(atPath: content + "/com.example.faults") == ["1.0"])
        #expect(server.stop() == 0)
    }
}

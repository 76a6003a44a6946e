import ContentArchive
import ContentFetch
import DurableFiles
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@Suite("iap-fetch against a real server", .serialized, .onTestThreads)
struct FetchTests {
    let bundleId = "com.example.app"

    /// A shop with the given folders packed (level 1) and published.
    func world(products: [String: String]) throws -> Shop {
        try Shop(products: products.mapValues { .folder($0) }, level: 1)
    }

    func fetch(_ w: Shop, _ extra: [String] = []) throws -> ProcessResult {
        try w.fetch(extra)
    }

    func repositoryContent(_ product: String) -> String {
        URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("content/\(product)/Contents").path
    }

    func events(_ output: String) -> [[String: Any]] {
        output.split(separator: "\n").compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
    }

    @Test("run installs every purchase, verified and atomically, and finishes each transaction only after its install")
    func installsAndFinishes() throws {
        let w = try world(products: [
            "com.example.cosmos.levels1": repositoryContent("com.example.cosmos.levels1"),
            "com.example.magazine.issue42": repositoryContent("com.example.magazine.issue42"),
        ])
        let a = try w.store.purchase(productId: "com.example.cosmos.levels1")
        let b = try w.store.purchase(productId: "com.example.magazine.issue42")
        let result = try fetch(w)
        #expect(result.status == 0, "\(result.stderr)")
        let updates = events(result.stdout)
        #expect(updates.contains { $0["state"] as? String == "active" && $0["productId"] as? String == "com.example.cosmos.levels1" })
        #expect(updates.filter { $0["state"] as? String == "finished" }.count == 2)
        #expect(updates.filter { $0["event"] as? String == "transaction-finished" }.count == 2)

        for (product, transaction) in [("com.example.cosmos.levels1", a), ("com.example.magazine.issue42", b)] {
            let installed = w.content + "/\(product)/1.0"
            #expect(try run("diff", ["-r", repositoryContent(product), installed + "/Contents"]).status == 0)
            let plist = try ContentInfo(plist: Data(contentsOf: URL(fileURLWithPath: installed + "/ContentInfo.plist")), source: "plist")
            #expect(plist.productIdentifier.rawValue == product)
            let id = transaction.transaction.transactionId!
            let finished = try #require(try FileTransactionQueue(folder: w.queue).transaction(id)?.finishedAt)
            let record = try #require(try DownloadJournal(contentDirectory: w.content).load("\(id)-\(product)"))
            let installedAt = try #require(record.installedAt)
            // Both times are stored to the millisecond, so "not before" allows that much.
            #expect(finished >= installedAt.addingTimeInterval(-0.001), "finished before the content was installed")
        }
        // A second run has nothing to do, and finishes nothing twice.
        let before = try FileTransactionQueue(folder: w.queue).all().map(\.finishedAt)
        #expect(try fetch(w).status == 0)
        #expect(try FileTransactionQueue(folder: w.queue).all().map(\.finishedAt) == before)
        #expect(w.server.stop() == 0)
    }

    @Test("killed with SIGKILL at several points, it resumes from its journal to identical bytes, finished exactly once")
    func survivesKills() throws {
        let tmp = try TemporaryFolder()
        let source = tmp.sub("big")
        try FileManager.default.createDirectory(atPath: source, withIntermediateDirectories: true)
        var generator = SystemRandomNumberGenerator()
        let payload = Data((0..<(24 << 20)).map { _ in UInt8.random(in: 0...255, using: &generator) })
        try payload.write(to: URL(fileURLWithPath: source + "/payload.bin"))
        let w = try world(products: ["com.example.big": source])
        let purchase = try w.store.purchase(productId: "com.example.big")
        let id = purchase.transaction.transactionId!
        let journal = try DownloadJournal(contentDirectory: w.content)
        var resumedFrom: [Int64] = []
        for threshold: Int64 in [4 << 20, 12 << 20, 20 << 20] {
            let client = Process()
            client.executableURL = URL(fileURLWithPath: productsDirectory() + "/iap-fetch")
            client.arguments = ["run", "--server", w.server.base, "--queue", w.queue, "--content-dir", w.content, "--limit-rate", "8M", "--json"]
            client.standardOutput = FileHandle.nullDevice
            client.standardError = FileHandle.nullDevice
            try client.run()
            // Wait (bounded) until the journal shows the bytes durable, then kill without warning.
            let deadline = Date().addingTimeInterval(60)
            while client.isRunning, Date() < deadline, (journal.load("\(id)-com.example.big")?.recordedLength ?? 0) < threshold { usleep(2_000) }
            kill(client.processIdentifier, SIGKILL)
            client.waitUntilExit()
            let durable = journal.load("\(id)-com.example.big")?.recordedLength ?? 0
            #expect(durable >= threshold)
            resumedFrom.append(durable)
            #expect(try FileTransactionQueue(folder: w.queue).transaction(id)?.finishedAt == nil, "finished while not installed")
            #expect(!FileManager.default.fileExists(atPath: w.content + "/com.example.big/1.0"))
        }
        let last = try fetch(w)
        #expect(last.status == 0, "\(last.stderr)")
        // The final run continued from the journal instead of starting over.
        let firstActive = events(last.stdout).first { $0["state"] as? String == "active" }
        #expect((firstActive?["bytesReceived"] as? Int).map { Int64($0) >= resumedFrom.last! } == true)
        #expect(try Data(contentsOf: URL(fileURLWithPath: w.content + "/com.example.big/1.0/Contents/payload.bin")) == payload)
        let finished = try #require(try FileTransactionQueue(folder: w.queue).transaction(id)?.finishedAt)
        #expect(try fetch(w).status == 0)
        #expect(try FileTransactionQueue(folder: w.queue).transaction(id)?.finishedAt == finished)
        #expect(!FileManager.default.fileExists(atPath: journal.partialPath("\(id)-com.example.big")))
    }

    @Test("killed while its partial archive leaves a stored file's bytes to the extraction, the next run copies them back from the folder and fetches only the rest")
    func killedWhileLeavingOut() throws {
        let tmp = try TemporaryFolder()
        let payload = pseudoRandomBytes(24 << 20, seed: 44)
        try tmp.write("big/payload.bin", payload)
        let w = try world(products: ["com.example.big": tmp.sub("big")])
        let purchase = try w.store.purchase(productId: "com.example.big")
        let id = "\(purchase.transaction.transactionId!)-com.example.big"
        let journal = try DownloadJournal(contentDirectory: w.content)
        let (client, _) = try w.startClient([], environment: ["IAP_FETCH_KILL_AT": "half-recorded"])
        defer { if client.isRunning { kill(client.processIdentifier, SIGKILL) } }
        client.waitUntilExit()
        #expect(client.terminationReason == .uncaughtSignal && client.terminationStatus == SIGKILL)
        let record = try #require(journal.load(id))
        let folder = try #require(record.streamedInto)
        #expect(record.recordedLength >= 12 << 20 && record.recordedLength < 24 << 20)
        let entry = try #require(w.manifests["com.example.big"]?.entries.first { $0.path == "Contents/payload.bin" })
        let partial = try Data(contentsOf: URL(fileURLWithPath: journal.partialPath(id)))
        let block = Int((entry.dataOffset + (4 << 20)) / 4096 * 4096)
        #expect(partial.count > block + 4096 && partial[block..<(block + 4096)].allSatisfy { $0 == 0 }, "the bytes were left out")
        #expect(FileManager.default.fileExists(atPath: w.content + "/com.example.big/" + folder + "/Contents/payload.bin"))
        let result = try fetch(w)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(!result.stdout.contains("\"integrity\""), "no byte had to be found wrong: \(result.stdout.suffix(600))")
        // Resumed from what the folder held: at most what its writer had not written yet is fetched again.
        let resumed = events(result.stdout).first { $0["state"] as? String == "active" }?["bytesReceived"] as? Int
        #expect(resumed.map { Int64($0) >= record.recordedLength - (8 << 20) } == true, "resumed from \(String(describing: resumed)) of \(record.recordedLength)")
        let installed = try Data(contentsOf: URL(fileURLWithPath: w.content + "/com.example.big/1.0/Contents/payload.bin"))
        #expect(installed == payload ? true : false, "the installed file differs from the one packed")
        #expect(try FileManager.default.contentsOfDirectory(atPath: w.content + "/com.example.big") == ["1.0"])
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }

    @Test("an extraction given up half-way puts back into the partial archive the bytes it held, the rest is written there as it arrives, and the install extracts the archive")
    func extractionGivenUpHalfWay() throws {
        let tmp = try TemporaryFolder()
        let payload = pseudoRandomBytes(24 << 20, seed: 45)
        try tmp.write("big/payload.bin", payload)
        try tmp.write("big/notes.txt", "small enough to be placed at the install\n")
        let w = try world(products: ["com.example.big": tmp.sub("big")])
        let purchase = try w.store.purchase(productId: "com.example.big")
        let result = try w.fetch([], prefix: ["export IAP_FETCH_REFUSE=extraction"])
        #expect(result.status == 0, "\(result.stderr)")
        // Bytes left out and not put back would have failed the install's CRC-32 checks.
        #expect(!result.stdout.contains("\"failed\"") && !result.stdout.contains("\"integrity\""), "\(result.stdout.suffix(600))")
        #expect(try run("diff", ["-r", tmp.sub("big"), w.content + "/com.example.big/1.0/Contents"]).status == 0)
        #expect(try FileManager.default.contentsOfDirectory(atPath: w.content + "/com.example.big") == ["1.0"])
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }

    @Test("killed while extracting, the next run cleans up, installs identical content and finishes once")
    func killedWhileExtracting() throws {
        let tmp = try TemporaryFolder()
        // Many small files: each is synced on install, so extraction takes long enough to interrupt.
        for i in 0..<1500 { try tmp.write("many/file-\(i).txt", "content of file \(i)\n") }
        let w = try world(products: ["com.example.many": tmp.sub("many")])
        let purchase = try w.store.purchase(productId: "com.example.many")
        let client = Process()
        client.executableURL = URL(fileURLWithPath: productsDirectory() + "/iap-fetch")
        client.arguments = ["run", "--server", w.server.base, "--queue", w.queue, "--content-dir", w.content]
        client.standardOutput = FileHandle.nullDevice
        client.standardError = FileHandle.nullDevice
        try client.run()
        let product = w.content + "/com.example.many"
        var caught = false
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline {
            let names = (try? FileManager.default.contentsOfDirectory(atPath: product)) ?? []
            // Its hidden folder: extracted as the archive arrives (or, without a manifest, after).
            if names.contains(where: { $0.hasPrefix(".1.0.streaming-") || $0.hasPrefix(".1.0.extracting-") }) {
                kill(client.processIdentifier, SIGKILL)
                caught = true
                break
            }
            usleep(500)
        }
        client.waitUntilExit()
        #expect(caught, "the client finished before extraction could be interrupted")
        #expect(!FileManager.default.fileExists(atPath: product + "/1.0"), "a half-extracted folder was installed")
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt == nil)
        let result = try fetch(w)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(try run("diff", ["-r", tmp.sub("many"), product + "/1.0/Contents"]).status == 0)
        #expect(try FileManager.default.contentsOfDirectory(atPath: product) == ["1.0"], "leftovers beside the installed version")
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }

    @Test("the archive is extracted as it arrives: at the SHA-256 check its large files are written in a hidden folder, which the install puts in place")
    func extractedWhileDownloading() async throws {
        let tmp = try TemporaryFolder()
        try tmp.write("src/payload.bin", pseudoRandomBytes(6 << 20, seed: 21))
        try tmp.write("src/text/story.txt", (0..<60_000).map { "line \($0): level \($0 &* 7919 % 10007) was downloaded\n" }.joined())
        try tmp.write("src/empty.dat", Data())
        for i in 0..<50 { try tmp.write("src/levels/\(i % 5)/level-\(i).json", "{\"level\": \(i)}\n") }
        let w = try world(products: ["com.example.stream": tmp.sub("src")])
        let methods = Set(try #require(w.manifests["com.example.stream"]).entries.filter { $0.kind == .file }.map(\.method))
        #expect(methods == [.stored, .deflate], "both methods are extracted")
        let purchase = try w.store.purchase(productId: "com.example.stream")
        let product = w.content + "/com.example.stream"
        // What a run killed while extracting another version left: removed before this one counts its space.
        let leftover = product + "/.0.9.streaming-1-1"
        try FileManager.default.createDirectory(atPath: leftover + "/Contents", withIntermediateDirectories: true)
        #expect(FileManager.default.createFile(atPath: leftover + "/Contents/big.bin", contents: Data(count: 1 << 20)))
        let (client, _) = try w.startClient([], environment: ["IAP_FETCH_STOP_AT": "verified"])
        defer { if client.isRunning { kill(client.processIdentifier, SIGKILL) } }
        let stopped = await waitUntil(.seconds(60)) {
            ((try? String(contentsOfFile: "/proc/\(client.processIdentifier)/stat", encoding: .utf8)) ?? "").split(separator: " ").dropFirst(2).first == "T"
        }
        try #require(stopped != nil, "iap-fetch never reached the SHA-256 check")
        // Every byte is received and checked, nothing is installed yet: the large files are written
        // (1 MiB and more; the small ones are placed from the archive at the install).
        let hidden = try #require(try FileManager.default.contentsOfDirectory(atPath: product).first { $0.hasPrefix(".1.0.streaming-") })
        #expect(!FileManager.default.fileExists(atPath: product + "/1.0"))
        for path in ["payload.bin", "text/story.txt"] {
            #expect(FileManager.default.contents(atPath: product + "/" + hidden + "/Contents/" + path) == FileManager.default.contents(atPath: tmp.sub("src/" + path)))
        }
        #expect(!FileManager.default.fileExists(atPath: product + "/" + hidden + "/Contents/levels/0/level-0.json"))
        #expect(!FileManager.default.fileExists(atPath: leftover))
        // The partial archive left the stored file's whole blocks to the extraction (each byte
        // written once), and its journal names the folder that holds them.
        let payload = try #require(w.manifests["com.example.stream"]?.entries.first { $0.path == "Contents/payload.bin" })
        #expect(payload.method == .stored)
        let journal = try DownloadJournal(contentDirectory: w.content)
        let id = "\(purchase.transaction.transactionId!)-com.example.stream"
        #expect(journal.load(id)?.streamedInto == hidden)
        let partial = try #require(FileHandle(forReadingAtPath: journal.partialPath(id)))
        try partial.seek(toOffset: (payload.dataOffset + 4095) / 4096 * 4096)
        let middle = try #require(try partial.read(upToCount: 4 << 20))
        try partial.close()
        #expect(middle.count == 4 << 20 && middle.allSatisfy { $0 == 0 }, "the stored file's bytes are in the partial archive too")
        // The live one is locked by its process: a sweep (another iap-fetch's) leaves it.
        #expect(UnfinishedFiles.removeLeftovers(in: product, minimumAge: 0) { $0.contains(".streaming-") }.isEmpty)
        let streamed = try #require(try FileManager.default.attributesOfItem(atPath: product + "/" + hidden + "/Contents/payload.bin")[.systemFileNumber] as? Int)
        kill(client.processIdentifier, SIGCONT)
        client.waitUntilExit()
        #expect(client.terminationStatus == 0)
        #expect(try run("diff", ["-r", tmp.sub("src"), product + "/1.0/Contents"]).status == 0)
        let installed = try FileManager.default.attributesOfItem(atPath: product + "/1.0/Contents/payload.bin")[.systemFileNumber] as? Int
        #expect(installed == streamed, "the install put the extracted folder in place instead of extracting the archive again")
        #expect(try FileManager.default.contentsOfDirectory(atPath: product) == ["1.0"])
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }

    @Test("an archive damaged on the server: iap-fetch fails naming the server's reason, installs nothing, and the purchase stays unfinished")
    func damagedOnServer() throws {
        let w = try world(products: ["com.example.soundkit.drums": repositoryContent("com.example.soundkit.drums")])
        let purchase = try w.store.purchase(productId: "com.example.soundkit.drums")
        let archives = w.tmp.sub("data/archives")
        let archive = try #require(try FileManager.default.contentsOfDirectory(atPath: archives).first { $0.hasSuffix(".zip") })
        chmod(archives + "/" + archive, 0o644)
        #expect(truncate(archives + "/" + archive, 100) == 0)
        let result = try fetch(w)
        #expect(result.status != 0)
        #expect(
            result.stdout.contains("the server answered 503: the archive for com.example.soundkit.drums 1.0 is damaged on this server"),
            "\(result.stdout.suffix(600)) \(result.stderr)")
        #expect(!FileManager.default.fileExists(atPath: w.content + "/com.example.soundkit.drums/1.0"))
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt == nil)
    }

    @Test(
        "an archive damaged on the server at its published size (no stat tells): the same wrong bytes twice fail the download at the second, not the fifth, naming the server's copy; the next run asks again"
    )
    func sameWrongBytesTwice() throws {
        let w = try Shop(products: ["com.example.rotten": .random(3 << 20)], level: 1)
        let purchase = try w.store.purchase(productId: "com.example.rotten")
        let archives = w.tmp.sub("data/archives")
        let archive = archives + "/" + (try #require(try FileManager.default.contentsOfDirectory(atPath: archives).first { $0.hasSuffix(".zip") }))
        chmod(archive, 0o644)
        let bytes = try Data(contentsOf: URL(fileURLWithPath: archive))
        let file = try #require(FileHandle(forUpdatingAtPath: archive))
        try file.seek(toOffset: UInt64(bytes.count / 2))
        try file.write(contentsOf: Data([bytes[bytes.count / 2] ^ 0x01]))
        try file.close()

        func integrityUpdates(_ result: ProcessResult) -> [[String: Any]] {
            events(result.stdout).filter { ($0["error"] as? [String: Any])?["code"] as? String == "integrity" }
        }
        let result = try fetch(w)
        #expect(result.status != 0)
        let updates = integrityUpdates(result)
        // One retry after the first wrong bytes, then failed: two transfers, where five were made.
        #expect(updates.filter { $0["state"] as? String == "waiting" }.count == 1, "\(result.stdout)")
        let failed = try #require(updates.last { $0["state"] as? String == "failed" }, "\(result.stdout)")
        let message = (failed["error"] as? [String: Any])?["message"] as? String ?? ""
        #expect(message.contains("the same wrong bytes twice: the server's copy of the archive is damaged"), "\(message)")
        #expect(!FileManager.default.fileExists(atPath: w.content + "/com.example.rotten/1.0"))
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt == nil)

        // Repaired on the server: the next run downloads and finishes it.
        try bytes.write(to: URL(fileURLWithPath: archive))
        let again = try fetch(w)
        #expect(again.status == 0, "\(again.stdout.suffix(600)) \(again.stderr)")
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }

    @Test("content installed but not yet finished (stopped in between) is finished without downloading again")
    func installedNotFinished() throws {
        let w = try world(products: ["com.example.soundkit.drums": repositoryContent("com.example.soundkit.drums")])
        let purchase = try w.store.purchase(productId: "com.example.soundkit.drums")
        try purchase.signedTransaction.write(toFile: w.tmp.sub("tx.jws"), atomically: true, encoding: .utf8)
        // `get` installs from a lone transaction and finishes nothing: the state a stop before finish leaves.
        let got = try run(productsDirectory() + "/iap-fetch", ["get", "--server", w.server.base, "--transaction", w.tmp.sub("tx.jws"), "--content-dir", w.content])
        #expect(got.status == 0, "\(got.stderr)")
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt == nil)
        let result = try fetch(w)
        #expect(result.status == 0)
        #expect(!events(result.stdout).contains { $0["state"] as? String == "active" }, "it downloaded again")
        #expect(try FileTransactionQueue(folder: w.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
    }

    @Test("a content update: 1.1 is installed beside 1.0, then replaces it only once complete")
    func contentUpdate() throws {
        let w = try world(products: ["com.example.cosmos.levels1": repositoryContent("com.example.cosmos.levels1")])
        let purchase = try w.store.purchase(productId: "com.example.cosmos.levels1")
        #expect(try fetch(w).status == 0)
        #expect(FileManager.default.fileExists(atPath: w.content + "/com.example.cosmos.levels1/1.0/ContentInfo.plist"))

        // The publisher ships 1.1 (one more level); the app notices and downloads again with its transaction.
        let updated = w.tmp.sub("updated")
        try FileManager.default.copyItem(atPath: repositoryContent("com.example.cosmos.levels1"), toPath: updated)
        try Data("{\"id\": \"ring-11\"}\n".utf8).write(to: URL(fileURLWithPath: updated + "/levels/ring-11.json"))
        try w.publish(folder: updated, product: "com.example.cosmos.levels1", version: "1.1")
        try purchase.signedTransaction.write(toFile: w.tmp.sub("tx.jws"), atomically: true, encoding: .utf8)
        let got = try run(productsDirectory() + "/iap-fetch", ["get", "--server", w.server.base, "--transaction", w.tmp.sub("tx.jws"), "--content-dir", w.content, "--json"])
        #expect(got.status == 0, "\(got.stderr)")
        let product = w.content + "/com.example.cosmos.levels1"
        #expect(FileManager.default.fileExists(atPath: product + "/1.1/Contents/levels/ring-11.json"))
        #expect(!FileManager.default.fileExists(atPath: product + "/1.0"), "the old version was not removed")
        let plist = try ContentInfo(plist: Data(contentsOf: URL(fileURLWithPath: product + "/1.1/ContentInfo.plist")), source: "plist")
        #expect(plist.contentVersion.string == "1.1")
    }

    @Test("run --updates brings finished purchases to the version now granted (a delta), says which are up to date, and leaves consumables alone")
    func updates() throws {
        let w = try world(products: [
            "com.example.cosmos.levels1": repositoryContent("com.example.cosmos.levels1"),
            "com.example.magazine.issue42": repositoryContent("com.example.magazine.issue42"),
        ])
        let levels = try w.store.purchase(productId: "com.example.cosmos.levels1")
        _ = try w.store.purchase(productId: "com.example.magazine.issue42")
        let coins = try w.store.purchase(productId: "com.example.coins100", type: .consumable)
        // In plain lines: each finished download says what this run fetched and how long it took.
        let first = try run(productsDirectory() + "/iap-fetch", ["run", "--server", w.server.base, "--queue", w.queue, "--content-dir", w.content])
        #expect(first.status == 0, "\(first.stderr)")
        let levelsLine = first.stdout.split(separator: "\n").first { $0.hasPrefix("com.example.cosmos.levels1 1.0 [") && $0.contains(" finished ") }
        #expect(levelsLine?.contains(#/ finished \(\d+\.\d KB in \d+\.\d+ s(, \d+\.\d MB/s)?\) -> /#) == true, "\(first.stdout)")
        _ = try FileTransactionQueue(folder: w.queue).finishNow(coins.transaction.transactionId!)

        // 1.1 is out; a plain run has nothing to do, as every purchase is finished.
        let updated = w.tmp.sub("updated")
        try FileManager.default.copyItem(atPath: repositoryContent("com.example.cosmos.levels1"), toPath: updated)
        try Data("{\"id\": \"ring-11\"}\n".utf8).write(to: URL(fileURLWithPath: updated + "/levels/ring-11.json"))
        try w.publish(folder: updated, product: "com.example.cosmos.levels1", version: "1.1")
        let plain = try fetch(w)
        #expect(plain.status == 0 && plain.stderr.contains("no unfinished transactions"))
        #expect(InstalledContent.product("com.example.cosmos.levels1", in: w.content)?.contentVersion == "1.0")

        let checked = try fetch(w, ["--updates"])
        #expect(checked.status == 0, "\(checked.stderr)")
        let said = events(checked.stdout)
        #expect(
            said.contains {
                $0["event"] as? String == "content-updated" && $0["productId"] as? String == "com.example.cosmos.levels1" && $0["from"] as? String == "1.0" && $0["to"] as? String == "1.1"
            })
        #expect(said.contains { $0["event"] as? String == "content-up-to-date" && $0["productId"] as? String == "com.example.magazine.issue42" })
        // Only the changed entries were fetched, and the finished transactions are not said to finish again.
        // The new level and the plist (which names the version).
        #expect(said.contains { ($0["delta"] as? String)?.contains("delta: 2 of 16 entries") == true }, "\(checked.stdout)")
        #expect(!said.contains { $0["event"] as? String == "transaction-finished" })
        #expect(!checked.stderr.contains("coins100"), "a consumable was asked about")
        let product = w.content + "/com.example.cosmos.levels1"
        #expect(try FileManager.default.contentsOfDirectory(atPath: product).filter { !$0.hasPrefix(".") } == ["1.1"])
        #expect(try run("diff", ["-r", updated, product + "/1.1/Contents"]).status == 0)
        #expect(try FileTransactionQueue(folder: w.queue).transaction(levels.transaction.transactionId!)?.finishedAt != nil)

        // Checked again: nothing is downloaded, and both are up to date (plain lines without --json).
        let again = try run(productsDirectory() + "/iap-fetch", ["run", "--server", w.server.base, "--queue", w.queue, "--content-dir", w.content, "--updates"])
        #expect(again.status == 0, "\(again.stderr)")
        #expect(again.stdout.contains("com.example.cosmos.levels1 1.1 is up to date") && again.stdout.contains("com.example.magazine.issue42 1.0 is up to date"), "\(again.stdout)")
        #expect(!again.stdout.contains("active"), "it downloaded again: \(again.stdout)")
        #expect(again.stdout.contains("com.example.magazine.issue42 1.0 already installed -> \(w.content)/com.example.magazine.issue42/1.0"), "\(again.stdout)")
        #expect(!again.stdout.contains("finished"), "an installed version read as a download done again: \(again.stdout)")

        // A refunded purchase owns no content any more: said, not a failure, and nothing is removed.
        let refund = try w.store.refund(transactionId: levels.transaction.transactionId!)
        #expect(try postJSON(w.server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: w.tmp).status == 200)
        let afterRefund = try fetch(w, ["--updates"])
        #expect(afterRefund.status == 0, "\(afterRefund.stderr)")
        #expect(
            afterRefund.stderr.contains("transaction \(levels.transaction.transactionId!) (com.example.cosmos.levels1) was refunded or revoked, so its content is not brought up to date"),
            "\(afterRefund.stderr)")
        #expect(!events(afterRefund.stdout).contains { $0["state"] as? String == "failed" }, "\(afterRefund.stdout)")
        #expect(events(afterRefund.stdout).contains { $0["event"] as? String == "transaction-revoked" })
        // The product is said to be refunded, not up to date; the other one is up to date.
        let saidAfterRefund = Dictionary(
            events(afterRefund.stdout).compactMap { e in (e["productId"] as? String).map { ($0, e["event"] as? String ?? "") } }.filter { $0.1.hasPrefix("content-") },
            uniquingKeysWith: { "\($0),\($1)" })
        #expect(saidAfterRefund == ["com.example.cosmos.levels1": "content-refunded", "com.example.magazine.issue42": "content-up-to-date"], "\(afterRefund.stdout)")
        #expect(InstalledContent.product("com.example.cosmos.levels1", in: w.content)?.contentVersion == "1.1")
    }

    @Test("installed lists each product's complete install, the newer of two, ignoring hidden, partial and foreign folders")
    func installedContent() throws {
        let w = try world(products: [
            "com.example.cosmos.levels1": repositoryContent("com.example.cosmos.levels1"),
            "com.example.magazine.issue42": repositoryContent("com.example.magazine.issue42"),
        ])
        let listedEmpty = try run(productsDirectory() + "/iap-fetch", ["installed", "--content-dir", w.content])
        #expect(listedEmpty.status == 1 && listedEmpty.stderr.contains("is not a folder"))
        _ = try w.store.purchase(productId: "com.example.cosmos.levels1")
        _ = try w.store.purchase(productId: "com.example.magazine.issue42")
        #expect(try fetch(w).status == 0)
        // What a stopped run or a person may leave: none of it is installed content.
        let levels = w.content + "/com.example.cosmos.levels1"
        try FileManager.default.createDirectory(atPath: levels + "/.1.1.extracting-123/Contents", withIntermediateDirectories: true)
        try FileManager.default.createDirectory(atPath: levels + "/2.0/Contents", withIntermediateDirectories: true)  // no plist
        try FileManager.default.createDirectory(atPath: w.content + "/notes", withIntermediateDirectories: true)
        // A version folder whose plist names another version is not that version.
        try FileManager.default.copyItem(atPath: levels + "/1.0", toPath: levels + "/3.0")
        // Two complete versions (a run stopped between installing one and removing the other): the newest.
        let magazine = w.content + "/com.example.magazine.issue42"
        let plist = try String(contentsOfFile: magazine + "/1.0/ContentInfo.plist", encoding: .utf8)
        try FileManager.default.copyItem(atPath: magazine + "/1.0", toPath: magazine + "/1.2")
        try FileManager.default.removeItem(atPath: magazine + "/1.2/ContentInfo.plist")
        try plist.replacingOccurrences(of: "<string>1.0</string>", with: "<string>1.2</string>").write(
            toFile: magazine + "/1.2/ContentInfo.plist", atomically: true, encoding: .utf8)

        let listed = InstalledContent.all(in: w.content)
        #expect(listed.map { "\($0.productId) \($0.contentVersion)" } == ["com.example.cosmos.levels1 1.0", "com.example.magazine.issue42 1.2"])
        #expect(listed.first?.contentURL.path == levels + "/1.0")
        #expect(InstalledContent.product("com.example.other", in: w.content) == nil)
        let cli = try run(productsDirectory() + "/iap-fetch", ["installed", "--content-dir", w.content, "--json"])
        #expect(cli.status == 0, "\(cli.stderr)")
        let entries = try #require(try JSONSerialization.jsonObject(with: Data(cli.stdout.utf8)) as? [[String: Any]])
        #expect(entries.map { $0["contentVersion"] as? String } == ["1.0", "1.2"])
        #expect((entries.first?["contentURL"] as? String)?.hasSuffix("/com.example.cosmos.levels1/1.0/") == true)
    }

    @Test("after a rollback, the version the server grants replaces a newer one installed: the rolled-back version does not stay beside it")
    func rollbackReplacesNewer() throws {
        let w = try world(products: ["com.example.cosmos.levels1": repositoryContent("com.example.cosmos.levels1")])
        let purchase = try w.store.purchase(productId: "com.example.cosmos.levels1")
        let updated = w.tmp.sub("updated")
        try FileManager.default.copyItem(atPath: repositoryContent("com.example.cosmos.levels1"), toPath: updated)
        try Data("{\"id\": \"ring-11\"}\n".utf8).write(to: URL(fileURLWithPath: updated + "/levels/ring-11.json"))
        try w.publish(folder: updated, product: "com.example.cosmos.levels1", version: "1.1")
        #expect(try fetch(w).status == 0)
        let product = w.content + "/com.example.cosmos.levels1"
        #expect(FileManager.default.fileExists(atPath: product + "/1.1/Contents/levels/ring-11.json"))

        // 1.1 turns out bad and is rolled back; the app asks again with its transaction.
        let rollback = try run(productsDirectory() + "/iap-server", ["rollback", "--data", w.tmp.sub("data"), "com.example.cosmos.levels1", "1.1"])
        #expect(rollback.status == 0, "\(rollback.stderr)")
        try purchase.signedTransaction.write(toFile: w.tmp.sub("tx.jws"), atomically: true, encoding: .utf8)
        let got = try run(productsDirectory() + "/iap-fetch", ["get", "--server", w.server.base, "--transaction", w.tmp.sub("tx.jws"), "--content-dir", w.content])
        #expect(got.status == 0, "\(got.stderr)")
        #expect(try FileManager.default.contentsOfDirectory(atPath: product).filter { !$0.hasPrefix(".") } == ["1.0"])
        #expect(InstalledContent.product("com.example.cosmos.levels1", in: w.content)?.contentVersion == "1.0")
        #expect(try run("diff", ["-r", repositoryContent("com.example.cosmos.levels1"), product + "/1.0/Contents"]).status == 0)
    }

    @Test("a purchase without hosted content (a consumable) is left unfinished to the app, not failed; content published later is fetched by the next run")
    func withoutHostedContent() throws {
        let w = try world(products: ["com.example.cosmos.levels1": repositoryContent("com.example.cosmos.levels1")])
        let good = try w.store.purchase(productId: "com.example.cosmos.levels1")
        let coins = try w.store.purchase(productId: "com.example.magazine.issue42")
        let first = try fetch(w)
        #expect(first.status == 0, "\(first.stderr)")
        let coinsId = coins.transaction.transactionId!
        #expect(first.stderr.contains("transaction \(coinsId) (com.example.magazine.issue42) has nothing to download"))
        #expect(first.stderr.contains("no hosted content is published for product com.example.magazine.issue42"))
        #expect(first.stderr.contains("stays unfinished for the app"))
        let said = events(first.stdout)
        #expect(said.contains { $0["event"] as? String == "transaction-without-content" && $0["transactionId"] as? String == coinsId })
        // No download exists for it: nothing says it failed.
        #expect(!said.contains { $0["transactionId"] as? String == coinsId && ($0["state"] as? String == "failed" || $0["event"] as? String == "transaction-failed") })
        let queue = try FileTransactionQueue(folder: w.queue)
        #expect(try queue.transaction(good.transaction.transactionId!)?.finishedAt != nil)
        #expect(try queue.transaction(coinsId)?.finishedAt == nil)
        #expect(!FileManager.default.fileExists(atPath: w.content + "/com.example.magazine.issue42"))

        // `get` asks for that transaction's content: there is none, and it says so with exit 1.
        try coins.signedTransaction.write(toFile: w.tmp.sub("coins.jws"), atomically: true, encoding: .utf8)
        let got = try run(productsDirectory() + "/iap-fetch", ["get", "--server", w.server.base, "--transaction", w.tmp.sub("coins.jws"), "--content-dir", w.content])
        #expect(got.status == 1)
        #expect(got.stderr.contains("no hosted content is published for product com.example.magazine.issue42"))

        // The content is published later; the next run completes the unfinished transaction.
        try w.publish(folder: repositoryContent("com.example.magazine.issue42"), product: "com.example.magazine.issue42", version: "1.0")
        #expect(try fetch(w).status == 0)
        #expect(try queue.transaction(coinsId)?.finishedAt != nil)
        #expect(try run("diff", ["-r", repositoryContent("com.example.magazine.issue42"), w.content + "/com.example.magazine.issue42/1.0/Contents"]).status == 0)
    }

    @Test("of several purchases, a refunded one is named and left unfinished for the app, the others finished, exit 0; get fails on it")
    func refundedAmongOthers() throws {
        let w = try world(products: [
            "com.example.cosmos.levels1": repositoryContent("com.example.cosmos.levels1"),
            "com.example.magazine.issue42": repositoryContent("com.example.magazine.issue42"),
        ])
        let good = try w.store.purchase(productId: "com.example.cosmos.levels1")
        let refunded = try w.store.purchase(productId: "com.example.magazine.issue42")
        let refundedId = refunded.transaction.transactionId!
        let refund = try w.store.refund(transactionId: refundedId)
        #expect(try postJSON(w.server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: w.tmp).status == 200)
        let first = try fetch(w)
        #expect(first.status == 0, "\(first.stderr)")
        #expect(first.stderr.contains("transaction \(refundedId) (com.example.magazine.issue42) was refunded or revoked, so it gets no content"), "\(first.stderr)")
        #expect(first.stderr.contains("it stays unfinished for the app to withdraw what it bought and finish"))
        #expect(!first.stderr.contains("failed"), "\(first.stderr)")
        let revoked = events(first.stdout).filter { $0["event"] as? String == "transaction-revoked" }
        #expect(revoked.count == 1 && revoked.first?["transactionId"] as? String == refundedId)
        #expect(revoked.first?["productId"] as? String == "com.example.magazine.issue42")
        #expect(!events(first.stdout).contains { $0["event"] as? String == "transaction-failed" })
        // No download was started, so none is reported failed (one under way is: FaultTests).
        #expect(!events(first.stdout).contains { $0["state"] as? String == "failed" }, "\(first.stdout)")
        let queue = try FileTransactionQueue(folder: w.queue)
        #expect(try queue.transaction(good.transaction.transactionId!)?.finishedAt != nil)
        #expect(try queue.transaction(refundedId)?.finishedAt == nil)
        #expect(!FileManager.default.fileExists(atPath: w.content + "/com.example.magazine.issue42"))

        // Every later run says the same and still exits 0, until the app finishes it.
        let second = try fetch(w)
        #expect(second.status == 0 && second.stderr.contains("gets no content"), "\(second.stderr)")
        // `get` asks for that purchase's content: there it is a failure.
        try refunded.signedTransaction.write(toFile: w.tmp.sub("refunded.jws"), atomically: true, encoding: .utf8)
        let got = try run(productsDirectory() + "/iap-fetch", ["get", "--server", w.server.base, "--transaction", w.tmp.sub("refunded.jws"), "--content-dir", w.content])
        #expect(got.status == 1)
        #expect(got.stderr.contains("refunded or revoked"), "\(got.stderr)")
    }
}

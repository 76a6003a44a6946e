import ContentFetch
import Foundation
import IAPTestSupport
import Testing
import TransactionQueue

@Suite("iap-fetch with a content folder it may not write", .onTestThreads)
struct ReadOnlyTests {
    @Test("a read-only content folder fails the install with the reason, nothing half-installed; fixed, the next run installs without downloading again")
    func readOnlyContentFolder() throws {
        let shop = try Shop(products: ["com.example.big": .random(3 << 20)])
        let purchase = try shop.store.purchase(productId: "com.example.big").transaction.transactionId!
        let id = "\(purchase)-com.example.big"
        try FileManager.default.createDirectory(atPath: shop.content + "/.iap-fetch", withIntermediateDirectories: true)
        // Root writes anywhere, so the client runs as nobody: it may write its journal, not the content folder.
        #expect(try run("chown", ["-R", "65534:65534", shop.tmp.path]).status == 0)
        #expect(chmod(shop.content, 0o555) == 0)
        let fetch = [
            "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", productsDirectory() + "/iap-fetch",
            "run", "--server", shop.server.base, "--queue", shop.queue, "--content-dir", shop.content, "--json",
        ]
        let refused = try run("/usr/bin/env", fetch)
        #expect(refused.status == 1)
        #expect(refused.stderr.contains("com.example.big") && refused.stderr.lowercased().contains("permission"), "\(refused.stderr)")
        #expect(!FileManager.default.fileExists(atPath: shop.content + "/com.example.big"), "nothing half-installed")
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(purchase)?.finishedAt == nil)
        let journal = try DownloadJournal(contentDirectory: shop.content)
        #expect(journal.load(id)?.state == .failed)

        #expect(chmod(shop.content, 0o755) == 0)
        let fixed = try run("/usr/bin/env", fetch)
        #expect(fixed.status == 0, "\(fixed.stderr)")
        let updates = fixed.stdout.split(separator: "\n").compactMap { try? JSONDecoder().decode(DownloadUpdate.self, from: Data($0.utf8)) }
        let active = updates.filter { $0.state == .active }
        #expect(
            !active.isEmpty && active.allSatisfy { $0.bytesReceived == $0.expectedContentLength },
            "the verified bytes on disk were installed, not downloaded again")
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(purchase)?.finishedAt != nil)
    }

    @Test("a content folder that is a file, or lies under one, is refused with what is wrong and where")
    func contentFolderIsAFile() throws {
        let tmp = try TemporaryFolder()
        let file = try tmp.write("device", "not a folder")
        for (path, says) in [(file, "\(file) exists and is not a folder"), (file + "/inner", "part of the path is not a folder")] {
            let error = try #require(throws: FetchError.self) { try DownloadJournal(contentDirectory: path) }
            #expect(error.message.contains("--content-dir") && error.message.contains(says), "\(error.message)")
        }
        #expect(try String(contentsOfFile: file, encoding: .utf8) == "not a folder")
    }

    @Test("status and cancel only look: a content folder that does not exist is said so and not made")
    func lookingCreatesNothing() throws {
        let tmp = try TemporaryFolder()
        let missing = tmp.sub("typo/device")
        let status = try run(productsDirectory() + "/iap-fetch", ["status", "--content-dir", missing])
        #expect(status.status == 0 && status.stdout.contains("\(missing) does not exist"), "\(status.stdout) \(status.stderr)")
        let json = try run(productsDirectory() + "/iap-fetch", ["status", "--content-dir", missing, "--json"])
        #expect(json.status == 0 && json.jsonArray?.isEmpty == true, "\(json.stdout)")
        let cancel = try run(productsDirectory() + "/iap-fetch", ["cancel", "d1", "--content-dir", missing])
        #expect(cancel.status != 0 && cancel.stderr.contains("\(missing) does not exist"), "\(cancel.stderr)")
        #expect(!FileManager.default.fileExists(atPath: tmp.sub("typo")), "a folder was made by a command that only looks")

        let file = try tmp.write("device", "not a folder")
        let onFile = try run(productsDirectory() + "/iap-fetch", ["status", "--content-dir", file])
        #expect(onFile.status == 1 && onFile.stderr.contains("exists and is not a folder"), "\(onFile.stderr)")

        // A journal that cannot be read is an error, not "no downloads". Permission bits do not
        // stop root, so an unprivileged user looks.
        if getuid() == 0 {
            let locked = tmp.sub("locked")
            try FileManager.default.createDirectory(atPath: locked + "/.iap-fetch", withIntermediateDirectories: true)
            chmod(locked + "/.iap-fetch", 0o000)
            chmod(tmp.path, 0o755)
            let result = try run(
                "setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", productsDirectory() + "/iap-fetch", "status", "--content-dir", locked])
            #expect(result.status == 1 && result.stderr.contains("cannot read the download journal") && result.stderr.contains("permission denied"), "\(result.stderr)")
            chmod(locked + "/.iap-fetch", 0o755)
        }
    }

    @Test("run over a queue folder that does not exist says so and makes nothing; over an empty queue it says there is nothing to download")
    func mistypedQueue() throws {
        let tmp = try TemporaryFolder()
        let fetch = productsDirectory() + "/iap-fetch"
        let server = ["--server", "http://127.0.0.1:9", "--content-dir", tmp.sub("device")]
        let missing = tmp.sub("sandbox/queu")
        let typo = try run(fetch, ["run", "--queue", missing] + server)
        #expect(typo.status == 1 && typo.stderr.contains("\(missing) does not exist") && typo.stderr.contains("<dir>/queue"), "\(typo.stderr)")
        let asJSON = try run(fetch, ["run", "--queue", missing, "--json"] + server)
        #expect(asJSON.status == 1 && asJSON.stdout.contains("\"not-found\""), "\(asJSON.stdout)")
        #expect(!FileManager.default.fileExists(atPath: missing), "a mistyped queue was made into an empty one")

        let file = try tmp.write("queue-file", "")
        let notFolder = try run(fetch, ["run", "--queue", file] + server)
        #expect(notFolder.status == 1 && notFolder.stderr.contains("is not a folder"), "\(notFolder.stderr)")

        let empty = tmp.sub("empty-queue")
        try FileManager.default.createDirectory(atPath: empty, withIntermediateDirectories: true)
        let nothing = try run(fetch, ["run", "--queue", empty] + server)
        #expect(nothing.status == 0 && nothing.stderr.contains("no unfinished transactions in \(empty)"), "\(nothing.stderr)")
    }
}

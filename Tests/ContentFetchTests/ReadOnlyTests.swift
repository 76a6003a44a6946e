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
}

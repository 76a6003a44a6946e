import Foundation
import IAPTestSupport
import Testing

@Suite("iap-fetch's answers to bad input", .onTestThreads)
struct CommandLineTests {
    func fetch(_ arguments: [String]) throws -> ProcessResult {
        try run(productsDirectory() + "/iap-fetch", arguments)
    }

    @Test("a transaction file that is missing, or holds no signed transaction, is named with what to pass instead; nothing is written")
    func badTransactionFile() throws {
        let tmp = try TemporaryFolder()
        let garbage = try tmp.write("tx.jws", "not.a-jws")
        let cases = [
            (tmp.sub("missing.jws"), "cannot read --transaction \(tmp.sub("missing.jws")): it does not exist"),
            (garbage, "--transaction \(garbage) does not hold a signed transaction"),
        ]
        // A folder, or a large file passed by mistake (the archive), is named as such rather than
        // read as text.
        try FileManager.default.createDirectory(atPath: tmp.sub("folder"), withIntermediateDirectories: true)
        let large = try tmp.write("archive.zip", Data(count: 2 << 20))
        let more = [
            (tmp.sub("folder"), "--transaction \(tmp.sub("folder")) is a folder"),
            (large, "--transaction \(large) is 2097152 bytes; a signed transaction is a few KB"),
            (try tmp.write("empty.jws", ""), "it is empty or not UTF-8 text"),
        ]
        for (file, says) in cases + more {
            let result = try fetch(["get", "--server", "http://127.0.0.1:9", "--transaction", file, "--content-dir", tmp.sub("device")])
            #expect(result.status == 1, "\(result.stderr)")
            #expect(result.stderr.contains(says) && result.stderr.contains("the JWS the app got from StoreKit"), "\(result.stderr)")
            #expect(!result.stderr.contains("Usage:"), "a missing file is not a usage mistake: \(result.stderr)")
            #expect(!FileManager.default.fileExists(atPath: tmp.sub("device")))
        }
    }

    @Test("a transaction read from a pipe (a shell's <(...) or /dev/stdin) is taken, and its content installed")
    func transactionFromPipe() throws {
        let shop = try Shop(products: ["com.example.piped": .random(256 << 10)])
        let purchase = try shop.store.purchase(productId: "com.example.piped")
        let result = try run(
            "sh",
            [
                "-c", "printf '%s' \"$0\" | \"$1\" get --server \"$2\" --transaction /dev/stdin --content-dir \"$3\"",
                purchase.signedTransaction, productsDirectory() + "/iap-fetch", shop.server.base, shop.content,
            ])
        #expect(result.status == 0, "\(result.stderr)")
        #expect(shop.installed("com.example.piped") == shop.payloads["com.example.piped"])
    }

    @Test("a server that cannot be reached is said while the grant is retried, in lines that reach a file as they happen")
    func unreachableServerIsSaid() throws {
        let tmp = try TemporaryFolder()
        let jws = try tmp.write("tx.jws", "eyJhbGciOiJFUzI1NiJ9.eyJ0cmFuc2FjdGlvbklkIjoiMSIsInByb2R1Y3RJZCI6ImNvbS5leGFtcGxlLnAifQ.c2ln")
        let port = try freePort()
        let outPath = tmp.sub("out.txt")
        _ = FileManager.default.createFile(atPath: outPath, contents: nil)
        let out = try #require(FileHandle(forWritingAtPath: outPath))
        let process = try launch(
            productsDirectory() + "/iap-fetch",
            ["get", "--server", "http://127.0.0.1:\(port)", "--transaction", jws, "--content-dir", tmp.sub("device")], stdout: out)
        defer {
            if process.isRunning { kill(process.processIdentifier, SIGKILL) }
            process.waitUntilExit()
            try? out.close()
        }
        // The tries take about a minute in all; the first refusal is said after the first.
        let deadline = Date().addingTimeInterval(50)
        var text = ""
        while process.isRunning && Date() < deadline && !text.contains("waiting: cannot reach") {
            usleep(10_000)
            text = (try? String(contentsOfFile: outPath, encoding: .utf8)) ?? ""
        }
        #expect(process.isRunning, "iap-fetch ended before saying why it waits: \(text)")
        #expect(text.contains("waiting: cannot reach http://127.0.0.1:\(port): connection refused: is the server running"), "\(text)")
    }

    @Test("a content folder that is a file is refused before anything is fetched")
    func contentFolderIsAFile() throws {
        let tmp = try TemporaryFolder()
        let jws = try tmp.write("tx.jws", "eyJhbGciOiJFUzI1NiJ9.eyJ0cmFuc2FjdGlvbklkIjoiMSIsInByb2R1Y3RJZCI6ImNvbS5leGFtcGxlLnAifQ.c2ln")
        let file = try tmp.write("device", "a file")
        let result = try fetch(["get", "--server", "http://127.0.0.1:9", "--transaction", jws, "--content-dir", file])
        #expect(result.status != 0)
        #expect(result.stderr.contains("\(file) exists and is not a folder"), "\(result.stderr)")
        #expect(try String(contentsOfFile: file, encoding: .utf8) == "a file")
    }
}

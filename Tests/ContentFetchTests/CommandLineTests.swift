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
        for (file, says) in cases {
            let result = try fetch(["get", "--server", "http://127.0.0.1:9", "--transaction", file, "--content-dir", tmp.sub("device")])
            #expect(result.status == 1, "\(result.stderr)")
            #expect(result.stderr.contains(says) && result.stderr.contains("the JWS the app got from StoreKit"), "\(result.stderr)")
            #expect(!result.stderr.contains("Usage:"), "a missing file is not a usage mistake: \(result.stderr)")
            #expect(!FileManager.default.fileExists(atPath: tmp.sub("device")))
        }
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

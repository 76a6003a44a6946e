import ContentArchive
import Crypto
import Foundation
import IAPTestSupport
import Testing

extension ServerTests {
    /// A server started with `extra`, the sample published and downloaded once under a grant
    /// (so the server keeps the archive open): the server, its data folder, the sample, the
    /// download URL and the archive's bytes.
    func servedSample(
        _ tmp: TemporaryFolder, database: String? = nil, extra: [String] = []
    ) throws -> (server: ServerProcess, data: String, packed: PackResult, url: String, original: Data) {
        let (store, server, data) = try start(tmp, database: database, extra: extra)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp).status == 201)
        let purchase = try store.purchase(productId: product)
        let download = try #require((try grant(purchase.signedTransaction, server: server, tmp: tmp).json["downloads"] as? [[String: Any]])?.first)
        let url = try #require(download["url"] as? String)
        let original = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
        #expect(try curl([url], folder: tmp).body == original)
        return (server, data, packed, url, original)
    }

    /// Flips one byte in the middle of `archive` (whose bytes are `original`) in place: the same
    /// file, the same size, other bytes. Returns their SHA-256.
    func flipMiddleByte(_ archive: String, of original: Data) throws -> String {
        chmod(archive, 0o644)
        let file = try #require(FileHandle(forUpdatingAtPath: archive))
        let middle = original.count / 2
        try file.seek(toOffset: UInt64(middle))
        try file.write(contentsOf: Data([original[middle] ^ 0x5A]))
        try file.close()
        var damaged = original
        damaged[middle] ^= 0x5A
        return SHA256.hash(data: damaged).map { String(format: "%02x", $0) }.joined()
    }

    @Test(
        "an archive cut short on disk is refused (503 archive-damaged) instead of served under the published ETag, named by /readyz, the log and iap-server check; publishing it again repairs it while the server runs",
        arguments: Backend.allCases)
    func damagedArchiveRefusedAndRepaired(backend: Backend) async throws {
        let tmp = try TemporaryFolder()
        let database = backend == .postgres ? try await PostgresServer.shared().createDatabase() : nil
        let storeOptions = database.map { ["--database", $0] } ?? []
        let (server, data, packed, url, original) = try servedSample(tmp, database: database)

        // Cut short in place, as a copy over it that stopped part-way leaves it: the same file
        // the server holds open, now half as long.
        let archive = data + "/archives/\(packed.manifest.archiveSHA256).zip"
        chmod(archive, 0o644)
        #expect(truncate(archive, off_t(original.count / 2)) == 0)
        // Refused from the first request, whichever event loop takes it: one that holds the file
        // open sees it is shorter than when opened (sendfile past its end spun the loop before).
        let answer = try curl([url], folder: tmp)
        #expect(answer.status == 503 && answer.errorCode == "archive-damaged", "\(answer.status) \(answer.headers)")
        #expect(try curl(["-r", "0-99", url], folder: tmp).status == 503)
        // Within a beat every loop has let go of it, and the next request to open it logs why.
        let problem = "refusing to serve a damaged file: \(archive) is \(original.count / 2) bytes, not the \(original.count) published"
        let logged = await waitUntil(.seconds(15)) {
            #expect((try? curl([url], folder: tmp))?.status == 503)
            return ((try? String(contentsOfFile: server.log, encoding: .utf8)) ?? "").contains(problem)
        }
        #expect(logged != nil, "the damage was not logged")
        _ = try curl([url], folder: tmp)
        let log = try String(contentsOfFile: server.log, encoding: .utf8)
        #expect(log.components(separatedBy: "refusing to serve a damaged file").count == 2, "logged once a minute, not per request")
        let metrics = try curl([server.base + "/metrics"], folder: tmp).text
        #expect(metrics.contains("iap_damaged_archive_refusals_total ") && !metrics.contains("iap_damaged_archive_refusals_total 0"))
        let ready = try curl([server.base + "/readyz"], folder: tmp)
        #expect(ready.status == 503 && ready.text.contains("cut short or overwritten"))
        let forDownloads = try curl([server.base + "/readyz?for=downloads"], folder: tmp)
        #expect(forDownloads.status == 503 && forDownloads.text.contains("cut short or overwritten"), "a damaged archive is a download's problem too")
        let unknown = try curl([server.base + "/readyz?for=grants"], folder: tmp)
        #expect(unknown.status == 400 && unknown.text.contains("/readyz?for=downloads"), "\(unknown.text)")

        let check = try run(productsDirectory() + "/iap-server", ["check", "--data", data] + storeOptions)
        #expect(check.status == 1, "\(check.stderr)")
        #expect(check.stdout.contains("\(product) 1.0: \(archive) is \(original.count / 2) bytes, not the \(original.count) published"))
        #expect(check.stdout.contains("1 of 1 published version(s) damaged or missing"))

        // The operator publishes the same archive again: the store's copy is put back, and the
        // server serves it within a refresh, having closed what it held.
        let publish = try run(productsDirectory() + "/iap-server", ["publish", "--data", data, packed.archivePath] + storeOptions)
        #expect(publish.status == 0 && publish.stdout.hasPrefix("repaired: "), "\(publish.stdout) \(publish.stderr)")
        let served = await waitUntil(.seconds(15)) { (try? curl([url], folder: tmp))?.body == original }
        #expect(served != nil, "the repaired archive was not served")
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200)
        let again = try run(productsDirectory() + "/iap-server", ["check", "--data", data, "--json"] + storeOptions)
        #expect(again.status == 0)
        let report = try #require(try JSONSerialization.jsonObject(with: Data(again.stdout.utf8)) as? [String: Any])
        #expect(report["checked"] as? Int == 1 && (report["damaged"] as? [Any])?.isEmpty == true)
        #expect((report["bytesRead"] as? Int ?? 0) > original.count)
        // Publishing intact bytes again changes nothing.
        #expect(try run(productsDirectory() + "/iap-server", ["publish", "--data", data, packed.archivePath] + storeOptions).stdout.hasPrefix("unchanged: "))
        #expect(server.stop() == 0)
    }

    @Test(
        "bytes damaged on disk at the published size (no stat can tell) are found by the periodic read: refused (503 archive-damaged), named by /readyz, logged and counted once; publishing again repairs it"
    )
    func rottenArchiveFoundAndRepaired() async throws {
        let tmp = try TemporaryFolder()
        let (server, data, packed, url, original) = try servedSample(tmp, extra: ["--archive-check-interval", "1"])

        let archive = data + "/archives/\(packed.manifest.archiveSHA256).zip"
        let digest = try flipMiddleByte(archive, of: original)

        let problem = "\(archive) has SHA-256 \(digest), not the published \(packed.manifest.archiveSHA256) (damaged on disk)"
        let refused = await waitUntil(.seconds(20)) {
            let answer = try? curl([url], folder: tmp)
            return answer?.status == 503 && answer?.errorCode == "archive-damaged"
        }
        #expect(refused != nil, "the damaged archive was still served")
        let found = await waitUntil(.seconds(10)) {
            ((try? String(contentsOfFile: server.log, encoding: .utf8)) ?? "").contains("found an archive damaged on disk")
        }
        #expect(found != nil, "the find was not logged")
        let ready = await waitUntil(.seconds(15)) {
            let answer = try? curl([server.base + "/readyz"], folder: tmp)
            return answer?.status == 503 && answer?.text.contains("(damaged on disk)") == true
        }
        #expect(ready != nil, "/readyz does not name the damaged archive")
        #expect(try curl(["-r", "0-99", url], folder: tmp).status == 503)
        // Two later passes find the same file as it was: logged and counted once.
        func passes() -> Int? {
            let text = (try? curl([server.base + "/metrics"], folder: tmp))?.text ?? ""
            return text.split(separator: "\n").first { $0.hasPrefix("iap_archive_check_passes_total ") }.flatMap { Int($0.split(separator: " ")[1]) }
        }
        let before = try #require(passes())
        let later = await waitUntil(.seconds(15)) { (passes() ?? 0) >= before + 2 }
        #expect(later != nil, "the periodic read stopped")
        let log = try String(contentsOfFile: server.log, encoding: .utf8)
        #expect(log.contains(problem))
        #expect(log.components(separatedBy: "found an archive damaged on disk").count == 2, "logged more than once")
        #expect(try curl([server.base + "/metrics"], folder: tmp).text.contains("iap_archives_found_damaged_total 1\n"))

        // The operator publishes the archive again: the store's copy is put back, and served.
        let publish = try run(productsDirectory() + "/iap-server", ["publish", "--data", data, packed.archivePath])
        #expect(publish.status == 0 && publish.stdout.hasPrefix("repaired: "), "\(publish.stdout) \(publish.stderr)")
        let served = await waitUntil(.seconds(15)) { (try? curl([url], folder: tmp))?.body == original }
        #expect(served != nil, "the repaired archive was not served")
        let readyAgain = await waitUntil(.seconds(15)) { (try? curl([server.base + "/readyz"], folder: tmp))?.status == 200 }
        #expect(readyAgain != nil)
        #expect(server.stop() == 0)
    }

    @Test(
        "bytes damaged on disk at the published size that iap-server check finds (as the shipped timer runs it) are refused by the running server within a beat, also from the handle it kept, and named by /readyz; publishing again repairs it and clears the record"
    )
    func checkFindRefusedByServer() async throws {
        let tmp = try TemporaryFolder()
        // No periodic read of its own: what the server learns, it learns from `check`.
        let (server, data, packed, url, original) = try servedSample(tmp, extra: ["--archive-check-interval", "0"])
        let sha256 = packed.manifest.archiveSHA256
        let archive = data + "/archives/\(sha256).zip"
        let digest = try flipMiddleByte(archive, of: original)
        let record = data + "/archives/\(sha256).damaged.json"
        // No stat tells: served as it is, and every device's SHA-256 would fail.
        let before = try curl([url], folder: tmp)
        #expect(before.status == 200 && before.body != original)
        // Every event loop opens it and keeps it open.
        for _ in 0..<4 { #expect(try curl(["-r", "0-99", url], folder: tmp).status == 206) }

        let problem = "\(archive) has SHA-256 \(digest), not the published \(sha256) (damaged on disk)"
        let check = try run(productsDirectory() + "/iap-server", ["check", "--data", data])
        #expect(check.status == 1 && check.stdout.contains(problem), "\(check.stdout) \(check.stderr)")
        #expect(FileManager.default.fileExists(atPath: record))
        let refused = await waitUntil(.seconds(15)) {
            let answer = try? curl([url], folder: tmp)
            return answer?.status == 503 && answer?.errorCode == "archive-damaged"
        }
        #expect(refused != nil, "the server still serves what check found damaged")
        // Every event loop refuses it, the one that kept the file open from the first download too.
        for _ in 0..<4 { #expect(try curl(["-r", "0-99", url], folder: tmp).status == 503) }
        #expect(try String(contentsOfFile: server.log, encoding: .utf8).contains("refusing to serve a damaged file: \(problem)"))
        let ready = await waitUntil(.seconds(15)) {
            let answer = try? curl([server.base + "/readyz"], folder: tmp)
            return answer?.status == 503 && answer?.text.contains(problem) == true
        }
        #expect(ready != nil, "/readyz does not name the damaged archive")

        let publish = try run(productsDirectory() + "/iap-server", ["publish", "--data", data, packed.archivePath])
        #expect(publish.status == 0 && publish.stdout.hasPrefix("repaired: "), "\(publish.stdout) \(publish.stderr)")
        #expect(!FileManager.default.fileExists(atPath: record), "the record outlived the repair")
        let served = await waitUntil(.seconds(15)) { (try? curl([url], folder: tmp))?.body == original }
        #expect(served != nil, "the repaired archive was not served")
        let readyAgain = await waitUntil(.seconds(15)) { (try? curl([server.base + "/readyz"], folder: tmp))?.status == 200 }
        #expect(readyAgain != nil)
        #expect(try run(productsDirectory() + "/iap-server", ["check", "--data", data]).status == 0)
        #expect(server.stop() == 0)
    }
}

import ContentArchive
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@testable import ContentFetch

@Suite("Delta updates", .serialized, .onTestThreads)
struct DeltaTests {
    static let product = "com.example.delta.world"

    /// 1.0: 24 incompressible files of 96 KiB (stored: their bytes are what is fetched) and 8 levels of text.
    func makeVersion1(_ tmp: TemporaryFolder) throws -> String {
        for i in 0..<24 {
            let bytes = try #require(FileHandle(forReadingAtPath: "/dev/urandom")).readData(ofLength: 96 << 10)
            try tmp.write("v1/media/clip\(i).bin", bytes)
        }
        for i in 0..<8 { try tmp.write("v1/levels/level\(i).json", String(repeating: "{\"level\": \(i), \"tiles\": [1, 2, 3]}\n", count: 200)) }
        return tmp.sub("v1")
    }

    /// 1.1: one clip and one level changed, one clip added, one removed.
    func makeVersion2(_ tmp: TemporaryFolder, from v1: String) throws -> String {
        let v2 = tmp.sub("v2")
        try FileManager.default.copyItem(atPath: v1, toPath: v2)
        try tmp.write("v2/media/clip3.bin", try #require(FileHandle(forReadingAtPath: "/dev/urandom")).readData(ofLength: 96 << 10))
        try tmp.write("v2/levels/level2.json", "{\"level\": 2, \"tiles\": [9]}\n")
        try tmp.write("v2/media/clip99.bin", try #require(FileHandle(forReadingAtPath: "/dev/urandom")).readData(ofLength: 50_000))
        try FileManager.default.removeItem(atPath: v2 + "/media/clip7.bin")
        return v2
    }

    /// 1.0 installed by `get` (which finishes nothing: the transaction stays unfinished), then 1.1
    /// published; the sources of both live in the shop's folder (`v1`, `v2`), `tx.jws` there too.
    func installedWithUpdatePublished() throws -> (shop: Shop, purchase: SandboxStore.Purchase, v1: String, v2: String) {
        let scratch = try TemporaryFolder()
        let shop = try Shop(products: [Self.product: .folder(try makeVersion1(scratch))], level: 1)
        let v1 = shop.tmp.sub("v1")
        try FileManager.default.copyItem(atPath: scratch.sub("v1"), toPath: v1)
        let purchase = try shop.store.purchase(productId: Self.product)
        try purchase.signedTransaction.write(toFile: shop.tmp.sub("tx.jws"), atomically: true, encoding: .utf8)
        #expect(try get(shop, shop.tmp.sub("tx.jws")).status == 0)
        let v2 = try makeVersion2(shop.tmp, from: v1)
        try shop.publish(folder: v2, product: Self.product, version: "1.1")
        return (shop, purchase, v1, v2)
    }

    func events(_ output: String) -> [[String: Any]] {
        output.split(separator: "\n").compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
    }

    func bytesServed(_ shop: Shop) throws -> Double {
        let metrics = try curl([shop.server.base + "/metrics"], folder: shop.tmp).text
        let line = metrics.split(separator: "\n").first { $0.hasPrefix("iap_content_bytes_served_total") }
        return line.flatMap { $0.split(separator: " ").last.flatMap { Double($0) } } ?? 0
    }

    func get(_ shop: Shop, _ jws: String, environment: [String: String]? = nil) throws -> ProcessResult {
        try run(
            productsDirectory() + "/iap-fetch", ["get", "--server", shop.server.base, "--transaction", jws, "--content-dir", shop.content, "--json"],
            environment: environment)
    }

    @Test("an update fetches only the changed entries, links the rest, verifies and installs 1.1, then removes 1.0")
    func fetchesOnlyChanges() throws {
        let tmp = try TemporaryFolder()
        let v1 = try makeVersion1(tmp)
        let shop = try Shop(products: [Self.product: .folder(v1)], level: 1)
        let purchase = try shop.store.purchase(productId: Self.product)
        #expect(try shop.fetch().status == 0)
        let product = shop.content + "/" + Self.product
        #expect(try run("diff", ["-r", v1, product + "/1.0/Contents"]).status == 0)
        let unchangedInode = try FileManager.default.attributesOfItem(atPath: product + "/1.0/Contents/media/clip0.bin")[.systemFileNumber] as? Int

        let v2 = try makeVersion2(tmp, from: v1)
        try shop.publish(folder: v2, product: Self.product, version: "1.1")
        try purchase.signedTransaction.write(toFile: tmp.sub("tx.jws"), atomically: true, encoding: .utf8)
        let before = try bytesServed(shop)
        let got = try get(shop, tmp.sub("tx.jws"))
        #expect(got.status == 0, "\(got.stderr)")
        let served = try bytesServed(shop) - before

        #expect(try run("diff", ["-r", v2, product + "/1.1/Contents"]).status == 0)
        #expect(try FileManager.default.contentsOfDirectory(atPath: product) == ["1.1"], "the old version stayed, or a hidden folder did")
        // Unchanged files are the installed ones, linked: the same inode.
        #expect(try FileManager.default.attributesOfItem(atPath: product + "/1.1/Contents/media/clip0.bin")[.systemFileNumber] as? Int == unchangedInode)

        let updates = events(got.stdout)
        let delta = try #require(updates.first { $0["delta"] != nil })
        let toFetch = try #require(delta["bytesToFetch"] as? Int)
        #expect(delta["delta"] as? String == "delta: 4 of 33 entries, \(toFetch) of \(try archiveSize(shop, "1.1")) bytes (from 1.0)")
        #expect(delta["expectedContentLength"] as? Int == toFetch)
        #expect((delta["bytesToWrite"] as? Int ?? 0) >= 96 << 10)
        // Changed entries: clip3 (96 KiB), clip99 (50,000), level2 and the plist; the manifest on top.
        #expect(toFetch < 200_000, "fetched \(toFetch)")
        #expect(served < Double(toFetch) + 40_000, "served \(served) for \(toFetch) to fetch")
        #expect(updates.last { $0["state"] != nil }?["state"] as? String == "finished")
        let status = try run(productsDirectory() + "/iap-fetch", ["status", "--content-dir", shop.content])
        #expect(!status.stdout.contains(".partial"))

        // A third version updates from 1.1 the same way: what a delta installed is a base too.
        let v3 = tmp.sub("v3")
        try FileManager.default.copyItem(atPath: v2, toPath: v3)
        try tmp.write("v3/levels/level5.json", "{\"level\": 5}\n")
        try shop.publish(folder: v3, product: Self.product, version: "1.2")
        let third = try get(shop, tmp.sub("tx.jws"))
        #expect(third.status == 0, "\(third.stderr)")
        #expect(events(third.stdout).contains { ($0["delta"] as? String)?.hasPrefix("delta: 2 of 33 entries") == true })
        #expect(try run("diff", ["-r", v3, product + "/1.2/Contents"]).status == 0)
    }

    func archiveSize(_ shop: Shop, _ version: String) throws -> Int {
        let info = try curl([shop.server.base + "/v1/products/\(Self.product)"], folder: shop.tmp)
        return info.json["contentLength"] as? Int ?? -1
    }

    @Test("an installed file changed on the device is fetched again, not trusted")
    func localModification() throws {
        let tmp = try TemporaryFolder()
        let v1 = try makeVersion1(tmp)
        let shop = try Shop(products: [Self.product: .folder(v1)], level: 1)
        let purchase = try shop.store.purchase(productId: Self.product)
        #expect(try shop.fetch().status == 0)
        let product = shop.content + "/" + Self.product
        // Something on the device overwrites an installed file in place, keeping its size.
        let tampered = product + "/1.0/Contents/media/clip5.bin"
        let handle = try #require(FileHandle(forWritingAtPath: tampered))
        try handle.write(contentsOf: Data(repeating: 0, count: 4096))
        try handle.close()

        let v2 = try makeVersion2(tmp, from: v1)
        try shop.publish(folder: v2, product: Self.product, version: "1.1")
        try purchase.signedTransaction.write(toFile: tmp.sub("tx.jws"), atomically: true, encoding: .utf8)
        let got = try get(shop, tmp.sub("tx.jws"))
        #expect(got.status == 0, "\(got.stderr)")
        #expect(events(got.stdout).contains { ($0["delta"] as? String)?.hasPrefix("delta: 5 of 33 entries") == true })
        #expect(try run("diff", ["-r", v2, product + "/1.1/Contents"]).status == 0)
    }

    @Test("an installed file changed after it was checked and before it is linked fails the link's check: the update falls back, nothing changed is installed")
    func changedBeforeLink() async throws {
        let (shop, _, _, v2) = try installedWithUpdatePublished()
        let product = shop.content + "/" + Self.product
        let output = Pipe()
        let fetch = try launch(
            productsDirectory() + "/iap-fetch", ["get", "--server", shop.server.base, "--transaction", shop.tmp.sub("tx.jws"), "--content-dir", shop.content, "--json"],
            environment: ["IAP_FETCH_STOP_AT": "delta-sources-chosen"], stdout: output)
        defer { if fetch.isRunning { kill(fetch.processIdentifier, SIGKILL) } }
        // Stopped at the point: the installed files to reuse are chosen and none is linked yet.
        let stopped = await waitUntil(.seconds(60)) {
            ((try? String(contentsOfFile: "/proc/\(fetch.processIdentifier)/stat", encoding: .utf8)) ?? "").split(separator: " ").dropFirst(2).first == "T"
        }
        try #require(stopped != nil, "iap-fetch never reached the point")
        // The same size, new bytes, in place (the inode stays: what a link would share).
        let changed = product + "/1.0/Contents/media/clip0.bin"
        let handle = try #require(FileHandle(forWritingAtPath: changed))
        try handle.write(contentsOf: Data(repeating: 7, count: 4096))
        try handle.close()
        kill(fetch.processIdentifier, SIGCONT)
        let stdout = output.fileHandleForReading.readDataToEndOfFile()
        fetch.waitUntilExit()
        #expect(fetch.terminationStatus == 0)
        #expect(try run("diff", ["-r", v2, product + "/1.1/Contents"]).status == 0, "a file changed on the device was installed as 1.1's")
        #expect(String(decoding: stdout, as: UTF8.self).contains("transaction-finished"))
    }

    @Test(
        "killed at any point of a delta update, the next run installs identical bytes, finishes once, and 1.0 stays until 1.1 is in",
        arguments: ["delta-planned", "range-done", "verified", "old-version-hidden", "installed"])
    func killed(at point: String) throws {
        let (shop, purchase, v1, v2) = try installedWithUpdatePublished()
        let product = shop.content + "/" + Self.product

        let killed = try shop.fetch([], prefix: ["export IAP_FETCH_KILL_AT=\(point)"])
        #expect(killed.status != 0)
        if point == "old-version-hidden" {
            // 1.1 is complete; 1.0 is out of sight, whole, waiting to be removed.
            let names = try FileManager.default.contentsOfDirectory(atPath: product).sorted()
            #expect(names.count == 2 && names[0].hasPrefix(".1.0.removing-") && names[1] == "1.1", "\(names)")
            #expect(try run("diff", ["-r", v2, product + "/1.1/Contents"]).status == 0)
        } else if point != "installed" {
            #expect(try run("diff", ["-r", v1, product + "/1.0/Contents"]).status == 0, "1.0 was touched before 1.1 was complete")
        }
        let records =
            try JSONSerialization.jsonObject(
                with: Data(try run(productsDirectory() + "/iap-fetch", ["status", "--content-dir", shop.content, "--json"]).stdout.utf8)) as? [[String: Any]]
        #expect(records?.contains { $0["delta"] != nil } == true, "no delta was planned")
        let status = try run(productsDirectory() + "/iap-fetch", ["status", "--content-dir", shop.content])
        #expect(status.stdout.contains("delta: 4 of 33 entries, "), "\(status.stdout)")

        let resumed = try shop.fetch()
        #expect(resumed.status == 0, "\(resumed.stderr)")
        #expect(try run("diff", ["-r", v2, product + "/1.1/Contents"]).status == 0)
        #expect(try FileManager.default.contentsOfDirectory(atPath: product) == ["1.1"])
        let finished = events(resumed.stdout).filter { $0["event"] as? String == "transaction-finished" }
        #expect(finished.count == 1)
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(purchase.transaction.transactionId!)?.finishedAt != nil)
        #expect(try FileManager.default.contentsOfDirectory(atPath: shop.content + "/.iap-fetch").allSatisfy { !$0.hasSuffix(".partial") })
    }

    @Test("a fetched range damaged on disk fails its chunk hash and is fetched again before anything is installed")
    func damagedRange() throws {
        let (shop, purchase, _, v2) = try installedWithUpdatePublished()
        #expect(try shop.fetch([], prefix: ["export IAP_FETCH_KILL_AT=verified"]).status != 0)

        let journal = shop.content + "/.iap-fetch"
        let id = "\(purchase.transaction.transactionId!)-\(Self.product)"
        let manifest = try ArchiveManifest.load(path: journal + "/\(id).manifest.json")
        let clip = try #require(manifest.entries.first { $0.path == "Contents/media/clip3.bin" })
        let handle = try #require(FileHandle(forUpdatingAtPath: journal + "/\(id).partial"))
        try handle.seek(toOffset: clip.dataOffset + 500)
        try handle.write(contentsOf: Data([0x42, 0x42, 0x42]))
        try handle.close()

        let resumed = try shop.fetch()
        #expect(resumed.status == 0, "\(resumed.stderr)")
        #expect(events(resumed.stdout).contains { ($0["error"] as? [String: Any])?["code"] as? String == "integrity" })
        #expect(try run("diff", ["-r", v2, shop.content + "/\(Self.product)/1.1/Contents"]).status == 0)
    }

    @Test("planning: unchanged bytes are reused whatever their path; ranges are coalesced; a mostly new version is fetched whole")
    func planning() throws {
        func entry(_ path: String, _ sha: String, offset: UInt64, size: UInt64) -> ArchiveManifest.Entry {
            .init(
                path: path, kind: .file, method: .stored, uncompressedSize: size, compressedSize: size, crc32: 0, sha256: sha,
                localHeaderOffset: offset, dataOffset: offset + 40, chunks: [])
        }
        let tmp = try TemporaryFolder()
        for name in ["a", "b", "c"] { try tmp.write("old/Contents/\(name)", String(repeating: name, count: 1000)) }
        let old = ArchiveManifest(
            productId: try ProductIdentifier("com.example.p"), contentVersion: try ContentVersion("1.0"), archiveName: "p.zip",
            archiveSize: 1_000_000, archiveSHA256: "", contentLength: 3000, createdAt: "",
            entries: [
                entry("Contents/a", "A", offset: 0, size: 1000), entry("Contents/b", "B", offset: 2000, size: 1000),
                entry("Contents/c", "C", offset: 4000, size: 1000),
            ])
        let installed = InstalledVersion.record(manifest: old, folder: tmp.sub("old"))
        // b moved to d; c changed; e is new and sits right after c.
        let new = ArchiveManifest(
            productId: old.productId, contentVersion: try ContentVersion("1.1"), archiveName: "p.zip", archiveSize: 1_000_000,
            archiveSHA256: "", contentLength: 4000, createdAt: "",
            entries: [
                entry("Contents/a", "A", offset: 0, size: 1000), entry("Contents/c", "C2", offset: 100_000, size: 1000),
                entry("Contents/d", "B", offset: 300_000, size: 1000), entry("Contents/e", "E", offset: 101_100, size: 1000),
            ])
        let plan = try #require(DeltaPlan.make(manifest: new, manifestSHA256: "m", installed: installed, installedFolder: tmp.sub("old")))
        #expect(DeltaPlan.sources(for: new, installed: installed, folder: tmp.sub("old")) == ["Contents/a": "Contents/a", "Contents/d": "Contents/b"])
        #expect(Set(plan.fetched) == ["Contents/c", "Contents/e"])
        #expect(plan.ranges == [Segment(start: 100_040, end: 102_140, done: 0)])

        // A changed installed file is not reused.
        try tmp.write("old/Contents/a", String(repeating: "z", count: 1000))
        let again = try #require(DeltaPlan.make(manifest: new, manifestSHA256: "m", installed: installed, installedFolder: tmp.sub("old")))
        #expect(Set(again.fetched) == ["Contents/a", "Contents/c", "Contents/e"])

        // Nothing reusable, or more than half the archive to fetch: no delta.
        var bigger = new
        bigger.archiveSize = 4000
        #expect(DeltaPlan.make(manifest: bigger, manifestSHA256: "m", installed: installed, installedFolder: tmp.sub("old")) == nil)
    }

    @Test("the installed record reads back as written, and a damaged one reads as none (the next download is whole)")
    func installedRecord() throws {
        let files = [
            InstalledVersion.File(path: "Contents/a b/é ü.txt", sha256: String(repeating: "ab", count: 32), size: 0, device: 2049, inode: 1, modified: -1_500),
            InstalledVersion.File(
                path: "Contents/big.bin", sha256: String(repeating: "0f", count: 32), size: Int64.max, device: UInt64.max, inode: 77,
                modified: 1_764_000_000_123_456_789),
        ]
        let record = InstalledVersion(productId: "com.example.p", contentVersion: "1.2.3", files: files)
        let read = try #require(InstalledVersion.decode(record.encoded()))
        #expect(read.productId == "com.example.p" && read.contentVersion == "1.2.3" && read.files == files)

        let good = String(decoding: record.encoded(), as: UTF8.self)
        let line = "\(files[1].sha256)\t5\t1\t2\t3\tContents/x\n"
        for damaged in [
            good.replacingOccurrences(of: "iap-fetch-installed 1", with: "iap-fetch-installed 2"),
            "iap-fetch-installed 1\tcom.example.p\n" + line,
            good + "\(files[1].sha256)\t5\t1\t2\tContents/x\n",
            good + line.replacingOccurrences(of: "\t5\t", with: "\t5x\t"),
            good + line.replacingOccurrences(of: "\t5\t", with: "\t\t"),
            good + line.replacingOccurrences(of: "\t5\t", with: "\t+5\t"),
            good + line.replacingOccurrences(of: "\t5\t", with: "\t-\t"),
            good + line.replacingOccurrences(of: "\t1\t2\t", with: "\t-1\t2\t"),
            good + line.replacingOccurrences(of: "\t5\t", with: "\t9223372036854775808\t"),
            good + line.replacingOccurrences(of: "\t3\t", with: "\t-9223372036854775809\t"),
        ] {
            #expect(InstalledVersion.decode(Data(damaged.utf8)) == nil, "read as a record: \(damaged.suffix(60).debugDescription)")
        }
        // The extremes of each field still read.
        let edges = good + line.replacingOccurrences(of: "\t5\t1\t2\t3\t", with: "\t9223372036854775807\t18446744073709551615\t0\t-9223372036854775808\t")
        #expect(InstalledVersion.decode(Data(edges.utf8))?.files.last?.modified == Int64.min)
    }
}

import ContentArchive
import Foundation
import IAPTestSupport
import Synchronization
import Testing

@testable import ContentCatalog

extension CatalogTests {
    @Test(
        "check: an archive cut short, one overwritten in place, one missing and a manifest gone are each found (sizes alone: those stat tells, and the bytes a read found, in any process using the folder); publishing each again puts it back",
        arguments: Backend.allCases)
    func checkAndRepair(backend: Backend) async throws {
        let sample = try SampleProduct()
        defer { sample.remove() }
        let databaseURL = try await backend.freshURL()
        let store = try await openStore(sample.dir + "/data", databaseURL: databaseURL)
        let packed = try ["1.0", "1.1", "1.2", "1.3"].map { try sample.pack($0, into: "v" + $0) }
        for p in packed { _ = try await store.publish(archiveAt: p.archivePath, manifest: p.manifest) }
        let intact = try await store.checkArchives()
        #expect(intact.checked == 4 && intact.damaged.isEmpty)
        let archiveBytes = packed.map { (try? FileManager.default.attributesOfItem(atPath: $0.archivePath)[.size] as? Int) ?? 0 }.reduce(0, +)
        #expect(intact.bytesRead > Int64(archiveBytes), "the manifests are read too")

        func archive(_ p: PackResult) -> String { store.archivePath(sha256: p.manifest.archiveSHA256) }
        let size = try #require(FileManager.default.attributesOfItem(atPath: archive(packed[1]))[.size] as? Int)
        for p in packed { chmod(archive(p), 0o644) }
        #expect(truncate(archive(packed[0]), 100) == 0)
        var bytes = try Data(contentsOf: URL(fileURLWithPath: archive(packed[1])))
        bytes[size / 2] ^= 0xFF
        try bytes.write(to: URL(fileURLWithPath: archive(packed[1])))
        #expect(unlink(archive(packed[2])) == 0)
        #expect(unlink(store.manifestPath(sha256: packed[3].manifest.archiveSHA256)) == 0)

        let found = Mutex<[String]>([])
        let damaged = try await store.checkArchives { version, damage in found.withLock { $0.append("\(version.contentVersion) \(damage.code)") } }
        let codes = damaged.damaged.map { "\($0.version.contentVersion) \($0.damage.code)" }
        #expect(Set(codes) == ["1.0 wrong-size", "1.1 wrong-sha256", "1.2 missing", "1.3 manifest-missing"])
        #expect(found.withLock { $0 } == codes, "each reported as it is found")
        let flipped = try #require(damaged.damaged.first { $0.version.contentVersion == "1.1" })
        #expect(flipped.damage.message(for: flipped.version, in: store).contains("not the published \(packed[1].manifest.archiveSHA256) (damaged on disk): publish"))
        // Sizes alone, in another process (a store of its own, as `check` beside a server): what
        // stat tells, and 1.1's bytes, which the first one's read recorded beside the archive.
        let record = store.damageRecordPath(sha256: packed[1].manifest.archiveSHA256)
        #expect(FileManager.default.fileExists(atPath: record))
        let other = try await openStore(sample.dir + "/data", databaseURL: databaseURL)
        let quick = try await other.checkArchives(readingContents: false)
        #expect(Set(quick.damaged.map { "\($0.version.contentVersion) \($0.damage.code)" }) == Set(codes))
        #expect(quick.bytesRead == 0)
        let ready = await other.readinessProblems()
        #expect(ready.count == 1 && ready[0].hasPrefix("3 published version(s) missing or damaged"), "\(ready)")
        // In the process whose read found them, too.
        let remembered = try await store.checkArchives(readingContents: false)
        #expect(Set(remembered.damaged.map { "\($0.version.contentVersion) \($0.damage.code)" }) == Set(codes))
        #expect(remembered.bytesRead == 0)
        // A find is of the file as it was: once written again (here with the same bytes), neither
        // process names it without reading it again.
        try bytes.write(to: URL(fileURLWithPath: archive(packed[1])))
        let rewritten = try await other.checkArchives(readingContents: false)
        #expect(Set(rewritten.damaged.map { "\($0.version.contentVersion) \($0.damage.code)" }) == ["1.0 wrong-size", "1.2 missing", "1.3 manifest-missing"])
        await other.database.close()
        #expect(try await store.checkArchives(readingContents: false).damaged.count == 3)
        // Read again: found again, and recorded again.
        #expect(try await store.checkArchives().damaged.count == 4)
        let known = await store.readinessProblems()
        #expect(known.count == 1 && known[0].hasPrefix("3 published version(s) missing or damaged"), "\(known)")

        for p in packed {
            guard case .repaired = try await store.publish(archiveAt: p.archivePath, manifest: p.manifest) else {
                Issue.record("\(p.manifest.contentVersion) was not repaired")
                continue
            }
        }
        #expect(try await store.checkArchives().damaged.isEmpty)
        #expect(await store.readinessProblems().isEmpty)
        #expect(!FileManager.default.fileExists(atPath: record), "the record outlived the repair")
        var info = stat()
        #expect(stat(archive(packed[0]), &info) == 0 && info.st_mode & 0o777 == 0o444, "put back read-only, as published")
        guard case .unchanged = try await store.publish(archiveAt: packed[0].archivePath) else {
            Issue.record("an intact version published again was not left unchanged")
            return
        }
        await store.database.close()
    }

    @Test("check: reading every archive drops the pages it brought into the page cache")
    func checkLeavesPageCache() async throws {
        let sample = try SampleProduct()
        defer { sample.remove() }
        // Incompressible, so the archive is as large: 24 MiB, three of the check's reads.
        try pseudoRandomBytes(24 << 20, seed: 7).write(to: URL(fileURLWithPath: sample.content + "/noise.bin"))
        let store = try await openStore(sample.dir + "/data", databaseURL: nil)
        let packed = try sample.pack("1.0", into: "v1")
        _ = try await store.publish(archiveAt: packed.archivePath, manifest: packed.manifest)
        let path = store.archivePath(sha256: packed.manifest.archiveSHA256)

        let fd = open(path, O_RDONLY)
        defer { close(fd) }
        #expect(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0)
        #expect(try residentPages(fd) == 0)
        #expect(try await store.checkArchives().damaged.isEmpty)
        #expect(try residentPages(fd) == 0, "the check left what it read in the page cache")
        await store.database.close()
    }

    // That pages cached before the check stay is not measured on the file: this VM's DAMON pages
    // out page-cache memory it finds cold (a 24 MiB file read once lost 3% of its pages within
    // 20 s idle, and all of them within one check during a loaded test run), so what is measured
    // is which pages the check chooses to drop.
    @Test("check: the pages it drops are exactly the runs that were not cached before it read")
    func checkDropsOnlyColdRuns() {
        #expect(FileDigest.coldRuns([1, 1, 1, 1], from: 0, to: 4) == [])
        #expect(FileDigest.coldRuns([0, 0, 0, 0], from: 0, to: 4) == [0..<4])
        #expect(FileDigest.coldRuns([0, 1, 0, 0, 1, 0], from: 0, to: 6) == [0..<1, 2..<4, 5..<6])
        // One chunk's pages of the whole file's map.
        #expect(FileDigest.coldRuns([0, 1, 0, 0, 1, 0], from: 2, to: 5) == [2..<4])
        // Only bit 0 says cached (the others are the kernel's to use).
        #expect(FileDigest.coldRuns([2, 3, 0], from: 0, to: 3) == [0..<1, 2..<3])
        #expect(FileDigest.coldRuns([0, 0], from: 2, to: 2) == [])
    }

    /// How many of the file's pages are in the page cache.
    private func residentPages(_ fd: Int32) throws -> Int {
        var info = stat()
        guard fstat(fd, &info) == 0, info.st_size > 0 else { return 0 }
        let size = Int(info.st_size)
        let map = try #require(mmap(nil, size, PROT_READ, MAP_SHARED, fd, 0))
        defer { munmap(map, size) }
        let page = Int(sysconf(Int32(_SC_PAGESIZE)))
        var pages = [UInt8](repeating: 0, count: (size + page - 1) / page)
        #expect(mincore(map, size, &pages) == 0)
        return pages.filter { $0 & 1 == 1 }.count
    }
}

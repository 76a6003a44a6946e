import CLinuxWriteback
import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

@Suite("Extraction while the archive arrives", .onTestThreads)
struct StreamingExtractionTests {
    /// Stored and deflated entries, an empty file, nested folders: every path the extraction takes.
    func packMixed(_ tmp: TemporaryFolder) throws -> PackResult {
        try tmp.write("src/payload.bin", pseudoRandomBytes(3 << 20, seed: 7))
        try tmp.write("src/text/log.txt", logText(lines: 40_000, seed: 3))
        try tmp.write("src/empty.dat", Data())
        for i in 0..<40 { try tmp.write("src/levels/\(i % 4)/level-\(i).json", "{\"level\": \(i)}\n") }
        return try ArchivePacker.pack(
            folder: tmp.sub("src"),
            options: PackOptions(
                productId: try ProductIdentifier("com.example.stream"), contentVersion: try ContentVersion("2.1"), outputDirectory: tmp.sub("out")))
    }

    func expected(_ packed: PackResult) -> ContentInfo {
        ContentInfo(productIdentifier: packed.manifest.productId, contentVersion: packed.manifest.contentVersion)
    }

    func siblings(_ folder: String) -> [String] {
        (try? FileManager.default.contentsOfDirectory(atPath: folder))?.sorted() ?? []
    }

    /// `finish` refuses `packed` (as `expecting`, or its own product) with a message holding
    /// `text`, and nothing is left where the content would go.
    func expectRefused(
        _ extractor: StreamingExtractor, _ packed: PackResult, expecting info: ContentInfo? = nil, saying text: String, in tmp: TemporaryFolder
    ) throws {
        let error = try #require(throws: ArchiveError.self) { try extractor.finish(archive: packed.archivePath, expecting: info ?? expected(packed)) }
        #expect(error.message.contains(text), "\(error.message)")
        #expect(siblings(tmp.sub("installed")).isEmpty)
    }

    @Test(
        "bytes handed over in pieces of every size, some twice, install the same folder the archive extracts to (every file as it arrives, or the large ones)",
        arguments: [0, 1 << 20])
    func sameAsExtraction(streamingAtLeast: UInt64) throws {
        let tmp = try TemporaryFolder()
        let packed = try packMixed(tmp)
        #expect(Set(packed.manifest.entries.map(\.method)) == [.stored, .deflate], "both methods are exercised")
        let archive = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
        let extractor = try StreamingExtractor(manifest: packed.manifest, destination: tmp.sub("installed/2.1"), streamingAtLeast: streamingAtLeast)
        #expect(siblings(tmp.sub("installed")).count == 1 && siblings(tmp.sub("installed"))[0].hasPrefix(".2.1.streaming-"))
        var generator = SplitMix64(seed: 5)
        var offset = 0
        try archive.withUnsafeBytes { (bytes: UnsafeRawBufferPointer) in
            while offset < bytes.count {
                let count = min(bytes.count - offset, 1 + Int(generator.next() % UInt64(600_000)))
                // Now and then a transfer starts again a little before where the last one ended.
                let back = generator.next() % 4 == 0 ? min(offset, Int(generator.next() % 70_000)) : 0
                try extractor.consume(UnsafeRawBufferPointer(rebasing: bytes[(offset - back)..<(offset + count)]), at: UInt64(offset - back))
                offset += count
            }
        }
        #expect(extractor.position == UInt64(archive.count))
        // Written as they arrived: the large ones, or all; the others are placed by `finish`.
        let written = try run("find", [extractor.folder, "-type", "f"]).stdout.split(separator: "\n").count
        #expect(written == (streamingAtLeast == 0 ? 44 : 2), "ContentInfo.plist, 40 levels, an empty file, the payload and the log")
        try extractor.finish(archive: packed.archivePath, expecting: expected(packed))
        #expect(siblings(tmp.sub("installed")) == ["2.1"], "the hidden folder became the destination")
        try SafeExtractor.extract(archive: packed.archivePath, to: tmp.sub("reference/2.1"), expecting: expected(packed))
        let diff = try run("diff", ["-r", tmp.sub("reference/2.1"), tmp.sub("installed/2.1")])
        #expect(diff.status == 0, "\(diff.stdout)")
        #expect(try run("diff", ["-r", tmp.sub("src"), tmp.sub("installed/2.1/Contents")]).status == 0)
    }

    /// Feeds `archive` to a new extraction of `packed` into `destination`, through `change`, which
    /// may alter each piece (offset, bytes) before it is handed over; returns the extractor.
    func feed(
        _ packed: PackResult, into destination: String, pieces: Int = 64 << 10, change: (Int, inout [UInt8]) -> Int = { offset, _ in offset }
    ) throws -> StreamingExtractor {
        let archive = [UInt8](try Data(contentsOf: URL(fileURLWithPath: packed.archivePath)))
        // Every file as it arrives: each is checked then.
        let extractor = try StreamingExtractor(manifest: packed.manifest, destination: destination, streamingAtLeast: 0)
        var offset = 0
        while offset < archive.count {
            var piece = Array(archive[offset..<min(archive.count, offset + pieces)])
            let at = change(offset, &piece)
            try? piece.withUnsafeBytes { try extractor.consume($0, at: UInt64(at)) }
            offset += pieces
        }
        return extractor
    }

    @Test("a gap in the bytes abandons it: its folder goes, and finishing refuses with the reason")
    func gapAbandons() throws {
        let tmp = try TemporaryFolder()
        let packed = try packMixed(tmp)
        let extractor = try feed(packed, into: tmp.sub("installed/2.1")) { offset, _ in offset == 128 << 10 ? offset + 1 : offset }
        #expect(!extractor.isActive)
        #expect(extractor.failure?.message.contains("never reached the extraction") == true)
        #expect(siblings(tmp.sub("installed")).isEmpty, "nothing left behind")
        try expectRefused(extractor, packed, saying: "never reached", in: tmp)
    }

    @Test("a changed byte in a stored or a deflated entry fails its check and abandons the extraction")
    func damagedEntryAbandons() throws {
        let tmp = try TemporaryFolder()
        let packed = try packMixed(tmp)
        for path in ["Contents/payload.bin", "Contents/text/log.txt"] {
            let entry = try #require(packed.manifest.entries.first { $0.path == path })
            let target = Int(entry.dataOffset + entry.compressedSize / 2)
            let extractor = try feed(packed, into: tmp.sub("installed/2.1")) { offset, piece in
                if (offset..<offset + piece.count).contains(target) { piece[target - offset] ^= 0x01 }
                return offset
            }
            #expect(!extractor.isActive, "\(path)")
            #expect(extractor.failure?.message.contains(path) == true, "\(String(describing: extractor.failure))")
            #expect(siblings(tmp.sub("installed")).isEmpty)
        }
    }

    @Test("a manifest whose layout the archive's central directory does not give, or another product's archive, installs nothing")
    func finishChecksTheArchive() throws {
        let tmp = try TemporaryFolder()
        let packed = try packMixed(tmp)
        // The bytes follow the manifest's layout, but the archive's own directory says otherwise.
        var lying = packed.manifest
        let index = try #require(lying.entries.firstIndex { $0.path == "Contents/empty.dat" })
        lying.entries[index].localHeaderOffset += 1
        let bent = PackResult(archivePath: packed.archivePath, manifestPath: packed.manifestPath, manifest: lying)
        let extractor = try feed(bent, into: tmp.sub("installed/2.1"))
        #expect(extractor.isActive, "every entry matched the layout it was given")
        try expectRefused(extractor, packed, saying: "central directory does not give the layout of its manifest", in: tmp)

        let other = try feed(packed, into: tmp.sub("installed/2.1"))
        let wrong = ContentInfo(productIdentifier: try ProductIdentifier("com.example.other"), contentVersion: packed.manifest.contentVersion)
        try expectRefused(other, packed, expecting: wrong, saying: "not the expected com.example.other", in: tmp)
    }

    @Test("finishing before the last byte refuses; a destination that exists is refused at the start")
    func incompleteAndExisting() throws {
        let tmp = try TemporaryFolder()
        let packed = try packMixed(tmp)
        let short = try feed(packed, into: tmp.sub("installed/2.1")) { offset, piece in
            if offset + piece.count >= Int(packed.manifest.archiveSize) { piece = [] }
            return offset
        }
        try expectRefused(short, packed, saying: "of the archive's \(packed.manifest.archiveSize) bytes", in: tmp)

        try FileManager.default.createDirectory(atPath: tmp.sub("installed/2.1"), withIntermediateDirectories: true)
        let exists = try #require(throws: ArchiveError.self) { try StreamingExtractor(manifest: packed.manifest, destination: tmp.sub("installed/2.1")) }
        #expect(exists.message.contains("already exists"))
    }

    @Test("bytes a partial archive left out go back into it when the extraction is given up (as received, damaged ones too), and from a killed run's folder as far as its files go")
    func copiesBackLeftOutBytes() throws {
        let tmp = try TemporaryFolder()
        let packed = try packMixed(tmp)
        let archive = [UInt8](try Data(contentsOf: URL(fileURLWithPath: packed.archivePath)))
        /// A partial archive that left out `ranges`: zeros there.
        func partial(_ name: String, leavingOut ranges: [Range<UInt64>]) throws -> String {
            var bytes = archive
            for range in ranges { bytes.replaceSubrange(Int(range.lowerBound)..<Int(range.upperBound), with: repeatElement(0, count: range.count)) }
            try Data(bytes).write(to: URL(fileURLWithPath: tmp.sub(name)))
            return tmp.sub(name)
        }
        func contents(_ path: String) throws -> [UInt8] { [UInt8](try Data(contentsOf: URL(fileURLWithPath: path))) }

        // Given up part-way through the stored file: what it took is back, nothing past it.
        let extractor = try StreamingExtractor(manifest: packed.manifest, destination: tmp.sub("installed/2.1"))
        let payload = try #require(packed.manifest.entries.first { $0.path == "Contents/payload.bin" })
        #expect(payload.method == .stored)
        #expect(extractor.storedRanges == [payload.dataOffset..<(payload.dataOffset + payload.compressedSize)], "the stored file of 1 MiB and more only")
        let first = try partial("first.partial", leavingOut: extractor.storedRanges)
        extractor.copyBack(into: first)
        let stop = Int(payload.dataOffset) + (2 << 20) + 12_345
        try archive.withUnsafeBytes { try extractor.consume(UnsafeRawBufferPointer(rebasing: $0[0..<stop]), at: 0) }
        extractor.abandon(because: "a test gives it up")
        #expect(extractor.notCopiedBack == nil)
        let back = try contents(first)
        // Compared as one answer: a failing comparison of megabytes would print them all.
        #expect(back[0..<stop].elementsEqual(archive[0..<stop]))
        #expect(back[stop..<Int(payload.dataOffset + payload.compressedSize)].allSatisfy { $0 == 0 })
        #expect(siblings(tmp.sub("installed")).isEmpty, "its folder went after the copy")

        // A damaged byte fails the file's CRC-32 at its last byte: the bytes go back as they came.
        var damaged = archive
        damaged[Int(payload.dataOffset) + 1_000_000] ^= 0x40
        let second = try StreamingExtractor(manifest: packed.manifest, destination: tmp.sub("installed/2.1"))
        let secondPartial = try partial("second.partial", leavingOut: second.storedRanges)
        second.copyBack(into: secondPartial)
        #expect(throws: ArchiveError.self) { try damaged.withUnsafeBytes { try second.consume($0, at: 0) } }
        #expect(second.failure?.message.contains("CRC-32") == true, "\(String(describing: second.failure))")
        #expect(second.notCopiedBack == nil)
        #expect(try contents(secondPartial).elementsEqual(damaged))

        // A killed run's folder: its finished file goes back whole; one still being written, as
        // far as its writer got; a folder that is gone gives nothing back.
        let third = try StreamingExtractor(manifest: packed.manifest, destination: tmp.sub("installed/2.1"))
        let end = Int(payload.dataOffset + payload.compressedSize)
        try archive.withUnsafeBytes { try third.consume(UnsafeRawBufferPointer(rebasing: $0[0..<(end + 10)]), at: 0) }
        let whole = try partial("third.partial", leavingOut: third.storedRanges)
        #expect(StreamingExtractor.copyBack(manifest: packed.manifest, folder: third.folder, into: whole, through: UInt64(end + 10)) == nil)
        #expect(try contents(whole).elementsEqual(archive))
        // Each part copied is given back in the folder's file, so that a copy into blocks the
        // partial archive never reserved needs no more room than the disk had.
        var status = stat()
        #expect(stat(third.folder + "/Contents/payload.bin", &status) == 0)
        #expect(status.st_blocks == 0 || !punchesHoles(in: tmp.path), "\(status.st_blocks) blocks left in the copied file")
        let fourth = try StreamingExtractor(manifest: packed.manifest, destination: tmp.sub("elsewhere/2.1"))
        try archive.withUnsafeBytes { try fourth.consume(UnsafeRawBufferPointer(rebasing: $0[0..<stop]), at: 0) }
        let torn = try partial("fourth.partial", leavingOut: fourth.storedRanges)
        let lost = StreamingExtractor.copyBack(manifest: packed.manifest, folder: fourth.folder, into: torn, through: UInt64(stop))
        let copied = Int(lost ?? UInt64(stop))
        #expect(copied >= Int(payload.dataOffset) && copied <= stop)
        #expect(try contents(torn)[0..<copied].elementsEqual(archive[0..<copied]))
        let none = try partial("none.partial", leavingOut: third.storedRanges)
        #expect(StreamingExtractor.copyBack(manifest: packed.manifest, folder: tmp.sub("gone"), into: none, through: UInt64(end)) == payload.dataOffset)
        third.abandon(because: "the test is over")
        fourth.abandon(because: "the test is over")
    }

    /// Whether the file system under `folder` gives a file's blocks back on request
    /// (`FALLOC_FL_PUNCH_HOLE`; ext4, XFS, Btrfs and tmpfs do).
    func punchesHoles(in folder: String) -> Bool {
        let path = folder + "/punch-probe"
        _ = FileManager.default.createFile(atPath: path, contents: Data(repeating: 1, count: 1 << 16))
        defer { unlink(path) }
        let fd = open(path, O_RDWR)
        defer { close(fd) }
        return fd >= 0 && cwriteback_release(fd, 0, 1 << 16) == 0
    }
}

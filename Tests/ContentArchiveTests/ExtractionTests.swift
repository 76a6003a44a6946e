import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

/// Builds hostile archives with Python's zipfile, an independent writer.
let pythonHostileZip = #"""
    import sys, zipfile, struct
    kind, path = sys.argv[1], sys.argv[2]
    plist = open(sys.argv[3], 'rb').read()
    def base(z):
        z.writestr('ContentInfo.plist', plist)
        z.writestr('Contents/ok.txt', b'fine\n')
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as z:
        base(z)
        if kind == 'traversal':
            z.writestr('Contents/../../evil.txt', b'escaped')
        elif kind == 'combining':
            # A combining mark after a '/' makes one grapheme with it: split by Characters, the
            # '..' before it was not a component, though the file system sees one.
            z.writestr('Contents/../\u0301evil.txt', b'outside Contents/')
        elif kind == 'absolute':
            z.writestr(zipfile.ZipInfo('/tmp/evil-absolute.txt'), b'escaped')
        elif kind == 'backslash':
            z.writestr('Contents\\..\\evil.txt', b'escaped')
        elif kind == 'symlink':
            info = zipfile.ZipInfo('Contents/link')
            info.create_system = 3
            info.external_attr = (0o120777 << 16)
            z.writestr(info, '/etc/passwd')
        elif kind == 'duplicate':
            import warnings; warnings.simplefilter('ignore')
            z.writestr('Contents/ok.txt', b'other\n')
        elif kind == 'case':
            z.writestr('Contents/OK.txt', b'other\n')
        elif kind == 'normalisation':
            z.writestr('Contents/caf\u00e9.txt', b'composed\n')
            z.writestr('Contents/cafe\u0301.txt', b'decomposed\n')
        elif kind == 'bomb':
            z.writestr('Contents/zeros.bin', b'\0' * (50 << 20))
        elif kind == 'outside':
            z.writestr('Other/readme.txt', b'not under Contents')
        elif kind == 'noplist':
            pass
    if kind == 'noplist':
        with zipfile.ZipFile(path, 'w') as z:
            z.writestr('Contents/ok.txt', b'fine\n')
    if kind == 'lying-size':
        # Shrink the declared uncompressed size of Contents/ok.txt in both headers.
        data = bytearray(open(path, 'rb').read())
        name = b'Contents/ok.txt'
        for sig, off in ((b'PK\x03\x04', 22), (b'PK\x01\x02', 24)):
            i = 0
            while True:
                i = data.find(sig, i)
                if i < 0: break
                name_len_at = 26 if sig == b'PK\x03\x04' else 28
                start = 30 if sig == b'PK\x03\x04' else 46
                n = struct.unpack_from('<H', data, i + name_len_at)[0]
                if bytes(data[i + start:i + start + n]) == name:
                    struct.pack_into('<I', data, i + off, 2)
                i += 4
        open(path, 'wb').write(data)
    """#

@Suite("Safe extraction and verification", .onTestThreads)
struct ExtractionTests {
    func packSample(_ tmp: TemporaryFolder) throws -> PackResult {
        try ArchivePacker.pack(folder: repositoryContent("com.example.cosmos.levels1"), options: .init(outputDirectory: tmp.sub("out")))
    }

    #if os(Linux)
        @Test("an install reads the archive once: its pages leave the page cache as they are read, and the files come out whole")
        func readOnceLetsPagesGo() throws {
            let payload = pseudoRandomBytes(24 << 20, seed: 11)
            let id = try ProductIdentifier("com.example.once")
            let version = try ContentVersion("1.0")
            let stayed = try pagesStayed {
                let tmp = try TemporaryFolder(onDisk: ())
                try tmp.write("src/payload.bin", payload)
                // Stored, and synced by the packer: every page of the archive is clean and cached.
                let packed = try ArchivePacker.pack(
                    folder: tmp.sub("src"), options: PackOptions(productId: id, contentVersion: version, outputDirectory: tmp.sub("out"), level: 0))
                let entry = try #require(packed.manifest.entries.first { $0.path == "Contents/payload.bin" })
                let page = 4096
                let pages = (Int(entry.dataOffset) / page + 1) * page..<(Int(entry.dataOffset + entry.compressedSize) / page) * page
                let reader = try ArchiveReader(path: packed.archivePath)
                let read = try #require(reader.entries.first { $0.path == "Contents/payload.bin" })
                var count = 0
                try reader.read(read) { count += $0.count }
                #expect(count == payload.count)
                let cachedAfterRead = cachedBytes(of: packed.archivePath, in: pages)
                try SafeExtractor.extract(
                    archive: packed.archivePath, to: tmp.sub("installed/1.0"), expecting: ContentInfo(productIdentifier: id, contentVersion: version),
                    readOnce: true)
                // Large folios across the entry's two ends may stay (up to 2 MiB each); the rest must be gone.
                #expect(cachedBytes(of: packed.archivePath, in: pages) < 4 << 20, "read once: the archive's pages were let go of")
                #expect(try Data(contentsOf: URL(fileURLWithPath: tmp.sub("installed/1.0/Contents/payload.bin"))) == payload)
                return cachedAfterRead == pages.count
            }
            #expect(stayed, "a plain read keeps the archive cached")
        }
    #endif

    @Test("extraction yields exactly the content folder, renamed into place, with nothing else left")
    func extracts() throws {
        let tmp = try TemporaryFolder()
        let packed = try packSample(tmp)
        let info = try SafeExtractor.extract(
            archive: packed.archivePath, to: tmp.sub("installed/1.0"),
            expecting: ContentInfo(productIdentifier: packed.manifest.productId, contentVersion: packed.manifest.contentVersion))
        #expect(info.productIdentifier.rawValue == "com.example.cosmos.levels1")
        let diff = try run("diff", ["-r", repositoryContent("com.example.cosmos.levels1"), tmp.sub("installed/1.0")])
        #expect(diff.status == 0, "\(diff.stdout)")
        #expect(tmp.files(in: "installed") == ["1.0"])

        let again = try #require(throws: ArchiveError.self) { try SafeExtractor.extract(archive: packed.archivePath, to: tmp.sub("installed/1.0")) }
        #expect(again.message.contains("already exists"))

        let wrong = try #require(throws: ArchiveError.self) {
            try SafeExtractor.extract(
                archive: packed.archivePath, to: tmp.sub("installed/2.0"),
                expecting: ContentInfo(productIdentifier: packed.manifest.productId, contentVersion: try ContentVersion("2.0")))
        }
        #expect(wrong.message.contains("not the expected com.example.cosmos.levels1 2.0"))
        #expect(tmp.files(in: "installed") == ["1.0"])
    }

    @Test(
        "hostile archives are refused and nothing is written",
        arguments: [
            ("traversal", "unsafe path"), ("combining", "unsafe path"), ("absolute", "unsafe path"), ("backslash", "unsafe path"),
            ("symlink", "symbolic link"), ("duplicate", "twice"), ("case", "differ only by case"),
            ("normalisation", "Unicode normalisation"), ("bomb", "zip bombs"),
            ("outside", "outside Contents/"), ("noplist", "no ContentInfo.plist"), ("lying-size", "more than its declared"),
        ])
    func hostile(kind: String, message: String) throws {
        let tmp = try TemporaryFolder()
        try tmp.write("make.py", pythonHostileZip)
        let plist = try tmp.write("ContentInfo.plist", ContentInfo(productIdentifier: try ProductIdentifier("com.example.evil"), contentVersion: try ContentVersion("1.0")).plistData)
        let archive = tmp.sub("in/evil.zip")
        try FileManager.default.createDirectory(atPath: tmp.sub("in"), withIntermediateDirectories: true)
        let made = try run("python3", [tmp.sub("make.py"), kind, archive, plist])
        #expect(made.status == 0, "\(made.stderr)")
        let error = try #require(throws: ArchiveError.self) { try SafeExtractor.extract(archive: archive, to: tmp.sub("dest/pack")) }
        #expect(error.code == .corrupt)
        #expect(error.message.contains(message), "\(error.message)")
        #expect(tmp.files(in: "dest").isEmpty)
        #expect(!FileManager.default.fileExists(atPath: tmp.sub("evil.txt")))
        #expect(!FileManager.default.fileExists(atPath: "/tmp/evil-absolute.txt"))
        let verify = try iapPack(["verify", archive])
        #expect(verify.status == 1)
    }

    @Test("a corrupted byte fails the CRC check; a manifest that does not match is caught")
    func corruption() throws {
        let tmp = try TemporaryFolder()
        let packed = try packSample(tmp)
        // Flip one byte inside a stored PNG's data.
        let png = try #require(packed.manifest.entries.first { $0.path == "Contents/textures/ice.png" })
        var bytes = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
        let copy = tmp.sub("copy/" + packed.manifest.archiveName)
        try tmp.write("copy/" + packed.manifest.archiveName, bytes)
        let at = Int(png.dataOffset + png.compressedSize / 2)
        bytes[at] ^= 0x40
        try bytes.write(to: URL(fileURLWithPath: packed.archivePath))
        let crc = try #require(throws: ArchiveError.self) { try ArchiveVerifier.verify(archive: packed.archivePath) }
        #expect(crc.message.contains("fails its CRC-32 check"))
        let extract = try #require(throws: ArchiveError.self) { try SafeExtractor.extract(archive: packed.archivePath, to: tmp.sub("x")) }
        #expect(extract.message.contains("CRC-32"))
        #expect(!FileManager.default.fileExists(atPath: tmp.sub("x")))

        // An intact archive beside the wrong manifest.
        var manifest = packed.manifest
        manifest.entries[3].sha256 = String(repeating: "0", count: 64)
        try tmp.write("copy/" + ArchiveManifest.manifestName(productId: manifest.productId, version: manifest.contentVersion), manifest.jsonData())
        let mismatch = try #require(throws: ArchiveError.self) { try ArchiveVerifier.verify(archive: copy) }
        #expect(mismatch.message.contains("does not match"))
        let cli = try iapPack(["verify", copy, "--json"])
        #expect(cli.status == 1)
        #expect(cli.stdout.contains("\"code\":\"corrupt\""))
    }

    @Test("a truncated file or one that is not a ZIP is reported, not crashed on")
    func truncated() throws {
        let tmp = try TemporaryFolder()
        let packed = try packSample(tmp)
        let bytes = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
        for cut in [0, 10, bytes.count / 2, bytes.count - 5] {
            let path = try tmp.write("cut-\(cut).zip", bytes.prefix(cut))
            let error = try #require(throws: ArchiveError.self) { try ArchiveReader(path: path) }
            #expect(error.code == .corrupt)
        }
        let text = try tmp.write("text.zip", "just some text, not an archive")
        #expect(throws: ArchiveError.self) { try ArchiveReader(path: text) }
    }

    /// Hostile bytes beyond the hand-made cases: seeded random damage to the headers (local
    /// headers, central directory, end record) of a real archive. Each damaged archive is refused
    /// with an `ArchiveError` leaving nothing at the destination, or extracts exactly the content
    /// that was packed (the damage hit times, attributes or versions). A trap on a bad length or
    /// offset would end the test run.
    @Test("seeded random damage to an archive's headers is refused cleanly or changes nothing extracted")
    func damagedHeaders() throws {
        let tmp = try TemporaryFolder()
        let packed = try packSample(tmp)
        let original = [UInt8](try Data(contentsOf: URL(fileURLWithPath: packed.archivePath)))
        // Where headers are: every entry's local header (30 bytes and its name), and from the
        // central directory to the end.
        let local = packed.manifest.entries.map { Int($0.localHeaderOffset)..<Int($0.dataOffset) }
        let directory = Int(packed.manifest.entries.map { $0.dataOffset + $0.compressedSize }.max()!)..<original.count
        let interesting: [UInt8] = [0x00, 0x01, 0x2F, 0x2E, 0x5C, 0x7F, 0x80, 0xFF]
        var random = SplitMix64(seed: 17)
        var refused = 0
        var extracted = 0
        for round in 0..<600 {
            var bytes = original
            for _ in 0...(random.next() % 3) {
                let region = random.next() % 2 == 0 ? directory : local[Int(random.next() % UInt64(local.count))]
                let at = region.lowerBound + Int(random.next() % UInt64(region.count))
                bytes[at] = random.next() % 2 == 0 ? interesting[Int(random.next() % UInt64(interesting.count))] : UInt8(truncatingIfNeeded: random.next())
            }
            let archive = try tmp.write("damaged.zip", Data(bytes))
            let parent = "out-\(round)"
            do throws(ArchiveError) {
                _ = try SafeExtractor.extract(archive: archive, to: tmp.sub(parent + "/pack"), durable: false)
                extracted += 1
                // Damage the checks let through (times, attributes, versions) changes no name and no byte.
                let same = try? run("diff", ["-r", "--no-dereference", repositoryContent("com.example.cosmos.levels1"), tmp.sub(parent + "/pack")])
                #expect(same?.status == 0, "round \(round): the extracted files differ: \(same?.stdout ?? "")")
            } catch {
                refused += 1
                #expect(tmp.files(in: parent).isEmpty, "round \(round) (\(error.message)) left \(tmp.files(in: parent))")
            }
            try? FileManager.default.removeItem(atPath: tmp.sub(parent))
        }
        // Nothing landed beside the destinations.
        #expect(Set(tmp.files(in: "")).isSubset(of: ["damaged.zip", "out"]), "\(tmp.files(in: ""))")
        #expect(refused > 300, "only \(refused) of 600 damaged archives were refused")
        #expect(refused + extracted == 600)
    }
}

import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

/// Checks an archive with Python's zipfile and the manifest's offsets and hashes independently of
/// our reader: each entry's bytes are taken at `dataOffset` and inflated with Python's zlib.
let pythonManifestCheck = #"""
    import hashlib, json, sys, zipfile, zlib
    archive, manifest_path, source = sys.argv[1], sys.argv[2], sys.argv[3]
    manifest = json.load(open(manifest_path))
    data = open(archive, 'rb').read()
    assert manifest['archiveSize'] == len(data), 'size'
    assert manifest['archiveSHA256'] == hashlib.sha256(data).hexdigest(), 'archive sha'
    z = zipfile.ZipFile(archive)
    assert z.testzip() is None, 'testzip'
    infos = {i.filename: i for i in z.infolist()}
    assert [e['path'] for e in manifest['entries']] == [i.filename for i in z.infolist()], 'order'
    assert [e['path'] for e in manifest['entries']] == sorted(infos, key=lambda p: p.encode()), 'sorted'
    for e in manifest['entries']:
        info = infos[e['path']]
        assert info.header_offset == e['localHeaderOffset'], ('offset', e['path'])
        raw = data[e['dataOffset']:e['dataOffset'] + e['compressedSize']]
        body = zlib.decompressobj(-15).decompress(raw) if e['method'] == 'deflate' else raw
        assert len(body) == e['uncompressedSize'], ('size', e['path'])
        assert hashlib.sha256(body).hexdigest() == e['sha256'], ('sha', e['path'])
        assert zlib.crc32(body) == e['crc32'] == info.CRC, ('crc', e['path'])
        assert info.date_time == (1980, 1, 1, 0, 0, 0), ('time', info.date_time)
        if e['kind'] == 'file' and e['path'] != 'ContentInfo.plist':
            original = open(source + '/' + e['path'][len('Contents/'):], 'rb').read()
            assert original == body, ('content', e['path'])
            assert (info.external_attr >> 16) == 0o100644, ('mode', oct(info.external_attr >> 16))
    print('ok', len(manifest['entries']))
    """#

@Suite("Packing", .onTestThreads)
struct PackingTests {
    /// A plain folder with text, JSON, a 9.6 MB log and a 5 MiB incompressible file (whole under
    /// the standard chunking, several chunks each `inSmallChunks`).
    func makeMixedFolder(_ tmp: TemporaryFolder, name: String = "src") throws -> String {
        try tmp.write("\(name)/levels/level1.json", #"{"id": 1, "name": "First", "enemies": [1, 2, 3]}"#)
        try tmp.write("\(name)/README.txt", "Read me.\n")
        try tmp.write("\(name)/logs/big.log", logText(lines: 120_000, seed: 7))
        try tmp.write("\(name)/media/noise.bin", pseudoRandomBytes(5 << 20, seed: 3))
        try tmp.write("\(name)/empty.txt", "")
        try FileManager.default.createDirectory(atPath: tmp.sub("\(name)/empty-folder"), withIntermediateDirectories: true)
        return tmp.sub(name)
    }

    @Test("archives read with Info-ZIP unzip and Python's zipfile; manifest offsets and hashes are right")
    func standardReaders() throws {
        let tmp = try TemporaryFolder()
        let source = try makeMixedFolder(tmp)
        let result = try ArchivePacker.pack(
            folder: source,
            options: PackOptions(
                productId: try ProductIdentifier("com.example.mixed"), contentVersion: try ContentVersion("1.2.3"),
                outputDirectory: tmp.sub("out")
            ).inSmallChunks)
        #expect(result.archivePath.hasSuffix("/com.example.mixed-1.2.3.zip"))
        #expect(result.manifestPath.hasSuffix("/com.example.mixed-1.2.3.manifest.json"))

        let unzip = try run("unzip", ["-t", result.archivePath])
        #expect(unzip.status == 0, "\(unzip.stdout)\(unzip.stderr)")
        #expect(unzip.stdout.contains("No errors detected"))

        try tmp.write("check.py", pythonManifestCheck)
        let python = try run("python3", [tmp.sub("check.py"), result.archivePath, result.manifestPath, source])
        #expect(python.status == 0, "\(python.stdout)\(python.stderr)")

        let byPath = Dictionary(uniqueKeysWithValues: result.manifest.entries.map { ($0.path, $0) })
        #expect(byPath["Contents/media/noise.bin"]?.method == .stored)
        #expect(byPath["Contents/logs/big.log"]?.method == .deflate)
        #expect(byPath["Contents/empty-folder/"]?.kind == .directory)
        #expect(result.manifest.entries.first?.path == "ContentInfo.plist")

        // unzip extracts exactly the folder StoreKit handed apps.
        let unpacked = tmp.sub("unpacked")
        #expect(try run("unzip", ["-q", result.archivePath, "-d", unpacked]).status == 0)
        let plist = try ContentInfo(plist: Data(contentsOf: URL(fileURLWithPath: unpacked + "/ContentInfo.plist")), source: "plist")
        #expect(plist == ContentInfo(productIdentifier: try ProductIdentifier("com.example.mixed"), contentVersion: try ContentVersion("1.2.3")))
        #expect(try Data(contentsOf: URL(fileURLWithPath: unpacked + "/Contents/logs/big.log")) == Data(logText(lines: 120_000, seed: 7).utf8))
    }

    @Test("same input, id, version and level give byte-identical output, whatever order, times, umask or threads")
    func reproducible() throws {
        let tmp = try TemporaryFolder()
        let first = try makeMixedFolder(tmp, name: "a")
        // The same files created in the opposite order, with other times and permissions.
        let files = ["media/noise.bin", "logs/big.log", "empty.txt", "README.txt", "levels/level1.json"]
        for file in files {
            let data = try Data(contentsOf: URL(fileURLWithPath: first + "/" + file))
            let path = try tmp.write("b/" + file, data)
            try FileManager.default.setAttributes([.modificationDate: Date(timeIntervalSince1970: 1_000_000), .posixPermissions: 0o600], ofItemAtPath: path)
        }
        try FileManager.default.createDirectory(atPath: tmp.sub("b/empty-folder"), withIntermediateDirectories: true)
        let id = try ProductIdentifier("com.example.repro"), version = try ContentVersion("2.0")
        let one = try ArchivePacker.pack(folder: first, options: PackOptions(productId: id, contentVersion: version, outputDirectory: tmp.sub("one"), threads: 1).inSmallChunks)
        let two = try ArchivePacker.pack(folder: tmp.sub("b"), options: PackOptions(productId: id, contentVersion: version, outputDirectory: tmp.sub("two"), threads: 4).inSmallChunks)
        #expect(try Data(contentsOf: URL(fileURLWithPath: one.archivePath)) == Data(contentsOf: URL(fileURLWithPath: two.archivePath)))
        #expect(try Data(contentsOf: URL(fileURLWithPath: one.manifestPath)) == Data(contentsOf: URL(fileURLWithPath: two.manifestPath)))

        // The folder named through a link (a pipeline's `current`) packs as the folder itself.
        try FileManager.default.createSymbolicLink(atPath: tmp.sub("current"), withDestinationPath: tmp.sub("b"))
        let linked = try ArchivePacker.pack(
            folder: tmp.sub("current"), options: PackOptions(productId: id, contentVersion: version, outputDirectory: tmp.sub("linked")).inSmallChunks)
        #expect(try Data(contentsOf: URL(fileURLWithPath: linked.archivePath)) == Data(contentsOf: URL(fileURLWithPath: two.archivePath)))

        // Another level gives other bytes; SOURCE_DATE_EPOCH moves the timestamp, reproducibly.
        let level1 = try ArchivePacker.pack(folder: first, options: PackOptions(productId: id, contentVersion: version, outputDirectory: tmp.sub("l1"), level: 1).inSmallChunks)
        #expect(level1.manifest.archiveSHA256 != one.manifest.archiveSHA256)
        let epoch = try ArchiveTimestamp.fromEnvironment(["SOURCE_DATE_EPOCH": "1700000000"])
        let dated = try ArchivePacker.pack(folder: first, options: .init(productId: id, contentVersion: version, outputDirectory: tmp.sub("d"), timestamp: epoch))
        #expect(dated.manifest.createdAt == "2023-11-14T22:13:20Z")
        #expect(dated.manifest.archiveSHA256 != one.manifest.archiveSHA256)
    }

    @Test("an archive's times are Foundation's UTC calendar's, from 1980 to 2107, leap days and centuries included")
    func timestampFields() {
        var calendar = Calendar(identifier: .gregorian)
        calendar.timeZone = TimeZone(identifier: "UTC")!
        let formatter = ISO8601DateFormatter()
        formatter.timeZone = TimeZone(identifier: "UTC")!
        var generator = SystemRandomNumberGenerator()
        // 1980-01-01, 2000-02-29, 2000-03-01, 2100-02-28 and 2100-03-01 (not a leap year), the
        // last second of 2107, then random times between.
        let edges: [Int64] = [315_532_800, 951_782_400, 951_868_800, 4_107_456_000, 4_107_542_400, 4_354_819_198]
        for seconds in edges + (0..<2_000).map({ _ in Int64.random(in: 315_532_800...4_354_819_198, using: &generator) }) {
            let stamp = ArchiveTimestamp(secondsSince1970: seconds)
            let c = calendar.dateComponents([.year, .month, .day, .hour, .minute, .second], from: stamp.date)
            let expected = (
                time: UInt16(c.hour! << 11 | c.minute! << 5 | c.second! / 2),
                date: UInt16((c.year! - 1980) << 9 | c.month! << 5 | c.day!)
            )
            #expect(stamp.dos == expected, "\(seconds)")
            #expect(stamp.iso8601 == formatter.string(from: stamp.date), "\(seconds)")
        }
    }

    @Test("level 0 stores every entry; every level round-trips through our own verifier")
    func levels() throws {
        let tmp = try TemporaryFolder()
        let source = try makeMixedFolder(tmp)
        let id = try ProductIdentifier("com.example.levels")
        var sizes: [Int: UInt64] = [:]
        for level in [0, 1, 6, 12] {
            let result = try ArchivePacker.pack(folder: source, options: .init(productId: id, contentVersion: try ContentVersion("\(level + 1).0"), outputDirectory: tmp.sub("out"), level: level))
            let report = try ArchiveVerifier.verify(archive: result.archivePath)
            #expect(report.manifest == result.manifestPath)
            sizes[level] = result.manifest.archiveSize
            if level == 0 { #expect(result.manifest.entries.allSatisfy { $0.method == .stored }) }
        }
        #expect(sizes[6]! < sizes[1]! && sizes[1]! < sizes[0]!)
    }

    @Test("an Xcode content folder packs as it is; flags may be omitted and must agree with its plist")
    func xcodeFolder() throws {
        let tmp = try TemporaryFolder()
        let source = repositoryContent("com.example.cosmos.levels1")
        let result = try ArchivePacker.pack(folder: source, options: .init(outputDirectory: tmp.sub("out")))
        #expect(result.manifest.productId.rawValue == "com.example.cosmos.levels1")
        #expect(result.manifest.contentVersion.string == "1.0")
        let plistEntry = try #require(result.manifest.entries.first)
        let plistBytes = try Data(contentsOf: URL(fileURLWithPath: source + "/ContentInfo.plist"))
        #expect(plistEntry.uncompressedSize == UInt64(plistBytes.count))

        let agreeing = try iapPack(["build", source, "--product-id", "com.example.cosmos.levels1", "--content-version", "1.0", "-o", tmp.sub("cli"), "--json"])
        #expect(agreeing.status == 0, "\(agreeing.stderr)")
        let output = try JSONSerialization.jsonObject(with: Data(agreeing.stdout.utf8)) as? [String: Any]
        #expect(output?["sha256"] as? String == result.manifest.archiveSHA256)

        let disagreeing = try iapPack(["build", source, "--content-version", "1.1", "-o", tmp.sub("bad")])
        #expect(disagreeing.status == 1)
        #expect(disagreeing.stderr.contains("disagrees with ContentVersion '1.0'"))
        #expect(tmp.files(in: "bad").isEmpty)
    }

    @Test("Finder and version-control files are left out as Xcode leaves them out, and the build says so")
    func leftOutNames() throws {
        let tmp = try TemporaryFolder()
        // An Xcode-style folder as a Mac leaves it: .DS_Store beside the plist and in folders, a
        // .git checkout, CVS and .svn folders; the same folder without them is the reference.
        let source = repositoryContent("com.example.cosmos.levels1")
        #expect(try run("cp", ["-R", source, tmp.sub("clean")]).status == 0)
        #expect(try run("cp", ["-R", source, tmp.sub("mac")]).status == 0)
        for extra in [".DS_Store", "Contents/.DS_Store", "Contents/.git/config", "Contents/.git/objects/ab/cdef", "Contents/CVS/Entries", "Contents/.svn/wc.db", "Contents/.hg/store"] {
            try tmp.write("mac/" + extra, "not content")
        }
        let id = try ProductIdentifier("com.example.cosmos.levels1")
        let clean = try ArchivePacker.pack(folder: tmp.sub("clean"), options: .init(productId: id, outputDirectory: tmp.sub("o1")))
        let mac = try ArchivePacker.pack(folder: tmp.sub("mac"), options: .init(productId: id, outputDirectory: tmp.sub("o2")))
        #expect(try Data(contentsOf: URL(fileURLWithPath: mac.archivePath)) == Data(contentsOf: URL(fileURLWithPath: clean.archivePath)))
        #expect(mac.leftOut == [".DS_Store", "Contents/.DS_Store", "Contents/.git", "Contents/.hg", "Contents/.svn", "Contents/CVS"])
        #expect(clean.leftOut.isEmpty)

        let cli = try iapPack(["build", tmp.sub("mac"), "-o", tmp.sub("o3")])
        #expect(cli.status == 0, "\(cli.stderr)")
        #expect(cli.stdout.contains("left out  .DS_Store, Contents/.DS_Store, Contents/.git and 3 more"), "\(cli.stdout)")
    }

    @Test("iap-pack verify and inspect report on an archive, in text and JSON")
    func verifyAndInspect() throws {
        let tmp = try TemporaryFolder()
        let built = try iapPack(["build", repositoryContent("com.example.soundkit.drums"), "-o", tmp.path])
        #expect(built.status == 0)
        #expect(built.stdout.contains("packed com.example.soundkit.drums 1.0"))
        let archive = tmp.sub("com.example.soundkit.drums-1.0.zip")
        let verified = try iapPack(["verify", archive])
        #expect(verified.status == 0)
        #expect(verified.stdout.contains("matches"))
        let inspected = try iapPack(["inspect", archive, "--json"])
        #expect(inspected.status == 0)
        let json = try JSONSerialization.jsonObject(with: Data(inspected.stdout.utf8)) as? [String: Any]
        let entries = json?["entries"] as? [[String: Any]]
        #expect(entries?.contains { $0["path"] as? String == "Contents/samples/kick.wav" } == true)
        let text = try iapPack(["inspect", archive])
        #expect(text.stdout.contains("Contents/kit.json"))
        let wrong = try iapPack(["extract", archive, tmp.sub("device/2.0"), "--content-version", "2.0"])
        #expect(wrong.status == 1 && wrong.stderr.contains("not the expected"))
        #expect(!FileManager.default.fileExists(atPath: tmp.sub("device/2.0")))
        let installed = try iapPack(["extract", archive, tmp.sub("device/1.0"), "--product-id", "com.example.soundkit.drums", "--json"])
        #expect(installed.status == 0)
        #expect(FileManager.default.fileExists(atPath: tmp.sub("device/1.0/Contents/samples/kick.wav")))

        // A folder, a device or a pipe where the archive should be is named as such (a folder's
        // size read as 2^63 bytes, and a pipe's open waited for a writer).
        #expect(mkfifo(tmp.sub("pipe"), 0o644) == 0)
        for (path, says) in [(tmp.sub("device"), "is a folder, not an archive"), ("/dev/null", "is not a regular file"), (tmp.sub("pipe"), "is not a regular file")] {
            for command in ["verify", "inspect"] {
                let result = try iapPack([command, path])
                #expect(result.status == 1 && result.stderr.contains(says), "\(command) \(path): \(result.stderr)")
            }
        }
    }

    @Test("content versions compare numerically; identifiers and versions are validated")
    func identifiers() throws {
        #expect(try ContentVersion("1.10") > ContentVersion("1.9"))
        #expect(try ContentVersion("2.0") > ContentVersion("1.99.99"))
        #expect(try ContentVersion("1.0").isNumericallyEqual(to: ContentVersion("1.0.0")))
        for bad in ["", "1.", ".1", "1..2", "v1", "1.0-beta", "1.2.3.4.5.6.7.8.9", "1234567890"] {
            #expect(throws: ArchiveError.self) { try ContentVersion(bad) }
        }
        for good in ["com.example.levels", "level_pack-2", "A1"] { #expect(throws: Never.self) { try ProductIdentifier(good) } }
        for bad in ["", ".com", "com.", "com..x", "-x", "com.example/levels", "com.exämple", String(repeating: "a", count: 256)] {
            #expect(throws: ArchiveError.self) { try ProductIdentifier(bad) }
        }
    }
}

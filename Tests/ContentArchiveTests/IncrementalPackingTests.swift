import DurableFiles
import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

@Suite("Incremental packing and chunk hashes", .onTestThreads)
struct IncrementalPackingTests {
    /// Version 1.0 of a product: text of several kinds, a multi-chunk log, incompressible media.
    func makeVersion1(_ tmp: TemporaryFolder) throws -> String {
        for i in 0..<12 { try tmp.write("v1/levels/level\(i).json", #"{"id": \#(i), "enemies": [\#(i), 2, 3], "name": "level \#(i)"}"#) }
        try tmp.write("v1/logs/big.log", logText(lines: 60_000, seed: 7))
        try tmp.write("v1/media/noise.bin", pseudoRandomBytes(3 << 20, seed: 3))
        try tmp.write("v1/media/small.bin", pseudoRandomBytes(200_000, seed: 4))
        try tmp.write("v1/README.txt", "Read me.\n")
        return tmp.sub("v1")
    }

    /// 1.1: one level changed, one removed, one added, a renamed copy of the log, media unchanged.
    func makeVersion2(_ tmp: TemporaryFolder, from v1: String) throws -> String {
        let v2 = tmp.sub("v2")
        try FileManager.default.copyItem(atPath: v1, toPath: v2)
        try tmp.write("v2/levels/level3.json", #"{"id": 3, "enemies": [9, 9, 9], "name": "level 3, harder"}"#)
        try FileManager.default.removeItem(atPath: v2 + "/levels/level5.json")
        try tmp.write("v2/levels/level99.json", #"{"id": 99}"#)
        try FileManager.default.copyItem(atPath: v2 + "/logs/big.log", toPath: v2 + "/logs/copy.log")
        return v2
    }

    func options(_ version: String, _ out: String, previous: String? = nil) throws -> PackOptions {
        var options = PackOptions(
            productId: try ProductIdentifier("com.example.delta"), contentVersion: try ContentVersion(version), outputDirectory: out
        ).inSmallChunks
        options.previous = previous
        return options
    }

    /// 1.0 packed from a fresh folder with its hash cache written in full (the build counts as
    /// done 10 s on, so no file is too recent to be recorded).
    func packVersion1WithCache(_ tmp: TemporaryFolder) throws -> (folder: String, packed: PackResult) {
        let v1 = try makeVersion1(tmp)
        var first = try options("1.0", tmp.sub("old"))
        first.hashCacheTime = Date().addingTimeInterval(10)
        return (v1, try ArchivePacker.pack(folder: v1, options: first))
    }

    @Test("--previous gives the bytes of a full build and copies the unchanged entries")
    func sameBytesAsFullBuild() throws {
        let tmp = try TemporaryFolder()
        let v1 = try makeVersion1(tmp)
        let v2 = try makeVersion2(tmp, from: v1)
        let old = try ArchivePacker.pack(folder: v1, options: try options("1.0", tmp.sub("old")))
        let full = try ArchivePacker.pack(folder: v2, options: try options("1.1", tmp.sub("full")))
        let incremental = try ArchivePacker.pack(folder: v2, options: try options("1.1", tmp.sub("incremental"), previous: old.archivePath))
        #expect(try sha256Hex(full.archivePath) == sha256Hex(incremental.archivePath))
        #expect(FileManager.default.contents(atPath: full.manifestPath) == FileManager.default.contents(atPath: incremental.manifestPath))
        #expect(full.reusedEntries == 0)
        // Unchanged: 10 levels, the README, both media files, the log and its renamed copy.
        #expect(incremental.reusedEntries == 15)
        let changed = incremental.manifest.entries.filter { $0.kind == .file }.count - incremental.reusedEntries
        #expect(changed == 3)  // ContentInfo.plist (new version), level3, level99

        // Without syncing (--no-sync), the same bytes.
        var unsynced = try options("1.1", tmp.sub("unsynced"), previous: old.archivePath)
        unsynced.sync = false
        #expect(try sha256Hex(ArchivePacker.pack(folder: v2, options: unsynced).archivePath) == sha256Hex(full.archivePath))

        // A previous build made at another SOURCE_DATE_EPOCH has other headers: its entries'
        // compressed bytes are still reused, under this build's headers.
        var earlier = try options("1.0", tmp.sub("earlier"))
        earlier.timestamp = ArchiveTimestamp(secondsSince1970: 1_700_000_000)
        let other = try ArchivePacker.pack(folder: v1, options: earlier)
        let restamped = try ArchivePacker.pack(folder: v2, options: try options("1.1", tmp.sub("restamped"), previous: other.archivePath))
        #expect(restamped.reusedEntries == 15)
        #expect(try sha256Hex(restamped.archivePath) == sha256Hex(full.archivePath))

        // Naming the manifest instead of the archive does the same.
        let byManifest = try ArchivePacker.pack(folder: v2, options: try options("1.1", tmp.sub("by-manifest"), previous: old.manifestPath))
        #expect(byManifest.reusedEntries == 15)
        #expect(try sha256Hex(byManifest.archivePath) == sha256Hex(full.archivePath))

        // So does naming the last build's output folder, when it holds one build; a folder with
        // none, or only later versions, is refused, naming what it holds.
        let byFolder = try ArchivePacker.pack(folder: v2, options: try options("1.1", tmp.sub("by-folder"), previous: tmp.sub("old")))
        #expect(byFolder.reusedEntries == 15)
        #expect(try sha256Hex(byFolder.archivePath) == sha256Hex(full.archivePath))
        try FileManager.default.createDirectory(atPath: tmp.sub("no-build"), withIntermediateDirectories: true)
        _ = try ArchivePacker.pack(folder: v2, options: try options("1.2", tmp.sub("by-folder"), previous: old.archivePath))
        for (folder, version, says) in [
            (tmp.sub("no-build"), "1.3", "holds no manifest"),
            (
                tmp.sub("by-folder"), "1.0",
                "holds 2 manifests (com.example.delta-1.1.manifest.json, com.example.delta-1.2.manifest.json) and none of com.example.delta older than 1.0"
            ),
        ] {
            #expect(throws: ArchiveError.self) { try ArchivePacker.pack(folder: v2, options: try options(version, tmp.sub("refused"), previous: folder)) }
            let cli = try iapPack(["build", v2, "--product-id", "com.example.delta", "--content-version", version, "-o", tmp.sub("refused"), "--previous", folder])
            #expect(cli.status == 1 && cli.stderr.contains(says), "\(cli.stderr)")
        }
        #expect(tmp.files(in: "refused").isEmpty)
    }

    @Test("a pipeline packing every version into one folder names that folder: the newest earlier build of the product is taken")
    func previousFromASeriesFolder() throws {
        let tmp = try TemporaryFolder()
        let v1 = try makeVersion1(tmp)
        let v2 = try makeVersion2(tmp, from: v1)
        let series = tmp.sub("series")
        _ = try ArchivePacker.pack(folder: v1, options: try options("1.0", series))
        _ = try ArchivePacker.pack(folder: v2, options: try options("1.1", series, previous: series))
        // A build of another product in the same folder is not a candidate.
        var other = try options("1.5", series)
        other.productId = try ProductIdentifier("com.example.other")
        _ = try ArchivePacker.pack(folder: v1, options: other)
        // 1.1 is taken over 1.0: every file of v2 but ContentInfo.plist is reused (15 from 1.0).
        let next = try ArchivePacker.pack(folder: v2, options: try options("1.2", series, previous: series))
        #expect(next.reusedEntries == 17)
        let full = try ArchivePacker.pack(folder: v2, options: try options("1.2", tmp.sub("full")))
        #expect(try sha256Hex(next.archivePath) == sha256Hex(full.archivePath))

        // Without flags the product and version come from the folder's ContentInfo.plist.
        let xcode = tmp.sub("xcode")
        try FileManager.default.createDirectory(atPath: xcode, withIntermediateDirectories: true)
        try FileManager.default.copyItem(atPath: v2, toPath: xcode + "/Contents")
        let info = ContentInfo(productIdentifier: try ProductIdentifier("com.example.delta"), contentVersion: try ContentVersion("1.3"))
        try info.plistData.write(to: URL(fileURLWithPath: xcode + "/ContentInfo.plist"))
        var unnamed = try options("1.3", series, previous: series)
        unnamed.productId = nil
        unnamed.contentVersion = nil
        let fromPlist = try ArchivePacker.pack(folder: xcode, options: unnamed)
        #expect(fromPlist.manifest.contentVersion.string == "1.3" && fromPlist.reusedEntries == 17)
    }

    @Test("unchanged files take their SHA-256 from the previous build's hash cache; a file rewritten in place is hashed again")
    func hashCache() throws {
        let tmp = try TemporaryFolder()
        let (v1, old) = try packVersion1WithCache(tmp)
        let cache = HashCache.load(besideArchive: old.archivePath)
        let log = v1 + "/logs/big.log"
        #expect(cache.digest(of: log, identity: FileIdentity.of(log)) == old.manifest.entries.first { $0.path == "Contents/logs/big.log" }?.sha256)
        #expect(cache.digests.count == 16)

        // The same folder edited in place for 1.1: one level rewritten with bytes of the same size
        // and its modification time put back, which only the change time gives away.
        let level = v1 + "/levels/level4.json"
        let before = try FileManager.default.attributesOfItem(atPath: level)[.modificationDate] as! Date
        let original = try Data(contentsOf: URL(fileURLWithPath: level))
        try Data(original.map { $0 == UInt8(ascii: "4") ? UInt8(ascii: "7") : $0 }).write(to: URL(fileURLWithPath: level))
        try FileManager.default.setAttributes([.modificationDate: before], ofItemAtPath: level)
        #expect(cache.digest(of: level, identity: FileIdentity.of(level)) == nil)
        let incremental = try ArchivePacker.pack(folder: v1, options: try options("1.1", tmp.sub("inc"), previous: old.archivePath))
        let full = try ArchivePacker.pack(folder: v1, options: try options("1.1", tmp.sub("full")))
        #expect(try sha256Hex(incremental.archivePath) == sha256Hex(full.archivePath))
        // Its new bytes are level7.json's, which the previous archive has: reused from there.
        #expect(incremental.reusedEntries == 16)

        // A damaged cache is ignored, not trusted.
        let path = HashCache.path(besideArchive: old.archivePath)
        let intact = try Data(contentsOf: URL(fileURLWithPath: path))
        try Data("iap-pack-hashes 1\nnot a line\n".utf8).write(to: URL(fileURLWithPath: path))
        #expect(HashCache.load(besideArchive: old.archivePath).digests.isEmpty)
        // So is one whose digest is not hex (found by tools/fuzz.sh state: a byte that is not
        // UTF-8 was read as a digest, and written back as text the next read refused).
        var damaged = [UInt8](intact)
        let firstDigest = try #require(damaged.firstIndex(of: UInt8(ascii: "\n"))) + 1
        damaged[firstDigest + 10] = 0x9F
        try Data(damaged).write(to: URL(fileURLWithPath: path))
        #expect(HashCache.load(besideArchive: old.archivePath).digests.isEmpty)
        damaged[firstDigest + 10] = UInt8(ascii: "A")
        try Data(damaged).write(to: URL(fileURLWithPath: path))
        #expect(HashCache.load(besideArchive: old.archivePath).digests.isEmpty)
        try intact.write(to: URL(fileURLWithPath: path))
        #expect(HashCache.load(besideArchive: old.archivePath).digests.count == 16)
    }

    @Test("sample measurements come from the cache while the files sampled are unchanged, and are measured again once one changes")
    func sampleCache() throws {
        let tmp = try TemporaryFolder()
        let (v1, old) = try packVersion1WithCache(tmp)
        var cache = HashCache.load(besideArchive: old.archivePath)
        // The two files of 2 MiB or more judged, and a sample of the kinds with enough bytes to
        // judge by (the log and the small media; the levels and the README have under 4 KiB).
        #expect(cache.samples.count == 4)

        // The cache is made to say that the noise is worth deflating.
        let noise = v1 + "/media/noise.bin"
        let next = try options("1.1", tmp.sub("inc"), previous: old.archivePath)
        let sampling = Plan.Sampling(level: next.level, encoder: next.chunking.encoder, identities: [noise: try #require(FileIdentity.of(noise))], known: nil)
        let key = try #require(sampling.key("compressible", level: 1, files: [(noise, ArchivePacker.sampleSize)]))
        #expect(cache.sample(key) == "0")
        cache.insertSample(key, value: "1")
        cache.write(besideArchive: old.archivePath, now: Date().addingTimeInterval(10))
        func noiseMethod() throws -> Plan.Method? {
            let content = try ContentScanner.scan(folder: v1, productId: next.productId, contentVersion: next.contentVersion)
            let previous = Background { () throws(ArchiveError) in try PreviousBuild.load(old.archivePath) }
            return try Plan(content: content, options: next, previous: previous).entries.first { $0.path == "Contents/media/noise.bin" }?.method
        }
        // Taken at its word while the file is as it was sampled...
        #expect(try noiseMethod() == .deflate)
        // ...and not once it has been written again, even with the same bytes.
        try Data(contentsOf: URL(fileURLWithPath: noise)).write(to: URL(fileURLWithPath: noise))
        #expect(try noiseMethod() == .stored)
    }

    @Test("the chunk hashes iap-pack writes are the ones computed from the archive alone")
    func chunkHashesAgree() throws {
        let tmp = try TemporaryFolder()
        let result = try ArchivePacker.pack(folder: try makeVersion1(tmp), options: try options("1.0", tmp.sub("out")))
        let computed = try ArchiveVerifier.computeManifest(archive: result.archivePath)
        #expect(computed.entries == result.manifest.entries.map(\.derivable))
        let log = try #require(result.manifest.entries.first { $0.path == "Contents/logs/big.log" })
        #expect(log.chunks?.count == Int((log.compressedSize + (1 << 20) - 1) >> 20))
        #expect(result.manifest.formatVersion == 2)
        #expect(result.manifest.encoder?.hasPrefix("libdeflate ") == true)
        // Python recomputes every chunk hash from the archive's bytes at the manifest's offsets.
        let check = try run(
            "python3",
            [
                "-c",
                """
                import hashlib, json, sys, zlib
                m = json.load(open(sys.argv[1])); data = open(sys.argv[2], 'rb').read(); n = m['chunkSize']
                for e in m['entries']:
                    raw = data[e['dataOffset']:e['dataOffset'] + e['compressedSize']]
                    assert e['chunks'] == [hashlib.sha256(raw[i:i + n]).hexdigest() for i in range(0, len(raw), n)], e['path']
                    assert e['storedCRC32'] == zlib.crc32(raw), e['path']
                print('ok')
                """, result.manifestPath, result.archivePath,
            ])
        #expect(check.stdout == "ok\n", "\(check.stderr)")
    }

    @Test("a previous archive that does not match its manifest is refused; nothing is written")
    func damagedPrevious() throws {
        let tmp = try TemporaryFolder()
        let v1 = try makeVersion1(tmp)
        let old = try ArchivePacker.pack(folder: v1, options: try options("1.0", tmp.sub("old")))
        let noise = try #require(old.manifest.entries.first { $0.path == "Contents/media/noise.bin" })
        // Flip one byte inside a reused entry.
        try flipByte(old.archivePath, at: noise.dataOffset + 1000)
        let out = tmp.sub("new")
        #expect {
            try ArchivePacker.pack(folder: v1, options: try options("1.1", out, previous: old.archivePath))
        } throws: { error in
            (error as? ArchiveError)?.message.contains("does not match its manifest at 'Contents/media/noise.bin'") == true
        }
        #expect(((try? FileManager.default.contentsOfDirectory(atPath: out)) ?? []).isEmpty)

        // A deflated entry is checked by the CRC-32 of its compressed bytes; with a manifest
        // written before that was recorded, by its chunk hashes. Both refuse a flipped byte.
        let log = try #require(old.manifest.entries.first { $0.path == "Contents/logs/big.log" })
        #expect(log.method == .deflate && log.storedCRC32 != nil)
        try flipByte(old.archivePath, at: noise.dataOffset + 1000)
        try flipByte(old.archivePath, at: log.dataOffset + log.compressedSize / 2)
        var withoutCRC = old.manifest
        for i in withoutCRC.entries.indices { withoutCRC.entries[i].storedCRC32 = nil }
        for manifest in [old.manifest, withoutCRC] {
            try manifest.jsonData().write(to: URL(fileURLWithPath: old.manifestPath))
            #expect {
                try ArchivePacker.pack(folder: v1, options: try options("1.1", out, previous: old.archivePath))
            } throws: { error in
                (error as? ArchiveError)?.message.contains("does not match its manifest at 'Contents/logs/big.log'") == true
            }
            #expect(((try? FileManager.default.contentsOfDirectory(atPath: out)) ?? []).isEmpty)
        }

        // A manifest placing an entry past the archive's end is refused before anything is read.
        var lying = old.manifest
        let last = try #require(lying.entries.lastIndex { $0.compressedSize > 1 })
        lying.entries[last].dataOffset = lying.archiveSize - 1
        try lying.jsonData().write(to: URL(fileURLWithPath: old.manifestPath))
        #expect {
            try ArchivePacker.pack(folder: v1, options: try options("1.1", out, previous: old.archivePath))
        } throws: { error in
            (error as? ArchiveError)?.message.contains("outside the \(old.manifest.archiveSize) bytes") == true
        }

        // A missing manifest is named, with what to pass instead.
        try FileManager.default.removeItem(atPath: old.manifestPath)
        let cli = try iapPack(["build", v1, "--product-id", "com.example.delta", "--content-version", "1.2", "-o", out, "--previous", old.archivePath])
        #expect(cli.status == 1)
        #expect(cli.stderr.contains("has no manifest beside it"))

        // A previous build that is not there is named as that, not as a missing manifest.
        let missing = try iapPack(["build", v1, "--product-id", "com.example.delta", "--content-version", "1.2", "-o", out, "--previous", old.archivePath + ".gone"])
        #expect(missing.status == 1)
        #expect(missing.stderr.contains("--previous \(old.archivePath).gone does not exist"), "\(missing.stderr)")
    }

    func flipByte(_ path: String, at offset: UInt64) throws {
        let handle = try FileHandle(forUpdating: URL(fileURLWithPath: path))
        defer { try? handle.close() }
        try handle.seek(toOffset: offset)
        let byte = try #require(try handle.read(upToCount: 1)).first!
        try handle.seek(toOffset: offset)
        try handle.write(contentsOf: Data([byte ^ 0xFF]))
    }

    @Test("a previous manifest without stored CRC-32s (an older iap-pack's) still gives a full build's bytes")
    func previousWithoutStoredCRC() throws {
        let tmp = try TemporaryFolder()
        let v1 = try makeVersion1(tmp)
        let v2 = try makeVersion2(tmp, from: v1)
        let old = try ArchivePacker.pack(folder: v1, options: try options("1.0", tmp.sub("old")))
        var older = old.manifest
        for i in older.entries.indices { older.entries[i].storedCRC32 = nil }
        try older.jsonData().write(to: URL(fileURLWithPath: old.manifestPath))
        let full = try ArchivePacker.pack(folder: v2, options: try options("1.1", tmp.sub("full")))
        let incremental = try ArchivePacker.pack(folder: v2, options: try options("1.1", tmp.sub("incremental"), previous: old.archivePath))
        #expect(incremental.reusedEntries == 15)
        #expect(FileManager.default.contents(atPath: full.archivePath) == FileManager.default.contents(atPath: incremental.archivePath))
        #expect(FileManager.default.contents(atPath: full.manifestPath) == FileManager.default.contents(atPath: incremental.manifestPath))
        // The verifier accepts the older manifest for the old archive, and the new one for the new.
        #expect(throws: Never.self) { try ArchiveVerifier.verify(archive: old.archivePath) }
        #expect(throws: Never.self) { try ArchiveVerifier.verify(archive: incremental.archivePath) }
    }

    @Test("the hand-written manifest JSON is byte for byte what JSONEncoder writes")
    func canonicalJSONMatchesEncoder() throws {
        let tmp = try TemporaryFolder()
        let packed = try ArchivePacker.pack(folder: try makeVersion1(tmp), options: try options("1.0", tmp.sub("out"))).manifest
        var bare = packed
        bare.formatVersion = 1
        bare.chunkSize = nil
        bare.encoder = nil
        for i in bare.entries.indices {
            bare.entries[i].chunks = i % 2 == 0 ? nil : []
            bare.entries[i].level = nil
            bare.entries[i].storedCRC32 = nil
        }
        var odd = packed
        let names = ["a\"quote\\back/slash", "tab\tnew\nline\r\u{8}\u{c}", "ctl\u{1}\u{1f}\u{7f}", "é 漢字 😀 \u{2028}\u{FEFF}", ""]
        for (i, name) in names.enumerated() { odd.entries[i].path = name }
        odd.createdAt = "2024-02-29T23:59:59Z"
        odd.entries[0].crc32 = .max
        odd.entries[0].uncompressedSize = .max
        var empty = packed
        empty.entries = []
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        for manifest in [packed, bare, odd, empty] {
            let expected = try encoder.encode(manifest) + Data("\n".utf8)
            #expect(manifest.jsonData() == expected, "\(String(decoding: manifest.jsonData().prefix(600), as: UTF8.self))")
            #expect(try JSONDecoder().decode(ArchiveManifest.self, from: manifest.jsonData()) == manifest)
        }
    }

    @Test("the manifest reader gives what JSONDecoder gives, whatever the layout, and leaves what it does not expect to JSONDecoder")
    func manifestReaderMatchesDecoder() throws {
        let tmp = try TemporaryFolder()
        let packed = try ArchivePacker.pack(folder: try makeVersion1(tmp), options: try options("1.0", tmp.sub("out"))).manifest
        var odd = packed
        let names = ["a\"quote\\back/slash", "tab\tnew\nline\r\u{8}\u{c}", "ctl\u{1}\u{1f}\u{7f}", "é 漢字 😀 \u{2028}\u{FEFF}", ""]
        for (i, name) in names.enumerated() { odd.entries[i].path = name }
        odd.entries[0].level = nil
        odd.entries[1].chunks = nil
        odd.entries[2].storedCRC32 = nil
        odd.encoder = nil
        let compact = JSONEncoder()
        for manifest in [packed, odd] {
            for data in [manifest.jsonData(), try compact.encode(manifest)] {
                #expect(data.withUnsafeBytes(ManifestReader.read) == manifest)
            }
        }
        // Keys in another order, escapes JSONEncoder does not write, unknown keys of every kind,
        // explicit nulls for optional fields: the same result as JSONDecoder.
        let handWritten = #"""
            { "unknown": {"a": [1, -2.5e3, true, false, null, "x\"y"]}, "entries": [ { "uncompressedSize": 3, "storedCRC32": null,
              "sha256": "s", "path": "Contents\/\u00e9\ud83d\ude00\u0041", "method": "stored", "localHeaderOffset": 0, "level": -1,
              "kind": "file", "extra": [], "dataOffset": 40, "crc32": 4294967295, "compressedSize": 3, "chunks": [] } ],
              "productId": "com.example.x", "formatVersion": 1, "createdAt": "c", "contentVersion": "1.2", "contentLength": 3,
              "chunkSize": null, "archiveSize": 100, "archiveSHA256": "h", "archiveName": "n" }
            """#
        let decoded = try JSONDecoder().decode(ArchiveManifest.self, from: Data(handWritten.utf8))
        #expect(Data(handWritten.utf8).withUnsafeBytes(ManifestReader.read) == decoded)
        #expect(decoded.entries[0].path == "Contents/é😀A")
        // What it does not take, it leaves to JSONDecoder (nil), which explains the problem.
        let refused = [
            handWritten.replacingOccurrences(of: #""crc32": 4294967295"#, with: #""crc32": 4294967296"#),
            handWritten.replacingOccurrences(of: #""archiveSize": 100"#, with: #""archiveSize": 1e2"#),
            handWritten.replacingOccurrences(of: #""archiveSize": 100"#, with: #""archiveSize": -100"#),
            handWritten.replacingOccurrences(of: #""archiveName": "n""#, with: #""archiveName": null"#),
            handWritten.replacingOccurrences(of: #""archiveName": "n""#, with: #""archiveNam": "n""#),
            handWritten.replacingOccurrences(of: #"\ud83d\ude00"#, with: #"\ud83d"#),
            handWritten.replacingOccurrences(of: #""productId": "com.example.x""#, with: #""productId": "not an id""#),
            handWritten.replacingOccurrences(of: "-2.5e3", with: "-"),
            handWritten.replacingOccurrences(of: "-2.5e3", with: "01"),
            handWritten.replacingOccurrences(of: "-2.5e3", with: "2.e3"),
            handWritten.replacingOccurrences(of: "-2.5e3", with: "2e+"),
            handWritten + "x", String(handWritten.dropLast(3)), "",
        ]
        for text in refused {
            #expect(Data(text.utf8).withUnsafeBytes(ManifestReader.read) == nil, "\(text.suffix(80))")
        }
        // Unknown keys' numbers in every form JSON allows are skipped.
        for number in ["0", "-0", "12", "-1.5", "3e7", "4.25E-2", "1e+2"] {
            let text = handWritten.replacingOccurrences(of: "-2.5e3", with: number)
            #expect(Data(text.utf8).withUnsafeBytes(ManifestReader.read) == decoded, "\(number)")
        }
    }

    @Test("manifests with the wrong number of chunk hashes or an unknown format are refused")
    func hostileManifests() throws {
        let tmp = try TemporaryFolder()
        let result = try ArchivePacker.pack(folder: try makeVersion1(tmp), options: try options("1.0", tmp.sub("out")))
        var shortened = result.manifest
        shortened.entries[shortened.entries.count - 1].chunks = []
        #expect(throws: ArchiveError.self) { try ArchiveManifest.decode(shortened.jsonData(), source: "m") }
        var future = result.manifest
        future.formatVersion = 3
        #expect(throws: ArchiveError.self) { try ArchiveManifest.decode(future.jsonData(), source: "m") }
        var v1 = result.manifest
        v1.formatVersion = 1
        v1.chunkSize = nil
        for i in v1.entries.indices { v1.entries[i].chunks = nil }
        #expect(try ArchiveManifest.decode(v1.jsonData(), source: "m") == v1)
    }

    /// Found by `tools/fuzz.sh manifest`: the reader kept the last of a key given twice where
    /// `JSONDecoder` kept the first, and sizes near 2^64 trapped in the sums made of them.
    @Test("a manifest giving a key twice, nesting without end or claiming 64-bit sizes is refused with a message, not a crash")
    func forgedManifests() throws {
        let tmp = try TemporaryFolder()
        let manifest = try ArchivePacker.pack(folder: try makeVersion1(tmp), options: try options("1.0", tmp.sub("out"))).manifest
        func refusal(_ text: String) -> String? {
            do {
                _ = try ArchiveManifest.decode(Data(text.utf8), source: "m.json")
                return nil
            } catch {
                return error.message
            }
        }
        let json = String(decoding: manifest.jsonData(), as: UTF8.self)
        let path = manifest.entries[1].path
        let doubled = json.replacingOccurrences(of: #""path" : "\#(path)""#, with: #""path" : "Contents/other", "path" : "\#(path)""#)
        #expect(doubled != json)
        #expect(refusal(doubled)?.contains(#"gives "path" twice in one object"#) == true)
        #expect(refusal(json.replacingOccurrences(of: #""chunkSize""#, with: #""chunkSize" : null, "chunkSize""#))?.contains("twice") == true)

        let deep = "{\"unknown\": " + String(repeating: "[", count: 200_000) + String(repeating: "]", count: 200_000) + ", " + json.dropFirst()
        #expect(refusal(deep)?.contains("not a valid archive manifest") == true)
        // What is wrong is said in words, with the field's path, not as Foundation's structure.
        #expect(refusal("not json")?.contains("(it is not valid JSON") == true, "\(refusal("not json") ?? "")")
        let wrongType = json.replacingOccurrences(of: #""archiveSize" : "#, with: #""archiveSize" : "x", "ignored" : "#)
        #expect(wrongType != json)
        #expect(refusal(wrongType)?.contains("(field archiveSize is not a whole number)") == true, "\(refusal(wrongType) ?? "")")
        // Within the limit, unknown nested values are still skipped.
        let shallow = "{\"unknown\": " + String(repeating: "[", count: 20) + String(repeating: "]", count: 20) + ", " + json.dropFirst()
        #expect(refusal(shallow) == nil)

        for (field, value) in [("compressedSize", UInt64.max), ("dataOffset", UInt64.max - 10), ("uncompressedSize", UInt64.max)] {
            var forged = manifest
            let last = forged.entries.count - 1
            switch field {
            case "compressedSize": forged.entries[last].compressedSize = value
            case "dataOffset": forged.entries[last].dataOffset = value
            default: forged.entries[last].uncompressedSize = value
            }
            #expect(refusal(String(decoding: forged.jsonData(), as: UTF8.self))?.contains("outside its") == true, "\(field)")
            // A manifest made in code rather than decoded reaches the reader's own checks.
            let partial = try tmp.write("partial-\(field).zip", Data())
            #expect(throws: ArchiveError.self, "\(field)") { try ArchiveReader(path: partial, manifest: forged) }
        }
        var huge = manifest
        huge.archiveSize = UInt64.max
        #expect(refusal(String(decoding: huge.jsonData(), as: UTF8.self))?.contains("under 4 GiB") == true)
    }
}

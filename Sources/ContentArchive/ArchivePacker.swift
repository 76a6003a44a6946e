import DurableFiles
import Crypto
import Foundation
import Synchronization
import SystemPackage
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Size limits of the format.
public enum ArchiveLimits {
    /// 2 GiB: the most a product's archive may weigh, as Apple's hosted content allowed
    /// (read as 2,147,483,648 bytes).
    public static let maxArchiveSize: UInt64 = 2_147_483_648
}

/// How to pack a content folder.
public struct PackOptions: Sendable {
    /// Required for a plain folder; optional (and checked) for an Xcode content folder.
    public var productId: ProductIdentifier?
    public var contentVersion: ContentVersion?
    /// Where the archive and manifest go; created if missing.
    public var outputDirectory: String
    /// 0 stores every entry. 1 to 9 aim at `zip -<level>`'s size for the whole archive at the
    /// least CPU: each kind of file (extension) gets a libdeflate level from 1 to `level`, chosen
    /// from samples so that the kinds together come out no larger than zlib at `level` would
    /// make them (``LevelBudget``). 10 to 12 are libdeflate's slow near-optimal levels.
    public var level: Int
    /// The largest archive allowed, in bytes.
    public var sizeCap: UInt64
    public var timestamp: ArchiveTimestamp
    /// Compression threads; the output does not depend on it.
    public var threads: Int
    /// How files are cut into pieces of work (tests make the pieces small).
    var chunking = Chunking.standard

    public init(productId: ProductIdentifier? = nil, contentVersion: ContentVersion? = nil,
                outputDirectory: String = ".", level: Int = 6,
                sizeCap: UInt64 = ArchiveLimits.maxArchiveSize, timestamp: ArchiveTimestamp = .standard,
                threads: Int = ProcessInfo.processInfo.activeProcessorCount) {
        self.productId = productId
        self.contentVersion = contentVersion
        self.outputDirectory = outputDirectory
        self.level = level
        self.sizeCap = sizeCap
        self.timestamp = timestamp
        self.threads = threads
    }
}

/// What a pack produced.
public struct PackResult: Sendable {
    public let archivePath: String
    public let manifestPath: String
    public let manifest: ArchiveManifest
}

/// How far a pack has got, in uncompressed bytes.
public struct PackProgress: Sendable {
    public let bytesDone: UInt64
    public let bytesTotal: UInt64
}

/// Builds content archives: a reproducible ZIP with `ContentInfo.plist` and `Contents/`, and its
/// manifest.
///
/// The ZIP writer is our own rather than ZIPFoundation's: packing must keep both cores busy with
/// libdeflate and stay reproducible, which a general-purpose writer does not do (and on Linux
/// ZIPFoundation writes at about 15 MB/s). Files up to 24 MiB are compressed whole, larger ones
/// in 4 MiB chunks compressed in parallel and joined into one DEFLATE stream (``Chunking``); the
/// chunking does not depend on the thread count, so the bytes do not either.
public enum ArchivePacker {
    /// Input bytes the compressors may hold ahead of the writer: enough for them to keep busy
    /// while the writer copies a large stored file, little enough for memory to stay flat.
    static let windowBytes = 64 << 20
    static let sampleSize = 64 << 10

    /// Packs `folder` into `<output>/<id>-<version>.zip` and its manifest. Nothing is left behind
    /// on failure: the files are written under temporary names and renamed into place at the end.
    public static func pack(folder: String, options: PackOptions,
                            progress: (@Sendable (PackProgress) -> Void)? = nil) throws(ArchiveError) -> PackResult {
        guard (0...12).contains(options.level) else {
            throw .invalid("compression level \(options.level) is out of range: use 0 (store) to 12 (smallest); 6 is the default")
        }
        let content = try ContentScanner.scan(folder: folder, productId: options.productId, contentVersion: options.contentVersion)
        let plan = Plan(content: content, options: options)
        try plan.checkFits(cap: options.sizeCap, level: options.level)
        try makeDirectories(options.outputDirectory)

        let archiveName = ArchiveManifest.archiveName(productId: content.info.productIdentifier, version: content.info.contentVersion)
        let manifestName = ArchiveManifest.manifestName(productId: content.info.productIdentifier, version: content.info.contentVersion)
        let archivePath = options.outputDirectory + "/" + archiveName
        let manifestPath = options.outputDirectory + "/" + manifestName
        let suffix = ".partial-\(getpid())"
        let archiveTemp = options.outputDirectory + "/." + archiveName + suffix
        let manifestTemp = options.outputDirectory + "/." + manifestName + suffix

        let writer = try BufferedFileWriter(creating: archiveTemp, direct: true)
        var manifestWriter: BufferedFileWriter?
        do throws(ArchiveError) {
            let (entries, size, digest) = try write(plan: plan, to: writer, options: options, progress: progress)
            try writer.finish()
            let manifest = ArchiveManifest(
                formatVersion: ArchiveManifest.currentFormatVersion,
                productId: content.info.productIdentifier, contentVersion: content.info.contentVersion,
                archiveName: archiveName, archiveSize: size, archiveSHA256: digest,
                contentLength: entries.reduce(0) { $0 + $1.uncompressedSize },
                createdAt: options.timestamp.iso8601, entries: entries)
            let mw = try BufferedFileWriter(creating: manifestTemp)
            manifestWriter = mw
            try mw.write(Array(manifest.jsonData()))
            try mw.finish()
            guard rename(archiveTemp, archivePath) == 0 else { throw ioError(errno, action: "rename into", path: archivePath) }
            guard rename(manifestTemp, manifestPath) == 0 else {
                let error = ioError(errno, action: "rename into", path: manifestPath)
                unlink(archivePath)
                throw error
            }
            try syncDirectory(options.outputDirectory)
            return PackResult(archivePath: archivePath, manifestPath: manifestPath, manifest: manifest)
        } catch {
            writer.abandon()
            manifestWriter?.abandon()
            throw error
        }
    }

    /// Streams the planned entries through the compressors into `writer`; returns the manifest
    /// entries and the archive's size and SHA-256. Throws `capExceeded`, with the final size, when
    /// the archive ends over the cap.
    private static func write(plan: Plan, to writer: BufferedFileWriter, options: PackOptions,
                              progress: (@Sendable (PackProgress) -> Void)?) throws(ArchiveError) -> ([ArchiveManifest.Entry], UInt64, String) {
        let pipeline = OrderedPipeline(units: plan.units, entries: plan.entries, level: options.level,
                                       threads: max(1, options.threads), windowBytes: windowBytes)
        pipeline.start()
        defer { pipeline.stop() }

        let dos = options.timestamp.dos
        var manifestEntries: [ArchiveManifest.Entry] = []
        var centralDirectory: [UInt8] = []
        var overCap = false
        var size: UInt64 = 0
        var bytesDone: UInt64 = 0

        var header = ZipEntryHeader(name: [], method: 0, crc32: 0, compressedSize: 0, uncompressedSize: 0,
                                    mode: 0, localHeaderOffset: 0, dosTime: dos.time, dosDate: dos.date)
        // A multi-chunk entry's CRC-32 and SHA-256 run across its chunks, on a thread of their own.
        var contentHasher: BackgroundHasher?
        var compressedSize: UInt64 = 0
        // The archive is hashed as it is written, from memory, except a multi-chunk entry: its
        // header is patched once its last chunk is in, so it is read back from the file and
        // hashed then. Hashing the whole file at the end instead left one core idle. Bytes are
        // hashed only while nothing before them is waiting, so leaving out a header leaves out
        // its entry.
        let archiveHasher = BackgroundHasher(label: "iap-pack.archive-hash")
        var archiveHashed: UInt64 = 0

        // Bytes are still counted once the cap is passed, so the error can say by how much.
        func emit(_ bytes: [UInt8], hash: Bool = true) throws(ArchiveError) {
            if hash && archiveHashed == size {
                archiveHasher.update(bytes)
                archiveHashed += UInt64(bytes.count)
            }
            size += UInt64(bytes.count)
            if !overCap && size > options.sizeCap {
                overCap = true
                writer.abandon()
            }
            if !overCap { try writer.write(bytes) }
        }

        for index in plan.units.indices {
            let unit = plan.units[index]
            let entry = plan.entries[unit.entry]
            let result = try pipeline.result(at: index)
            let data = result.compressed ?? result.raw
            // A single-chunk entry arrives hashed by its worker.
            let digest = unit.chunk == 0 && unit.isLast ? result.digest ?? UnitResult.digest(of: result.raw) : nil
            if unit.chunk == 0 {
                header.name = Array(entry.path.utf8)
                header.method = result.compressed == nil ? Zip.methodStored : Zip.methodDeflate
                header.mode = entry.isDirectory ? Zip.directoryMode : Zip.fileMode
                header.localHeaderOffset = UInt32(size)
                header.crc32 = 0
                header.compressedSize = 0
                header.uncompressedSize = UInt32(entry.size)
                if let digest {
                    header.crc32 = digest.crc32
                    header.compressedSize = UInt32(data.count)
                }
                contentHasher = digest == nil ? BackgroundHasher(label: "iap-pack.entry-hash", checksums: true) : nil
                compressedSize = 0
                try emit(header.localHeader, hash: unit.isLast)
            }
            contentHasher?.update(result.raw)
            compressedSize += UInt64(data.count)
            try emit(data)
            bytesDone += UInt64(unit.length)
            if unit.isLast {
                guard compressedSize <= UInt64(Zip.maxEntrySize) else {
                    throw .invalid("\(entry.path) compresses to more than 4 GiB, which a ZIP entry without ZIP64 cannot hold: split it")
                }
                header.compressedSize = UInt32(compressedSize)
                var sha256 = digest?.sha256 ?? ""
                if let contentHasher {
                    (sha256, header.crc32) = try contentHasher.finalize()
                }
                if unit.chunk > 0 && !overCap {
                    // Sizes and CRC of a multi-chunk entry are known only now: fill them in.
                    var patch = LittleEndianWriter(capacity: 12)
                    patch.u32(header.crc32)
                    patch.u32(header.compressedSize)
                    patch.u32(header.uncompressedSize)
                    // The patch flushed everything before it: the file holds the whole entry.
                    try writer.patch(at: UInt64(header.localHeaderOffset) + 14, patch.bytes)
                    archiveHasher.update(file: writer.path, from: archiveHashed, to: size)
                    archiveHashed = size
                }
                centralDirectory += header.centralHeader
                let offset = UInt64(header.localHeaderOffset)
                manifestEntries.append(.init(
                    path: entry.path, kind: entry.isDirectory ? .directory : .file,
                    method: header.method == Zip.methodDeflate ? .deflate : .stored,
                    uncompressedSize: entry.size, compressedSize: compressedSize, crc32: header.crc32,
                    sha256: sha256,
                    localHeaderOffset: offset, dataOffset: offset + UInt64(Zip.localHeaderSize + header.name.count)))
                progress?(PackProgress(bytesDone: bytesDone, bytesTotal: plan.totalBytes))
            }
        }
        let centralOffset = size
        try emit(centralDirectory)
        try emit(ZipEntryHeader.endRecord(entryCount: plan.entries.count, centralSize: UInt32(centralDirectory.count),
                                          centralOffset: UInt32(truncatingIfNeeded: centralOffset)))
        if overCap {
            throw .init(.capExceeded, "the archive for \(plan.productId) would be \(size) bytes, \(size - options.sizeCap) bytes over the cap of \(options.sizeCap) bytes (\(formatBytes(options.sizeCap))); nothing was written. Move some content to another product, or remove or shrink files")
        }
        guard archiveHashed == size else {
            throw .io("internal error: \(archiveHashed) of \(size) archive bytes were hashed; please report this")
        }
        return (manifestEntries, size, try archiveHasher.finalize().sha256)
    }

    /// Feeds bytes `start..<end` of a file (to its end when `end` is nil) to `hasher`, 1 MiB at a
    /// time; returns where it stopped.
    @discardableResult
    static func hash(_ path: String, from start: UInt64 = 0, to end: UInt64? = nil, into hasher: inout SHA256) throws(ArchiveError) -> UInt64 {
        let fd = try openFile(path)
        defer { try? fd.close() }
        var offset = start
        while offset < end ?? .max {
            let chunk = try readFully(fd, at: offset, count: Int(min(1 << 20, (end ?? .max) - offset)), path: path)
            if chunk.isEmpty {
                guard end == nil else { throw .io("\(path) is shorter than what was written to it: is something else writing there?") }
                break
            }
            hasher.update(data: chunk)
            offset += UInt64(chunk.count)
        }
        return offset
    }

    /// A file's size and SHA-256.
    static func hashFile(_ path: String) throws(ArchiveError) -> (UInt64, String) {
        var hasher = SHA256()
        let size = try hash(path, into: &hasher)
        return (size, Hex.encode(hasher.finalize()))
    }
}

func formatBytes(_ bytes: UInt64) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB"]
    var value = Double(bytes)
    var unit = 0
    while value >= 1024 && unit < units.count - 1 {
        value /= 1024
        unit += 1
    }
    return unit == 0 ? "\(bytes) bytes" : String(format: "%.2f", value) + " " + units[unit]
}

/// How files are cut into pieces of work.
///
/// A file compressed in chunks costs a walk of each chunk's compressed bytes to join them
/// (``DeflateJoin``), about a tenth of the compression time, so files up to `wholeFileLimit` are
/// compressed in one piece: two files at a time keep both cores busy just as well. Larger files
/// are cut so that memory stays flat and both cores can work on one file.
struct Chunking: Sendable {
    var wholeFileLimit: Int
    var chunkSize: Int

    static let standard = Chunking(wholeFileLimit: 24 << 20, chunkSize: 4 << 20)

    func isMultiChunk(_ size: UInt64) -> Bool { size > UInt64(wholeFileLimit) }
}

/// The entries of an archive in order, and the chunks they are cut into.
struct Plan: Sendable {
    enum Method: Sendable { case stored, deflate, smaller }

    struct Entry: Sendable {
        let path: String
        let size: UInt64
        let source: Source
        let method: Method
        /// The libdeflate level for `deflate` and `smaller`.
        let level: Int
        var isDirectory: Bool { if case .directory = source { true } else { false } }
    }

    enum Source: Sendable {
        case directory
        case bytes([UInt8])
        case file(String)
    }

    struct Unit: Sendable {
        let entry: Int
        let chunk: Int
        let offset: UInt64
        let length: Int
        let isLast: Bool
    }

    let productId: ProductIdentifier
    var entries: [Entry] = []
    var units: [Unit] = []
    var totalBytes: UInt64 = 0

    init(content: ScannedContent, options: PackOptions) {
        productId = content.info.productIdentifier
        let chunking = options.chunking
        var items: [(String, Source, UInt64)] = [(ContentInfo.fileName, .bytes(content.plist), UInt64(content.plist.count))]
        items += content.directories.map { ($0, .directory, 0) }
        items += content.files.map { ($0.archivePath, .file($0.diskPath), $0.size) }
        items.sort { $0.0.utf8.lexicographicallyPrecedes($1.0.utf8) }
        let (compressible, kindLevels) = options.level > 0 ? Self.chooseLevels(items, level: options.level) : ([:], [:])
        for (path, source, size) in items {
            var method: Method = .stored
            var level = options.level
            if options.level > 0, size > 0 {
                if case .directory = source {
                    method = .stored
                } else {
                    level = kindLevels[Self.fileExtension(path)] ?? options.level
                    if compressible[path] == false {
                        method = .stored
                    } else if chunking.isMultiChunk(size) {
                        // Every chunk of a multi-chunk file must use the same method (and a file that
                        // could not be sampled is deflated: its worker reports why it cannot be read).
                        method = .deflate
                    } else {
                        method = .smaller
                    }
                }
            }
            let index = entries.count
            entries.append(Entry(path: path, size: size, source: source, method: method, level: level))
            totalBytes += size
            let piece = chunking.isMultiChunk(size) ? UInt64(chunking.chunkSize) : max(1, size)
            let chunks = max(1, Int((size + piece - 1) / piece))
            for chunk in 0..<chunks {
                let offset = UInt64(chunk) * piece
                units.append(Unit(entry: index, chunk: chunk, offset: offset,
                                  length: Int(min(piece, size - offset)), isLast: chunk == chunks - 1))
            }
        }
    }

    /// Files at least this large are sampled to pick their level; below it, sampling would cost
    /// more than the faster level saves.
    static let sampledSize: UInt64 = 2 << 20

    /// Whether each file of `sampledSize` or more is worth deflating, judged from its first
    /// 64 KiB; and the level for each kind (extension) of file, judged from a sample spread over
    /// the files of that kind: files of one kind compress alike, and one sample per kind costs
    /// little however many files there are. The levels are chosen together (``LevelBudget``),
    /// each kind's sample standing for the bytes of its deflated files.
    private static func chooseLevels(_ items: [(String, Source, UInt64)], level: Int) -> (compressible: [String: Bool], kinds: [String: Int]) {
        let large = items.compactMap { path, source, size -> (path: String, disk: String)? in
            guard case .file(let disk) = source, size >= sampledSize else { return nil }
            return (path, disk)
        }
        let judged = parallelMap(large) { file -> Bool? in
            guard let fd = try? FileDescriptor.open(file.disk, .readOnly) else { return nil }
            defer { try? fd.close() }
            guard let sample = try? readFully(fd, at: 0, count: ArchivePacker.sampleSize, path: file.disk), !sample.isEmpty else { return nil }
            return sample.withUnsafeBytes { DeflateCompressor(level: 1).looksCompressible($0) }
        }
        var compressible: [String: Bool] = [:]
        for (file, verdict) in zip(large, judged) { compressible[file.path] = verdict }

        // Levels 10 to 12 are kept as asked: there is nothing to choose, so nothing to sample.
        guard level <= 9 else { return (compressible, [:]) }
        var kinds: [(name: String, files: [String], bytes: UInt64)] = []
        var kindIndex: [String: Int] = [:]
        for (path, source, size) in items {
            guard case .file(let disk) = source, size > 0, compressible[path] ?? true else { continue }
            let name = fileExtension(path)
            if kindIndex[name] == nil {
                kindIndex[name] = kinds.count
                kinds.append((name, [], 0))
            }
            kinds[kindIndex[name]!].files.append(disk)
            kinds[kindIndex[name]!].bytes += size
        }
        let samples = parallelMap(kinds) { kind in measureSample(of: kind.files, level: level) }
        let measured = zip(kinds, samples).compactMap { kind, sample in sample.map { (name: kind.name, weight: kind.bytes, sample: $0) } }
        let levels = LevelBudget.choose(measured.map { ($0.weight, $0.sample) }, requested: level)
        return (compressible, Dictionary(uniqueKeysWithValues: zip(measured.map(\.name), levels)))
    }

    /// Measures a sample of up to 64 KiB taken from the start of files spread over `files` (a
    /// quarter each from four of them when there are that many). nil when less than 4 KiB could
    /// be read: too little to judge by (and the workers report a file that cannot be read).
    private static func measureSample(of files: [String], level: Int) -> LevelSample? {
        let spread = Set((0..<4).map { $0 * files.count / 4 })
        let order = spread.sorted() + files.indices.filter { !spread.contains($0) }
        let piece = ArchivePacker.sampleSize / min(4, files.count)
        var sample: [UInt8] = []
        for index in order where sample.count < ArchivePacker.sampleSize {
            guard let fd = try? FileDescriptor.open(files[index], .readOnly) else { continue }
            defer { try? fd.close() }
            let count = min(piece, ArchivePacker.sampleSize - sample.count)
            sample += (try? readFully(fd, at: 0, count: count, path: files[index])) ?? []
        }
        guard sample.count >= 4096 else { return nil }
        return sample.withUnsafeBytes { LevelSample(sample: $0, level: level) }
    }

    /// `transform` applied to each element on all cores, in order.
    private static func parallelMap<T: Sendable, R: Sendable>(_ items: [T], _ transform: @Sendable (T) -> R) -> [R] {
        let results = Mutex([R?](repeating: nil, count: items.count))
        DispatchQueue.concurrentPerform(iterations: items.count) { index in
            let result = transform(items[index])
            results.withLock { $0[index] = result }
        }
        return results.withLock { $0.map { $0! } }
    }

    /// The lowercased extension of a path's last component ("" when it has none).
    static func fileExtension(_ path: String) -> String {
        let name = path.split(separator: "/").last ?? ""
        guard let dot = name.lastIndex(of: "."), dot != name.startIndex else { return "" }
        return name[name.index(after: dot)...].lowercased()
    }

    /// Refuses before anything is written when the archive cannot fit under `cap`: exactly when
    /// storing (level 0), and by DEFLATE's best possible ratio (1032:1) otherwise.
    func checkFits(cap: UInt64, level: Int) throws(ArchiveError) {
        var smallest: UInt64 = UInt64(Zip.endRecordSize)
        for entry in entries {
            let overhead = UInt64(Zip.localHeaderSize + Zip.centralHeaderSize + 2 * entry.path.utf8.count)
            let data = level == 0 || entry.method == .stored ? entry.size : (entry.size + 1031) / 1032
            smallest += overhead + data
        }
        guard smallest > cap else { return }
        let what = level == 0 ? "would be \(smallest) bytes" : "would be at least \(smallest) bytes"
        throw .init(.capExceeded, "the archive for \(productId) \(what), \(smallest - cap) bytes over the cap of \(cap) bytes (\(formatBytes(cap))); nothing was written. Move some content to another product, or remove or shrink files")
    }
}

import CLibDeflate
import Crypto
import DurableFiles
import Foundation
import Synchronization
import SystemPackage

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

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

    /// What decides the compressed bytes besides the content and level: the manifest's `encoder`.
    var encoder: String { "libdeflate \(LIBDEFLATE_VERSION_STRING); whole<=\(wholeFileLimit); chunk=\(chunkSize)" }

    func isMultiChunk(_ size: UInt64) -> Bool { size > UInt64(wholeFileLimit) }
}

/// A previous build that `--previous` names: its archive, the manifest iap-pack wrote with it,
/// and the hash cache it left beside the archive.
struct PreviousBuild: Sendable {
    let archive: String
    let manifest: ArchiveManifest
    let hashCache: HashCache

    /// Of manifest names as iap-pack writes them (`<product>-<version>.manifest.json`), the one
    /// of `product` with the highest version below `version`.
    static func newestEarlier(in names: [String], product: ProductIdentifier, version: ContentVersion) -> String? {
        let prefix = product.rawValue + "-"
        var best: (name: String, version: ContentVersion)?
        for name in names where name.hasPrefix(prefix) {
            // A version holds no '-', so what follows the product's prefix is all version.
            guard let found = try? ContentVersion(String(name.dropFirst(prefix.count).dropLast(".manifest.json".count))), found < version else {
                continue
            }
            if best.map({ $0.version < found }) ?? true { best = (name, found) }
        }
        return best?.name
    }

    /// `path` is the archive (its manifest beside it), the manifest (its archive beside it), or
    /// the output folder of that build (a pipeline keeps the last build's folder). A folder
    /// holding several builds gives the newest of `product` older than `version`: a pipeline
    /// that packs every version into one folder names that folder each time.
    static func load(_ path: String, building product: ProductIdentifier? = nil, version: ContentVersion? = nil) throws(ArchiveError) -> PreviousBuild {
        let manifestPath: String
        let archive: String
        let manifest: ArchiveManifest
        guard access(path, F_OK) == 0 else {
            throw .invalid("--previous \(path) does not exist: pass the archive (or manifest) of the build this one updates, or build without --previous")
        }
        if ContentScanner.isDirectory(path) {
            let manifests = try ContentScanner.listDirectory(path).filter { $0.hasSuffix(".manifest.json") && !$0.hasPrefix(".") }.sorted()
            if manifests.count == 1 { return try load(path + "/" + manifests[0]) }
            if let product, let version, let newest = newestEarlier(in: manifests, product: product, version: version) {
                return try load(path + "/" + newest)
            }
            let found = manifests.isEmpty ? "holds no manifest" : "holds \(manifests.count) manifests (\(manifests.joined(separator: ", ")))"
            let wanted = product.flatMap { p in version.map { " and none of \(p) older than \($0)" } } ?? ""
            throw .invalid("--previous \(path) is a folder that \(found)\(wanted): pass the archive or manifest of the build this one updates")
        }
        if path.hasSuffix(".manifest.json") {
            manifestPath = path
            manifest = try ArchiveManifest.load(path: path)
            archive = URL(fileURLWithPath: path).deletingLastPathComponent().path + "/" + manifest.archiveName
        } else {
            manifestPath = ArchiveVerifier.manifestBeside(path)
            guard access(manifestPath, F_OK) == 0 else {
                throw .invalid("--previous \(path) has no manifest beside it (\(manifestPath)): pass the archive together with the manifest iap-pack wrote for it")
            }
            manifest = try ArchiveManifest.load(path: manifestPath)
            archive = path
        }
        var info = stat()
        guard stat(archive, &info) == 0 else {
            throw .invalid("--previous: the archive \(archive) that \(manifestPath) describes is missing: keep the previous archive beside its manifest")
        }
        guard UInt64(info.st_size) == manifest.archiveSize else {
            throw .invalid("--previous: \(archive) is \(info.st_size) bytes but \(manifestPath) says \(manifest.archiveSize): they are not from the same build")
        }
        #if os(Linux)
            // Most of the previous archive is about to be copied. When it is not in the page cache
            // (restored from a pipeline's cache, or evicted since it was built), the disk starts
            // reading it now, while the folder is scanned, rather than page by page during the copy.
            let readahead = open(archive, O_RDONLY)
            if readahead >= 0 {
                _ = posix_fadvise(readahead, 0, 0, POSIX_FADV_WILLNEED)
                close(readahead)
            }
        #endif
        // Reused bytes are mapped from the archive, so every range must lie inside it.
        if let outside = manifest.entries.first(where: { $0.localHeaderOffset > $0.dataOffset || $0.dataOffset > manifest.archiveSize || $0.compressedSize > manifest.archiveSize - $0.dataOffset }) {
            throw .corrupt(
                "--previous: \(manifestPath) places '\(outside.path)' outside the \(manifest.archiveSize) bytes of \(archive): it is not the manifest of that archive; pass the archive and manifest of one build, or build without --previous"
            )
        }
        return PreviousBuild(archive: archive, manifest: manifest, hashCache: HashCache.load(besideArchive: archive))
    }
}

/// A value computed on a thread of its own while the caller does something else.
final class Background<Value: Sendable>: @unchecked Sendable {
    private let done = DispatchSemaphore(value: 0)
    /// Written once by the worker before `done` is signalled; read after waiting for it.
    private var result: Result<Value, ArchiveError>?

    init(_ work: @escaping @Sendable () throws(ArchiveError) -> Value) {
        let thread = Thread { [self] in
            do throws(ArchiveError) { result = .success(try work()) } catch { result = .failure(error) }
            done.signal()
        }
        thread.start()
    }

    /// Waits for the value (any number of times).
    func value() throws(ArchiveError) -> Value {
        done.wait()
        done.signal()
        return try result!.get()
    }
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
        var isReused: Bool { if case .previous = source { true } else { false } }
    }

    enum Source: Sendable {
        case directory
        case bytes([UInt8])
        case file(String)
        /// The same bytes, already compressed as this build would, in the previous archive.
        case previous(archive: String, entry: ArchiveManifest.Entry, disk: String)
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
    /// Each content file's identity when planned (by disk path), for the next build's ``HashCache``.
    var identities: [String: FileIdentity] = [:]
    /// The sample measurements the levels were chosen from, for the next build's ``HashCache``.
    var samples: [(key: SampleKey, value: String)] = []

    /// `previous`, when given, is waited for once the folder is scanned (its hash cache may hold
    /// the samples' measurements).
    init(content: ScannedContent, options: PackOptions, previous: Background<PreviousBuild>? = nil) throws(ArchiveError) {
        productId = content.info.productIdentifier
        let chunking = options.chunking
        var items: [(String, Source, UInt64)] = [(ContentInfo.fileName, .bytes(content.plist), UInt64(content.plist.count))]
        items += content.directories.map { ($0, .directory, 0) }
        items += content.files.map { ($0.archivePath, .file($0.diskPath), $0.size) }
        items.sort { $0.0.utf8.lexicographicallyPrecedes($1.0.utf8) }
        // Taken by the scan, before any file is read: a file changed while it is packed then
        // shows a new identity to the next build, which hashes it again.
        for file in content.files { identities[file.diskPath] = file.identity }
        let previousBuild = try previous?.value()
        var compressible: [String: Bool] = [:]
        var kindLevels: [String: Int] = [:]
        if options.level > 0 {
            let sampling = Sampling(level: options.level, encoder: chunking.encoder, identities: identities, known: previousBuild?.hashCache)
            (compressible, kindLevels, samples) = Self.chooseLevels(items, sampling: sampling)
        }
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
            entries.append(Entry(path: path, size: size, source: source, method: method, level: level))
            totalBytes += size
        }
        if let previous = previousBuild, previous.manifest.encoder == chunking.encoder {
            reuse(previous)
        }
        for index in entries.indices {
            let entry = entries[index]
            // A reused entry is one unit: the writer copies its bytes from the previous archive.
            let size = entry.size
            let piece = chunking.isMultiChunk(size) && !entry.isReused ? UInt64(chunking.chunkSize) : max(1, size)
            let chunks = max(1, Int((size + piece - 1) / piece))
            for chunk in 0..<chunks {
                let offset = UInt64(chunk) * piece
                units.append(
                    Unit(
                        entry: index, chunk: chunk, offset: offset,
                        length: Int(min(piece, size - offset)), isLast: chunk == chunks - 1))
            }
        }
    }

    /// Points every file whose bytes, size, level and method match an entry of the previous
    /// build at that entry's compressed bytes. Only files that have a candidate of their size
    /// are hashed (on all cores); a file that cannot be read is left to the workers, which
    /// report it.
    private mutating func reuse(_ previous: PreviousBuild) {
        // Indices into the previous entries rather than copies of them: copying thousands of
        // entries (strings and chunk lists) into candidate lists cost more than matching them.
        let olds = previous.manifest.entries
        var bySize: [UInt64: [Int]] = [:]
        for (index, old) in olds.enumerated() where old.kind == .file && old.level != nil && old.chunks != nil && old.uncompressedSize > 0 {
            bySize[old.uncompressedSize, default: []].append(index)
        }
        let candidates = entries.indices.compactMap { index -> (index: Int, disk: String, olds: [Int])? in
            let entry = entries[index]
            guard case .file(let disk) = entry.source, let sameSize = bySize[entry.size] else { return nil }
            let matching = sameSize.filter { oldIndex in
                let old = olds[oldIndex]
                guard old.level == entry.level else { return false }
                switch entry.method {
                case .stored: return old.method == .stored
                case .deflate: return old.method == .deflate
                case .smaller: return true
                }
            }
            return matching.isEmpty ? nil : (index, disk, matching)
        }
        // Files the previous build read and that have not changed since need no hashing.
        let cache = previous.hashCache
        let identities = identities
        let digests = Self.parallelMap(candidates) { candidate in
            cache.digest(of: candidate.disk, identity: identities[candidate.disk]) ?? (try? ArchivePacker.hashFile(candidate.disk).1)
        }
        for (candidate, digest) in zip(candidates, digests) {
            guard let digest, let old = candidate.olds.first(where: { olds[$0].sha256 == digest }) else { continue }
            let entry = entries[candidate.index]
            entries[candidate.index] = Entry(
                path: entry.path, size: entry.size, source: .previous(archive: previous.archive, entry: olds[old], disk: candidate.disk),
                method: entry.method, level: entry.level)
        }
    }

    /// Files at least this large are sampled to pick their level; below it, sampling would cost
    /// more than the faster level saves.
    static let sampledSize: UInt64 = 2 << 20

    /// What sampling needs beyond the files: the level asked, and the measurements a previous
    /// build recorded for files that have not changed since (``SampleKey``).
    struct Sampling: Sendable {
        let level: Int
        let encoder: String
        let identities: [String: FileIdentity]
        let known: HashCache?

        /// The key of a measurement of `taken` bytes from each of `files` (nil when one of them
        /// was not scanned, which cannot be told from its identity).
        func key(_ what: String, level: Int, files: [(disk: String, taken: Int)]) -> SampleKey? {
            var key = SampleKey(what, level: level, encoder: encoder)
            for file in files {
                guard let identity = identities[file.disk] else { return nil }
                key.add(file: file.disk, identity: identity, taken: file.taken)
            }
            return key
        }
    }

    /// Whether each file of `sampledSize` or more is worth deflating, judged from its first
    /// 64 KiB; and the level for each kind (extension) of file, judged from a sample spread over
    /// the files of that kind: files of one kind compress alike, and one sample per kind costs
    /// little however many files there are. The levels are chosen together (``LevelBudget``),
    /// each kind's sample standing for the bytes of its deflated files.
    private static func chooseLevels(
        _ items: [(String, Source, UInt64)], sampling: Sampling
    ) -> (compressible: [String: Bool], kinds: [String: Int], samples: [(key: SampleKey, value: String)]) {
        let level = sampling.level
        let large = items.compactMap { path, source, size -> (path: String, disk: String, size: UInt64)? in
            guard case .file(let disk) = source, size >= sampledSize else { return nil }
            return (path, disk, size)
        }
        let judged = parallelMap(large) { file -> (verdict: Bool?, key: SampleKey?) in
            let key = sampling.key("compressible", level: 1, files: [(file.disk, Int(min(file.size, UInt64(ArchivePacker.sampleSize))))])
            if let key, let known = sampling.known?.sample(key), let verdict = ["0": false, "1": true][known] { return (verdict, key) }
            guard let fd = try? FileDescriptor.open(file.disk, .readOnly) else { return (nil, nil) }
            defer { try? fd.close() }
            guard let sample = try? readFully(fd, at: 0, count: ArchivePacker.sampleSize, path: file.disk), !sample.isEmpty else { return (nil, nil) }
            // Recorded only when what was read is what the key says.
            let verdict = sample.withUnsafeBytes { DeflateCompressor(level: 1).looksCompressible($0) }
            return (verdict, sample.count == Int(min(file.size, UInt64(ArchivePacker.sampleSize))) ? key : nil)
        }
        var compressible: [String: Bool] = [:]
        var samples: [(key: SampleKey, value: String)] = []
        for (file, result) in zip(large, judged) {
            compressible[file.path] = result.verdict
            if let verdict = result.verdict, let key = result.key { samples.append((key, verdict ? "1" : "0")) }
        }

        // Levels 10 to 12 are kept as asked: there is nothing to choose, so nothing to sample.
        guard level <= 9 else { return (compressible, [:], samples) }
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
        let measuredKinds = parallelMap(kinds) { kind in measureSample(of: kind.files, sampling: sampling) }
        for result in measuredKinds {
            if let sample = result.sample, let key = result.key { samples.append((key, sample.encoded)) }
        }
        let measured = zip(kinds, measuredKinds).compactMap { kind, result in result.sample.map { (name: kind.name, weight: kind.bytes, sample: $0) } }
        let levels = LevelBudget.choose(measured.map { ($0.weight, $0.sample) }, requested: level)
        return (compressible, Dictionary(uniqueKeysWithValues: zip(measured.map(\.name), levels)), samples)
    }

    /// Measures a sample of up to 64 KiB taken from the start of files spread over `files` (a
    /// quarter each from four of them when there are that many). nil when less than 4 KiB could
    /// be read: too little to judge by (and the workers report a file that cannot be read).
    /// Taken from the previous build's cache when the files it would read are unchanged; the key
    /// is returned with a measurement only when the bytes read were those the key describes.
    private static func measureSample(of files: [String], sampling: Sampling) -> (sample: LevelSample?, key: SampleKey?) {
        let spread = Set((0..<4).map { $0 * files.count / 4 })
        let order = spread.sorted() + files.indices.filter { !spread.contains($0) }
        let piece = ArchivePacker.sampleSize / min(4, files.count)
        // The files and bytes a read of unchanged files takes, from their sizes alone.
        var expected: [(disk: String, taken: Int)] = []
        var total = 0
        for index in order where total < ArchivePacker.sampleSize {
            let taken = Int(min(UInt64(min(piece, ArchivePacker.sampleSize - total)), sampling.identities[files[index]]?.size ?? 0))
            expected.append((files[index], taken))
            total += taken
        }
        let key = sampling.key("kind", level: sampling.level, files: expected)
        if let key, let known = sampling.known?.sample(key), let sample = LevelSample(encoded: known) { return (sample, key) }

        var sample: [UInt8] = []
        var read: [(disk: String, taken: Int)] = []
        for index in order where sample.count < ArchivePacker.sampleSize {
            let count = min(piece, ArchivePacker.sampleSize - sample.count)
            guard let fd = try? FileDescriptor.open(files[index], .readOnly) else {
                read.append((files[index], -1))
                continue
            }
            defer { try? fd.close() }
            let bytes = (try? readFully(fd, at: 0, count: count, path: files[index])) ?? []
            read.append((files[index], bytes.count))
            sample += bytes
        }
        guard sample.count >= 4096 else { return (nil, nil) }
        let measured = sample.withUnsafeBytes { LevelSample(sample: $0, level: sampling.level) }
        let same = read.count == expected.count && zip(read, expected).allSatisfy { $0.disk == $1.disk && $0.taken == $1.taken }
        return (measured, same ? key : nil)
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
        // On UTF-8 bytes: String's Character-wise search cost more than the rest of planning.
        let bytes = path.utf8
        let nameStart = bytes.lastIndex(of: UInt8(ascii: "/")).map { bytes.index(after: $0) } ?? bytes.startIndex
        guard let dot = bytes[nameStart...].lastIndex(of: UInt8(ascii: ".")), dot != nameStart else { return "" }
        return String(decoding: bytes[bytes.index(after: dot)...], as: UTF8.self).lowercased()
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
        throw .init(
            .capExceeded,
            "the archive for \(productId) \(what), \(smallest - cap) bytes over the cap of \(cap) bytes (\(formatBytes(cap))); nothing was written. Move some content to another product, or remove or shrink files"
        )
    }
}

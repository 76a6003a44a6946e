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
    public static func pack(
        folder: String, options: PackOptions,
        progress: (@Sendable (PackProgress) -> Void)? = nil
    ) throws(ArchiveError) -> PackResult {
        guard (0...12).contains(options.level) else {
            throw .invalid("compression level \(options.level) is out of range: use 0 (store) to 12 (smallest); 6 is the default")
        }
        // The previous build's manifest and hash cache are read while the folder is scanned and
        // sampled: decoding a manifest of thousands of entries takes as long as the scan.
        let (product, version) = buildTarget(folder: folder, options: options)
        let previous = options.previous.map { path in
            Background { () throws(ArchiveError) in try PreviousBuild.load(path, building: product, version: version) }
        }
        defer { _ = try? previous?.value() }
        let content = try ContentScanner.scan(folder: folder, productId: options.productId, contentVersion: options.contentVersion)
        try ContentScanner.refuseOutput(options.outputDirectory, inside: folder)
        let plan = try Plan(content: content, options: options, previous: previous)
        try plan.checkFits(cap: options.sizeCap, level: options.level)
        try makeDirectories(options.outputDirectory)

        let archiveName = ArchiveManifest.archiveName(productId: content.info.productIdentifier, version: content.info.contentVersion)
        let manifestName = ArchiveManifest.manifestName(productId: content.info.productIdentifier, version: content.info.contentVersion)
        let archivePath = options.outputDirectory + "/" + archiveName
        let manifestPath = options.outputDirectory + "/" + manifestName
        let leftovers = UnfinishedOutputs.removeLeftovers(in: options.outputDirectory)
        let archiveTemp = options.outputDirectory + "/" + UnfinishedOutputs.temporaryName(for: archiveName)
        let manifestTemp = options.outputDirectory + "/" + UnfinishedOutputs.temporaryName(for: manifestName)
        let archiveClaim = UnfinishedFiles.Claim(archiveTemp)
        let manifestClaim = UnfinishedFiles.Claim(manifestTemp)
        defer {
            archiveClaim.release()
            manifestClaim.release()
        }

        // An incremental build writes directly even without sync: through the page cache its
        // 569 MB of copied bytes took 0.50-0.52 s when it ran first after the last outputs were
        // deleted, but 1.18-1.37 s right after another build's buffered writes (the benchmark's
        // alternated order); written directly it held 0.49-0.79 s in either place, with less CPU
        // (docs/performance.md).
        let writer = try BufferedFileWriter(creating: archiveTemp, direct: options.sync || options.previous != nil, durable: options.sync)
        archiveClaim.lock()
        var manifestWriter: BufferedFileWriter?
        do throws(ArchiveError) {
            let (entries, size, archiveHash) = try write(plan: plan, to: writer, options: options, progress: progress)
            // The next build's hash cache is made on another core while this one writes the
            // manifest: each took 15-30 ms of the end of an incremental build of 5,000 files, when
            // only one thread was left working.
            let now = options.hashCacheTime ?? Date()
            let cacheBytes = Background { () throws(ArchiveError) in hashCache(plan: plan, entries: entries).encoded(now: now) }
            // The archive's SHA-256 (one core reading every byte) is what an incremental build
            // waits for last: the archive is finished and synced, and the manifest rendered with a
            // stand-in digest, while it completes.
            try writer.finish()
            var manifest = ArchiveManifest(
                productId: content.info.productIdentifier, contentVersion: content.info.contentVersion,
                archiveName: archiveName, archiveSize: size, archiveSHA256: String(repeating: "0", count: 64),
                contentLength: entries.reduce(0) { $0 + $1.uncompressedSize },
                createdAt: options.timestamp.iso8601, entries: entries, encoder: options.chunking.encoder)
            var json = manifest.canonicalJSON()
            manifest.archiveSHA256 = try archiveHash.finalize().sha256
            ArchiveManifest.replaceArchiveDigest(in: &json, with: manifest.archiveSHA256)
            assert(json == manifest.canonicalJSON(), "the manifest's digest was patched in the wrong place")
            let mw = try BufferedFileWriter(creating: manifestTemp, durable: options.sync)
            manifestClaim.lock()
            manifestWriter = mw
            try mw.write(json)
            try mw.finish()
            // The archive goes first: a build killed between the two leaves the new archive
            // beside the last build's manifest, which does not verify it, so publishing refuses
            // the pair until the build runs again.
            let placedArchive = try PlacedFile.move(archiveTemp, to: archivePath)
            let placedManifest: PlacedFile
            do throws(ArchiveError) {
                placedManifest = try PlacedFile.move(manifestTemp, to: manifestPath)
            } catch {
                placedArchive.rollback()
                throw error
            }
            // The files this build replaced (the same version built before) are deleted after the
            // folder's sync, on a thread of their own. Deleted before it, the sync waited for the
            // file system to discard their blocks (70 ms for a 569 MB archive on a disk mounted
            // with `discard`); and deleting frees their page cache (40 ms), meanwhile the hash
            // cache is written here.
            let removeReplaced: @Sendable () -> Void = {
                placedArchive.commit()
                placedManifest.commit()
            }
            if options.sync {
                do throws(ArchiveError) { try syncDirectory(options.outputDirectory) } catch {
                    removeReplaced()
                    throw error
                }
            }
            let replacedRemoved = Background { () throws(ArchiveError) in removeReplaced() }
            var result = PackResult(archivePath: archivePath, manifestPath: manifestPath, manifest: manifest)
            result.removedLeftovers = leftovers
            result.leftOut = content.leftOut
            for entry in plan.entries {
                if case .previous(_, let old, _) = entry.source {
                    result.reusedEntries += 1
                    result.reusedBytes += old.compressedSize
                }
            }
            HashCache.write(try cacheBytes.value(), besideArchive: archivePath)
            try replacedRemoved.value()
            return result
        } catch {
            writer.abandon()
            manifestWriter?.abandon()
            throw error
        }
    }

    /// The product and version this build makes, as far as they are known before the folder is
    /// scanned: the flags, else its ContentInfo.plist (the scan checks that the two agree).
    private static func buildTarget(folder: String, options: PackOptions) -> (ProductIdentifier?, ContentVersion?) {
        guard options.previous != nil, options.productId == nil || options.contentVersion == nil,
            let data = FileManager.default.contents(atPath: folder + "/ContentInfo.plist"),
            let info = try? ContentInfo(plist: data, source: folder + "/ContentInfo.plist")
        else { return (options.productId, options.contentVersion) }
        return (options.productId ?? info.productIdentifier, options.contentVersion ?? info.contentVersion)
    }

    /// The digests of the content files `plan` packed (as `entries` records them), and the sample
    /// measurements it chose levels from.
    private static func hashCache(plan: Plan, entries: [ArchiveManifest.Entry]) -> HashCache {
        var cache = HashCache()
        for (entry, written) in zip(plan.entries, entries) {
            switch entry.source {
            case .previous(_, _, let disk), .file(let disk):
                if let identity = plan.identities[disk] { cache.insert(disk, identity: identity, sha256: written.sha256) }
            default:
                break
            }
        }
        for sample in plan.samples { cache.insertSample(sample.key, value: sample.value) }
        return cache
    }

    /// Streams the planned entries through the compressors into `writer`; returns the manifest
    /// entries, the archive's size and the hasher still finishing its SHA-256. Throws
    /// `capExceeded`, with the final size, when the archive ends over the cap.
    private static func write(
        plan: Plan, to writer: BufferedFileWriter, options: PackOptions,
        progress: (@Sendable (PackProgress) -> Void)?
    ) throws(ArchiveError) -> ([ArchiveManifest.Entry], UInt64, BackgroundHasher) {
        let pipeline = OrderedPipeline(
            units: plan.units, entries: plan.entries, level: options.level,
            threads: max(1, options.threads), windowBytes: windowBytes)
        pipeline.start()
        defer { pipeline.stop() }

        let dos = options.timestamp.dos
        var manifestEntries: [ArchiveManifest.Entry] = []
        var centralDirectory: [UInt8] = []
        var overCap = false
        var size: UInt64 = 0
        var bytesDone: UInt64 = 0

        var header = ZipEntryHeader(
            name: [], method: 0, crc32: 0, compressedSize: 0, uncompressedSize: 0,
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
        let chunkHasher = BackgroundChunkHasher(chunkSize: ArchiveManifest.standardChunkSize)

        // Entries reused from a previous archive are copied through mappings of it (``MappedBytes``),
        // never read into arrays, and in runs: consecutive entries that lie one after the other
        // there, with the very header this build writes, are copied as one range, whose pieces
        // the writer, the archive's hasher and the checker of copied bytes all read from the page
        // cache. Bytes `run` of `previousPath` are counted in `size` but not written yet.
        var previousFD: FileDescriptor?
        var previousPath = ""
        var run: Range<UInt64>?
        defer { try? previousFD?.close() }

        func flushRun() throws(ArchiveError) {
            guard let pending = run else { return }
            run = nil
            var position = pending.lowerBound
            while position < pending.upperBound {
                let end = min(position + (4 << 20), pending.upperBound)
                let piece = try MappedBytes(previousFD!, range: position..<end, path: previousPath)
                archiveHasher.update(piece)
                chunkHasher.check(piece, at: position)
                if !overCap, try !writer.copy(from: previousFD!, range: position..<end) { try writer.write(piece.bytes) }
                position = end
            }
        }

        // Bytes are still counted once the cap is passed, so the error can say by how much.
        func grow(by count: Int) {
            size += UInt64(count)
            if !overCap && size > options.sizeCap {
                overCap = true
                writer.abandon()
            }
        }

        func emit(_ bytes: [UInt8], hash: Bool = true) throws(ArchiveError) {
            try flushRun()
            if hash && archiveHashed == size {
                archiveHasher.update(bytes)
                archiveHashed += UInt64(bytes.count)
            }
            grow(by: bytes.count)
            if !overCap { try writer.write(bytes) }
        }

        /// Appends bytes `range` of the previous archive to the run, or starts a new run.
        func copy(_ range: Range<UInt64>) throws(ArchiveError) {
            if let pending = run, pending.upperBound == range.lowerBound {
                run = pending.lowerBound..<range.upperBound
            } else {
                try flushRun()
                run = range
            }
            // Nothing before a reused entry waits to be hashed (only a multi-chunk entry's own
            // chunks come between its header and its patch), so the run is hashed in turn.
            grow(by: Int(range.count))
            archiveHashed = size
        }

        for index in plan.units.indices {
            let unit = plan.units[index]
            let entry = plan.entries[unit.entry]
            let result = try pipeline.result(at: index)
            let data = result.compressed ?? result.raw
            // Copied from the previous archive: sizes and checksums are known from its manifest.
            var reused: ArchiveManifest.Entry?
            if case .previous(let archive, let old, _) = entry.source {
                reused = old
                if previousFD == nil {
                    previousFD = try openFile(archive)
                    previousPath = archive
                }
            }
            // A single-chunk entry arrives hashed by its worker.
            let digest = reused == nil && unit.chunk == 0 && unit.isLast ? result.digest ?? UnitResult.digest(of: result.raw) : nil
            if unit.chunk == 0 {
                header.name = Array(entry.path.utf8)
                header.method = result.compressed == nil ? Zip.methodStored : Zip.methodDeflate
                if let reused { header.method = reused.method == .deflate ? Zip.methodDeflate : Zip.methodStored }
                header.mode = entry.isDirectory ? Zip.directoryMode : Zip.fileMode
                header.localHeaderOffset = UInt32(truncatingIfNeeded: size)
                header.crc32 = 0
                header.compressedSize = 0
                header.uncompressedSize = UInt32(entry.size)
                if let digest {
                    header.crc32 = digest.crc32
                    header.compressedSize = UInt32(data.count)
                }
                if let reused {
                    header.crc32 = reused.crc32
                    header.compressedSize = UInt32(reused.compressedSize)
                }
                contentHasher = digest == nil && reused == nil ? BackgroundHasher(label: "iap-pack.entry-hash", checksums: true) : nil
                compressedSize = 0
                if let reused, let fd = previousFD {
                    let local = header.localHeader
                    let stored = reused.dataOffset..<reused.dataOffset + reused.compressedSize
                    // The previous archive's header is copied with the data when it is this one.
                    let previous = try readFully(fd, at: reused.localHeaderOffset, count: local.count, path: previousPath)
                    if previous == local && reused.localHeaderOffset + UInt64(local.count) == reused.dataOffset {
                        try copy(reused.localHeaderOffset..<stored.upperBound)
                    } else {
                        try emit(local)
                        try copy(stored)
                    }
                    chunkHasher.endEntry(
                        copiedFrom: stored, crc32: reused.storedCRC32 ?? (reused.method == .stored ? reused.crc32 : nil),
                        chunks: reused.chunks ?? [], entryPath: reused.path)
                    compressedSize = reused.compressedSize
                } else {
                    try emit(header.localHeader, hash: unit.isLast)
                }
            }
            if reused == nil {
                contentHasher?.update(result.raw)
                compressedSize += UInt64(data.count)
                chunkHasher.update(data)
                try emit(data)
            }
            bytesDone += reused == nil ? UInt64(unit.length) : (unit.isLast ? entry.size : 0)
            if unit.isLast {
                guard compressedSize <= UInt64(Zip.maxEntrySize) else {
                    throw .invalid("\(entry.path) compresses to more than 4 GiB, which a ZIP entry without ZIP64 cannot hold: split it")
                }
                header.compressedSize = UInt32(compressedSize)
                var sha256 = digest?.sha256 ?? reused?.sha256 ?? ""
                if let contentHasher {
                    (sha256, header.crc32) = try contentHasher.finalize()
                }
                if reused == nil { chunkHasher.endEntry() }
                if unit.chunk > 0 && !overCap && reused == nil {
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
                manifestEntries.append(
                    .init(
                        path: entry.path, kind: entry.isDirectory ? .directory : .file,
                        method: header.method == Zip.methodDeflate ? .deflate : .stored,
                        uncompressedSize: entry.size, compressedSize: compressedSize, crc32: header.crc32,
                        sha256: sha256,
                        localHeaderOffset: offset, dataOffset: offset + UInt64(Zip.localHeaderSize + header.name.count),
                        level: entry.isDirectory ? nil : entry.level))
                progress?(PackProgress(bytesDone: bytesDone, bytesTotal: plan.totalBytes))
            }
        }
        let centralOffset = size
        try emit(centralDirectory)
        try emit(
            ZipEntryHeader.endRecord(
                entryCount: plan.entries.count, centralSize: UInt32(centralDirectory.count),
                centralOffset: UInt32(truncatingIfNeeded: centralOffset)))
        if overCap {
            throw .init(
                .capExceeded,
                "the archive for \(plan.productId) would be \(size) bytes, \(size - options.sizeCap) bytes over the cap of \(options.sizeCap) bytes (\(formatBytes(options.sizeCap))); nothing was written. Move some content to another product, or remove or shrink files"
            )
        }
        guard archiveHashed == size else {
            throw .io("internal error: \(archiveHashed) of \(size) archive bytes were hashed; please report this")
        }
        let (chunks, mismatch) = chunkHasher.results()
        // Copied bytes must be the ones the previous manifest describes.
        if let mismatch {
            throw .corrupt("the previous archive \(previousPath) does not match its manifest at '\(mismatch)': pass the archive and manifest of one build, or build without --previous")
        }
        for index in manifestEntries.indices {
            manifestEntries[index].chunks = chunks[index].chunks
            manifestEntries[index].storedCRC32 = chunks[index].crc32
        }
        return (manifestEntries, size, archiveHasher)
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

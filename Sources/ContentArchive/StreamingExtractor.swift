import DurableFiles
import Foundation
import Synchronization
import SystemPackage

#if canImport(Glibc)
    import CLinuxWriteback
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Extracts a content archive while it downloads: its bytes are handed over in order as they
/// arrive, each entry's go to its file in a hidden sibling of the destination, and once the whole
/// archive has been checked (its SHA-256, by the caller) ``finish(archive:expecting:)`` renames the
/// folder into place.
///
/// Why: installing after the download read a 1 GiB archive back from the disk and wrote it out
/// again, 1.4-1.6 s after a transfer of 1.0 s (docs/performance.md, "Where `get`'s other 1.5 s
/// go"). Written as the bytes arrive, the install is done when the transfer is.
///
/// Only files of at least `streamingAtLeast` bytes are written as they arrive; smaller ones are
/// placed from the finished archive by ``finish(archive:expecting:)``, in lanes, as an install
/// from the archive places them. Their install is their `fsync`s, not their bytes: written one by
/// one as they arrived, 5,000 files of 20 KiB took 4.5 s where an install after the download took 3.8.
///
/// What the extraction follows is the layout of the download's manifest, under the checks a
/// central directory passes (``ArchiveReader/init(path:manifest:limits:)``); every entry's size and
/// CRC-32 are checked as its last byte arrives. Nothing appears at the destination until
/// ``finish(archive:expecting:)`` has read the finished archive's own central directory and found
/// it entry for entry the same as that layout, and its `ContentInfo.plist` naming the expected
/// product and version: what is installed is then byte for byte what ``SafeExtractor/extract(archive:to:expecting:limits:durable:readOnce:)``
/// would have installed from that archive.
///
/// Anything that goes wrong (a gap in the bytes, a file that cannot be written, an entry that
/// fails its CRC-32) abandons the extraction: its folder is removed and every later call does
/// nothing but report it, so the caller installs from the archive as before. Used by one thread
/// at a time.
public final class StreamingExtractor: @unchecked Sendable {
    /// Where the content appears once finished.
    public let destination: String
    /// The hidden folder the entries are written into meanwhile, a sibling of `destination`.
    public let folder: String
    /// The archive offset of the next byte expected.
    public private(set) var position: UInt64 = 0
    /// Why the extraction was abandoned, once it was.
    public private(set) var failure: ArchiveError?
    /// After an abandon that copied the stored files' bytes back into the partial archive
    /// (``copyBack(into:)``): the first archive byte it could not put back, if any.
    public private(set) var notCopiedBack: UInt64?
    /// The partial archive whose copy of the stored files' bytes this extraction holds instead.
    private var archiveLeavingOut: String?
    private let written = Atomic<UInt64>(0)

    /// The bytes written into the hidden folder's files so far while the extraction goes on; 0
    /// once it has finished (they are the installed content) or was abandoned (they are gone).
    /// Read from any thread: a download's space check counts them as taken already.
    public var bytesInFolder: UInt64 { written.load(ordering: .relaxed) }

    private let limits: ExtractionLimits
    private let archiveSize: UInt64
    /// Every entry, by where its local header starts.
    private let layout: [ArchiveEntry]
    /// The files written as they arrive, by where their data starts.
    private let files: [ArchiveEntry]
    /// The files placed from the archive at the end.
    private let smallFiles: [ArchiveEntry]
    private var index = 0
    private var current: OpenEntry?
    private let syncs: BackgroundSync?
    private var folders: Set<String> = []
    private let claim: UnfinishedFiles.Claim
    private var done = false

    /// The file of the entry whose bytes are arriving.
    private struct OpenEntry {
        let writer: BufferedFileWriter
        let share: WriterShare
        let path: String
        let inflater: Inflater?
        var crc: UInt32 = 0
        var produced: UInt64 = 0
    }

    private static let outputSize = 256 << 10
    private let output = UnsafeMutableRawBufferPointer.allocate(byteCount: StreamingExtractor.outputSize, alignment: 16)

    /// Starts an extraction of the archive `manifest` describes into `destination`, which must not
    /// exist yet: checks the layout and creates the hidden folder with every folder of the content.
    /// - Parameters:
    ///   - streamingAtLeast: the least size of a file written as its bytes arrive.
    ///   - durable: every file and folder is synced before the rename.
    public init(
        manifest: ArchiveManifest, destination: String, streamingAtLeast: UInt64 = 1 << 20, limits: ExtractionLimits = .standard, durable: Bool = true
    ) throws(ArchiveError) {
        self.destination = destination
        self.limits = limits
        archiveSize = manifest.archiveSize
        layout = try ArchiveReader.layout(of: manifest, archive: manifest.archiveName, limits: limits).sorted { $0.localHeaderOffset < $1.localHeaderOffset }
        files = Self.streamed(layout, atLeast: streamingAtLeast)
        smallFiles = layout.filter { !$0.isDirectory && $0.uncompressedSize < streamingAtLeast }
        let url = URL(fileURLWithPath: destination)
        let parent = url.deletingLastPathComponent().path
        if access(destination, F_OK) == 0 {
            throw .io("\(destination) already exists: extract into a new folder (remove or rename the old one first)")
        }
        try makeDirectories(parent)
        folder = parent + "/." + url.lastPathComponent + Self.marker + "\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        claim = UnfinishedFiles.Claim(folder)
        guard mkdir(folder, 0o755) == 0 else {
            let code = errno
            claim.release()
            output.deallocate()
            throw ioError(code, action: "create folder", path: folder)
        }
        // Locked while it lives: a sweep (``UnfinishedFiles/removeLeftovers(in:minimumAge:matching:)``)
        // then tells it from the leftover of a process that died.
        claim.lock()
        syncs = durable ? BackgroundSync() : nil
        do throws(ArchiveError) {
            for entry in layout {
                try SafeExtractor.makeParents(of: entry.isDirectory ? entry.path + "x" : entry.path, root: folder, made: &folders)
            }
        } catch {
            abandon(error)
            throw error
        }
    }

    deinit {
        if !done { abandon(.io("the extraction into \(folder) was dropped before it finished")) }
        output.deallocate()
    }

    /// In the name of the hidden folder, after the destination's: `.<name>.streaming-<pid>-<random>`.
    public static let marker = ".streaming-"

    /// The files written as they arrive, in the order of their data in the archive.
    private static func streamed(_ layout: [ArchiveEntry], atLeast: UInt64) -> [ArchiveEntry] {
        layout.filter { !$0.isDirectory && $0.uncompressedSize >= atLeast }.sorted { $0.dataOffset < $1.dataOffset }
    }

    /// The archive ranges whose bytes this extraction writes unchanged into its files (the data of
    /// the stored entries it writes as they arrive), in order. A download may leave them out of its
    /// partial archive once it has called ``copyBack(into:)``.
    public var storedRanges: [Range<UInt64>] { Self.storedRanges(files) }

    /// The ``storedRanges`` of an extraction of the archive `manifest` describes, before one is
    /// started (none when the manifest gives no layout): what a download's space check leaves out
    /// of the blocks its partial archive needs.
    public static func storedRanges(of manifest: ArchiveManifest, streamingAtLeast: UInt64 = 1 << 20, limits: ExtractionLimits = .standard) -> [Range<UInt64>] {
        guard let layout = try? ArchiveReader.layout(of: manifest, archive: manifest.archiveName, limits: limits) else { return [] }
        return storedRanges(streamed(layout, atLeast: streamingAtLeast))
    }

    private static func storedRanges(_ files: [ArchiveEntry]) -> [Range<UInt64>] {
        files.filter { $0.method == .stored }.map { $0.dataOffset..<($0.dataOffset + $0.compressedSize) }
    }

    /// Tells the extraction that `archive`, the partial archive being downloaded, leaves out the
    /// bytes of ``storedRanges`` that this extraction takes: an abandon first copies them back
    /// there from the files (up to where it stands), and ``notCopiedBack`` says where that fell
    /// short. A finished extraction needs none of them: the archive is deleted once installed.
    public func copyBack(into archive: String) {
        archiveLeavingOut = archive
    }

    /// Copies back into `archive` the bytes below `through` of the stored entries that a killed
    /// process's extraction had written into `folder` (as ``copyBack(into:)`` would have before its
    /// folder went): the extraction of `manifest` with the same `streamingAtLeast`. Returns the
    /// first archive byte below `through` it could not put back, if any (a file short by what its
    /// writer still held, or missing).
    public static func copyBack(
        manifest: ArchiveManifest, folder: String, into archive: String, through: UInt64, streamingAtLeast: UInt64 = 1 << 20,
        limits: ExtractionLimits = .standard
    ) -> UInt64? {
        let files: [ArchiveEntry]
        do {
            files = streamed(try ArchiveReader.layout(of: manifest, archive: manifest.archiveName, limits: limits), atLeast: streamingAtLeast)
        } catch {
            // A manifest that gives no layout never had an extraction: nothing was left out.
            return nil
        }
        return copyBack(files, from: folder, into: archive, through: through)
    }

    /// Copies each stored file's bytes below `through` from `folder` to its place in `archive`;
    /// the first byte it could not, if any.
    private static func copyBack(_ files: [ArchiveEntry], from folder: String, into archive: String, through: UInt64) -> UInt64? {
        let stored = files.filter { $0.method == .stored && $0.dataOffset < through && $0.compressedSize > 0 }
        guard let first = stored.first else { return nil }
        guard let out = try? FileDescriptor.open(archive, .writeOnly, options: [.noFollow]) else { return first.dataOffset }
        defer { try? out.close() }
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: 1 << 20, alignment: 16)
        defer { buffer.deallocate() }
        for entry in stored {
            let needed = min(entry.dataOffset + entry.compressedSize, through) - entry.dataOffset
            let copied = copy(folder + "/" + entry.path, count: needed, into: out, at: entry.dataOffset, buffer: buffer)
            if copied < needed { return entry.dataOffset + copied }
        }
        return nil
    }

    /// Copies up to `count` bytes from the start of the file at `path` to `offset` of `out`;
    /// returns how many it copied. Each part copied is given back to the file system in the
    /// file, which goes with its folder after a copy back: the archive's blocks for it may not
    /// have been reserved (a download short of space reserves only what its file does not leave
    /// out), and so the copy needs at most one part more than the disk held.
    private static func copy(_ path: String, count: UInt64, into out: FileDescriptor, at offset: UInt64, buffer: UnsafeMutableRawBufferPointer) -> UInt64 {
        guard
            let input = (try? FileDescriptor.open(path, .readWrite, options: [.noFollow]))
                ?? (try? FileDescriptor.open(path, .readOnly, options: [.noFollow]))
        else { return 0 }
        defer { try? input.close() }
        var done: UInt64 = 0
        while done < count {
            let part = UnsafeMutableRawBufferPointer(rebasing: buffer[0..<Int(min(UInt64(buffer.count), count - done))])
            guard let n = try? input.read(fromAbsoluteOffset: Int64(done), into: part), n > 0,
                (try? out.writeAll(toAbsoluteOffset: Int64(offset + done), UnsafeRawBufferPointer(rebasing: part[0..<n]))) != nil
            else { break }
            #if os(Linux)
                // Where the file system cannot, the blocks go with the folder, as before.
                _ = cwriteback_release(input.rawValue, Int64(done), Int64(n))
            #endif
            done += UInt64(n)
        }
        return done
    }

    /// Whether the extraction still goes on (nothing has abandoned it, it has not finished).
    public var isActive: Bool { failure == nil && !done }

    /// Takes the archive's bytes at `offset`, which must not leave a gap after those taken
    /// already; bytes taken before (a transfer that starts again over its own prefix) are
    /// skipped. Throws, having abandoned the extraction, when they cannot be used.
    public func consume(_ bytes: UnsafeRawBufferPointer, at offset: UInt64) throws(ArchiveError) {
        guard isActive else { return }
        do throws(ArchiveError) {
            guard offset <= position else {
                throw .io("the archive's bytes from \(position) to \(offset) never reached the extraction")
            }
            let seen = position - offset
            guard seen < UInt64(bytes.count) else { return }
            try take(UnsafeRawBufferPointer(rebasing: bytes[Int(seen)...]))
        } catch {
            abandon(error)
            throw error
        }
    }

    private func take(_ bytes: UnsafeRawBufferPointer) throws(ArchiveError) {
        var rest = bytes
        while true {
            // Every entry whose data ends here is complete: empty ones too.
            while index < files.count, files[index].dataOffset + files[index].compressedSize <= position {
                if current == nil { try open(files[index]) }
                try close(files[index])
                index += 1
            }
            guard !rest.isEmpty else { return }
            guard index < files.count else {
                guard UInt64(rest.count) <= archiveSize - min(archiveSize, position) else {
                    throw .corrupt("the archive is longer than its manifest's \(archiveSize) bytes")
                }
                position += UInt64(rest.count)
                return
            }
            let entry = files[index]
            if position < entry.dataOffset {
                // Headers and the like between two entries' data.
                let skip = Int(min(UInt64(rest.count), entry.dataOffset - position))
                rest = UnsafeRawBufferPointer(rebasing: rest[skip...])
                position += UInt64(skip)
                continue
            }
            if current == nil { try open(entry) }
            let count = Int(min(UInt64(rest.count), entry.dataOffset + entry.compressedSize - position))
            try write(UnsafeRawBufferPointer(rebasing: rest[..<count]), of: entry)
            rest = UnsafeRawBufferPointer(rebasing: rest[count...])
            position += UInt64(count)
        }
    }

    private func open(_ entry: ArchiveEntry) throws(ArchiveError) {
        let path = folder + "/" + entry.path
        let inflater = entry.method == .deflate ? try Inflater() : nil
        // Around the page cache (`O_DIRECT`, where the file system takes it), from two buffers,
        // the disk writing one while the other fills: the files are not read soon, and through
        // the page cache the copy into fresh pages, on the thread that also hashes the download,
        // made a 1 GiB transfer take 1.01 s against 0.65 without the extraction.
        // Created `O_EXCL` in a folder this extraction made: nothing in the way is followed.
        let share = WriterShare()
        let writer = try BufferedFileWriter(creating: path, direct: true, durable: false, capacity: share.capacity)
        current = OpenEntry(writer: writer, share: share, path: path, inflater: inflater)
    }

    private func write(_ bytes: UnsafeRawBufferPointer, of entry: ArchiveEntry) throws(ArchiveError) {
        guard var file = current else { return }
        defer { current = file }
        let declared = entry.uncompressedSize
        func deliver(_ piece: UnsafeRawBufferPointer) throws(ArchiveError) {
            file.produced += UInt64(piece.count)
            guard file.produced <= declared else {
                throw .corrupt("entry '\(entry.path)' inflates to more than its declared \(declared) bytes (a zip bomb or a damaged archive): refusing it")
            }
            file.crc = crc32(file.crc, piece)
            try file.writer.write(piece)
            written.add(UInt64(piece.count), ordering: .relaxed)
        }
        if let inflater = file.inflater {
            // Bytes after the end of the deflate stream are ignored, as ``ArchiveReader`` does.
            _ = try inflater.feed(bytes, into: output, emit: deliver)
        } else {
            try deliver(bytes)
        }
    }

    /// The entry's last byte has arrived: checks it as ``ArchiveReader/read(_:stored:once:into:)`` does, and hands the file
    /// over to be synced (or closes it).
    private func close(_ entry: ArchiveEntry) throws(ArchiveError) {
        guard let file = current else { return }
        // On a failure the file stays `current`: the abandon that follows (every caller's) copies
        // its bytes back first when asked to (``copyBack(into:)``), then removes it.
        if let inflater = file.inflater, !inflater.isFinished, entry.uncompressedSize > 0 || entry.compressedSize > 0 {
            throw .corrupt("entry '\(entry.path)' ends before its compressed data does: the archive is truncated or damaged")
        }
        guard file.produced == entry.uncompressedSize else {
            throw .corrupt("entry '\(entry.path)' holds \(file.produced) bytes but declares \(entry.uncompressedSize): the archive is damaged or forged")
        }
        guard file.crc == entry.crc32 else {
            throw .corrupt("entry '\(entry.path)' fails its CRC-32 check: the archive is damaged")
        }
        try file.writer.finish()
        current = nil
        // Synced with the others: the direct writes are on the disk, the file's size and blocks
        // and its unaligned tail are not yet.
        guard let syncs else { return }
        let fd = try systemCall("open", file.path) { try FileDescriptor.open(file.path, .readOnly, options: [.noFollow]) }
        syncs.sync(fd, path: file.path)
    }

    /// Puts the content in place, once every byte of `archive` (the finished, checked download)
    /// has been taken: its central directory must give the layout the extraction followed, and
    /// its `ContentInfo.plist` must name `expecting`. Throws, having abandoned the extraction, when
    /// it cannot; the caller then extracts from the archive.
    public func finish(archive: String, expecting: ContentInfo) throws(ArchiveError) {
        if let failure { throw failure }
        do throws(ArchiveError) {
            guard !done else { throw .io("the extraction into \(destination) has finished already") }
            guard position == archiveSize, index == files.count else {
                throw .io("the extraction into \(folder) has taken \(position) of the archive's \(archiveSize) bytes")
            }
            let reader = try ArchiveReader(path: archive, limits: limits)
            guard reader.size == archiveSize, reader.entries.sorted(by: { $0.localHeaderOffset < $1.localHeaderOffset }) == layout else {
                throw .corrupt("\(archive)'s central directory does not give the layout of its manifest")
            }
            let info = try reader.contentInfo()
            guard info == expecting else {
                throw .corrupt("\(archive) holds \(info.productIdentifier) \(info.contentVersion), not the expected \(expecting.productIdentifier) \(expecting.contentVersion): refusing to install it")
            }
            let (folder, syncs) = (folder, syncs)
            let place: @Sendable (ArchiveEntry) throws(ArchiveError) -> Void = { (file) throws(ArchiveError) in
                try SafeExtractor.write(file, from: reader, to: folder + "/" + file.path, sha256: nil, syncs: syncs, once: true)
            }
            try SafeExtractor.placeInLanes(smallFiles, cost: { $0.uncompressedSize }, place)
            try SafeExtractor.moveIntoPlace(folder, folders: folders, to: destination, syncs: syncs)
            done = true
            written.store(0, ordering: .relaxed)
            claim.release()
        } catch {
            if !done { abandon(error) }
            throw error
        }
    }

    /// The buffer size of one file's writer: 2 MiB for the first open in the process, 1 MiB for
    /// those beside it. Alone, 1 GiB installed in 1.05 s with 2 MiB buffers against 1.28 with
    /// 1 MiB (the disk takes fewer, larger writes beside the download's own); downloads side by side
    /// share the disk anyway, and with 2 MiB each three at once peaked at 63 MiB, at the 64 MiB goal.
    private final class WriterShare {
        private static let open = Atomic<Int>(0)
        let capacity: Int

        init() {
            capacity = Self.open.add(1, ordering: .relaxed).newValue == 1 ? 2 << 20 : 1 << 20
        }

        deinit { Self.open.subtract(1, ordering: .relaxed) }
    }

    /// Stops the extraction and removes its folder; `reason` is kept as ``failure``. After
    /// ``copyBack(into:)``, the bytes of the stored files below `limit` are copied back first.
    public func abandon(because reason: String, copyingBackBelow limit: UInt64 = .max) {
        abandon(.io(reason), copyingBackBelow: limit)
    }

    func abandon(_ reason: ArchiveError, copyingBackBelow limit: UInt64 = .max) {
        guard isActive else { return }
        failure = reason
        if let archive = archiveLeavingOut {
            // Before the files go: the partial archive's copy of their bytes is theirs. What the
            // open file's writer still holds goes to the file first (nothing, if writing is what failed).
            try? current?.writer.flush()
            notCopiedBack = Self.copyBack(files, from: folder, into: archive, through: min(position, limit))
        }
        current?.writer.abandon()
        current = nil
        written.store(0, ordering: .relaxed)
        syncs?.waitForAll()
        try? FileManager.default.removeItem(atPath: folder)
        claim.release()
    }
}

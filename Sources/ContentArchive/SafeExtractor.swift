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

/// Extracts a content archive into a folder that appears only when all of it is right.
///
/// Entries are streamed (memory stays flat) into a temporary sibling folder; every size and
/// CRC-32 is checked; the folder is renamed into place only at the end. Paths are validated by
/// ``ArchiveReader`` and files are created with `O_EXCL | O_NOFOLLOW` in folders this extractor
/// made itself, so nothing can be written outside the destination.
public enum SafeExtractor {
    /// Extracts `archive` to `destination`, which must not exist yet.
    /// - Parameters:
    ///   - expecting: when given, the archive's plist must name this product and version.
    ///   - durable: fsync every file and folder before the rename, so a crash leaves either nothing
    ///     or the complete folder.
    ///   - readOnce: the archive is removed after this (an install): its pages leave the page
    ///     cache as they are read.
    /// - Returns: what the archive's `ContentInfo.plist` says.
    @discardableResult
    public static func extract(
        archive: String, to destination: String, expecting: ContentInfo? = nil,
        limits: ExtractionLimits = .standard, durable: Bool = true, readOnce: Bool = false
    ) throws(ArchiveError) -> ContentInfo {
        let reader = try ArchiveReader(path: archive, limits: limits)
        let info = try reader.contentInfo()
        if let expecting, expecting != info {
            throw .corrupt("\(archive) holds \(info.productIdentifier) \(info.contentVersion), not the expected \(expecting.productIdentifier) \(expecting.contentVersion): refusing to install it")
        }
        let needed = reader.entries.reduce(UInt64(0)) { $0 + $1.uncompressedSize }
        try stage(reader, to: destination, needing: needed, durable: durable) { (entry, target, syncs) throws(ArchiveError) in
            try write(entry, from: reader, to: target, sha256: nil, syncs: syncs, once: readOnce)
        } cost: {
            $0.uncompressedSize
        }
        return info
    }

    /// Builds a new version of installed content from a delta update: the entries named in
    /// `fetched` are inflated from `partialArchive` (which holds at least their bytes, at the
    /// offsets `manifest` gives) and checked against the manifest's size, CRC-32 and SHA-256;
    /// every other file is taken from `previousFolder` (`reused` maps its new path to its path
    /// there), hard-linked when the file system allows (installed files are never written to)
    /// or else copied and checked against the manifest's SHA-256. A link is shown to `linked`
    /// (new path, path in `previousFolder`, the link): a file is not read again to be linked, so
    /// the caller says whether it is still the one it checked; false refuses the update. The
    /// folder appears at `destination` only when all of it is right.
    public static func assemble(
        partialArchive: String, manifest: ArchiveManifest, fetched: Set<String>, reused: [String: String],
        previousFolder: String, to destination: String, expecting: ContentInfo, limits: ExtractionLimits = .standard,
        durable: Bool = true, linked: @Sendable (_ path: String, _ source: String, _ link: String) -> Bool
    ) throws(ArchiveError) {
        let reader = try ArchiveReader(path: partialArchive, manifest: manifest, limits: limits)
        let bySHA = Dictionary(manifest.entries.map { ($0.path, $0.sha256) }, uniquingKeysWith: { a, _ in a })
        let needed = reader.entries.filter { fetched.contains($0.path) }.reduce(UInt64(0)) { $0 + $1.uncompressedSize }
        try stage(reader, to: destination, needing: needed, durable: durable) { (entry, target, syncs) throws(ArchiveError) in
            if fetched.contains(entry.path) {
                try write(entry, from: reader, to: target, sha256: bySHA[entry.path], syncs: syncs)
            } else if let old = reused[entry.path] {
                try validateEntryPath(old, archive: previousFolder)
                let source = previousFolder + "/" + old
                if link(source, target) != 0 {
                    try copy(source, to: target, sha256: bySHA[entry.path] ?? "", syncs: syncs)
                } else if !linked(entry.path, old, target) {
                    throw .corrupt("'\(old)' of the installed version changed while the update was being installed: it is fetched again")
                }
            } else {
                throw .corrupt("the delta update names no source for '\(entry.path)': please report this")
            }
        } cost: {
            // A link costs about what inflating and writing 8 KiB does.
            fetched.contains($0.path) ? $0.uncompressedSize : 8 << 10
        } check: { (temp) throws(ArchiveError) in
            let plist = temp + "/" + ContentInfo.fileName
            guard let data = FileManager.default.contents(atPath: plist), (try? ContentInfo(plist: Data(data), source: plist)) == expecting else {
                throw .corrupt("the updated content is not \(expecting.productIdentifier) \(expecting.contentVersion): refusing to install it")
            }
        }
    }

    /// Builds a temporary sibling of `destination`: `reader`'s folders, and each file by `place`
    /// (entry, path to create, and when `durable` where to hand the file to be synced); runs
    /// `check` on the folder, syncs it when `durable`, and renames it into place; removes it on
    /// any error.
    ///
    /// Files are placed in lanes, one per core (up to ``maximumLanes``), each taking the next
    /// file while its `cost` so far is the lowest: inflating is the work, and one core left most
    /// of a 1 GiB install to the disk and the other idle.
    private static func stage(
        _ reader: ArchiveReader, to destination: String, needing needed: UInt64, durable: Bool,
        _ place: @Sendable (ArchiveEntry, String, BackgroundSync?) throws(ArchiveError) -> Void,
        cost: (ArchiveEntry) -> UInt64,
        check: (String) throws(ArchiveError) -> Void = { _ in }
    ) throws(ArchiveError) {
        let destinationURL = URL(fileURLWithPath: destination)
        let parent = destinationURL.deletingLastPathComponent().path
        if access(destination, F_OK) == 0 {
            throw .io("\(destination) already exists: extract into a new folder (remove or rename the old one first)")
        }
        try makeDirectories(parent)
        var fs = statvfs()
        if statvfs(parent, &fs) == 0 {
            let free = UInt64(fs.f_bavail) * UInt64(fs.f_frsize)
            if free < needed {
                throw .io("\(parent) has \(free) bytes free but the content needs \(needed): free disk space and try again")
            }
        }
        let temp = parent + "/." + destinationURL.lastPathComponent + ".extracting-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        // An interrupted `iap-pack extract` removes the folder (``UnfinishedFiles/removeAll()``).
        let claim = UnfinishedFiles.Claim(temp)
        defer { claim.release() }
        guard mkdir(temp, 0o755) == 0 else { throw ioError(errno, action: "create folder", path: temp) }
        let syncs = durable ? BackgroundSync() : nil
        do throws(ArchiveError) {
            // Every file is synced before the folder is renamed, whatever is thrown.
            defer { syncs?.waitForAll() }
            // Every folder first: the lanes then only create files.
            var made: Set<String> = []
            for entry in reader.entries {
                try makeParents(of: entry.isDirectory ? entry.path + "x" : entry.path, root: temp, made: &made)
            }
            try placeInLanes(reader.entries.filter { !$0.isDirectory }, cost: cost) { (file) throws(ArchiveError) in
                try place(file, temp + "/" + file.path, syncs)
            }
            try check(temp)
            try moveIntoPlace(temp, folders: made, to: destination, syncs: syncs)
        } catch {
            try? FileManager.default.removeItem(atPath: temp)
            throw error
        }
    }

    /// Renames `temp`, which holds `folders` (relative paths), to `destination`; with `syncs`, once
    /// every file handed to it and every folder is synced, and then the parent is synced too.
    static func moveIntoPlace(_ temp: String, folders: Set<String>, to destination: String, syncs: BackgroundSync?) throws(ArchiveError) {
        if let syncs {
            for folder in folders.sorted(by: >) { syncs.sync(directory: temp + "/" + folder) }
            syncs.sync(directory: temp)
            try syncs.finish()
        }
        guard rename(temp, destination) == 0 else { throw ioError(errno, action: "rename into", path: destination) }
        if syncs != nil { try syncDirectory(URL(fileURLWithPath: destination).deletingLastPathComponent().path) }
    }

    /// At most this many files are placed at once: beyond it the disk, not the processor, sets
    /// the pace.
    static let maximumLanes = 4

    /// Runs `place` on every file, in lanes (one per core, up to ``maximumLanes``), each taking
    /// the next file while its `cost` so far is the lowest; the first failure stops every lane
    /// before its next file and is thrown.
    static func placeInLanes(
        _ files: [ArchiveEntry], cost: (ArchiveEntry) -> UInt64, _ place: @Sendable (ArchiveEntry) throws(ArchiveError) -> Void
    ) throws(ArchiveError) {
        let laneCount = min(maximumLanes, ProcessInfo.processInfo.activeProcessorCount, files.count)
        guard laneCount > 1 else {
            for file in files { try place(file) }
            return
        }
        var lanes = [[ArchiveEntry]](repeating: [], count: laneCount)
        var costs = [UInt64](repeating: 0, count: laneCount)
        for file in files {
            let lane = costs.indices.min { costs[$0] < costs[$1] }!
            lanes[lane].append(file)
            costs[lane] += cost(file)
        }
        let failure = Mutex<ArchiveError?>(nil)
        let planned = lanes
        DispatchQueue.concurrentPerform(iterations: laneCount) { lane in
            do throws(ArchiveError) {
                for file in planned[lane] {
                    if failure.withLock({ $0 != nil }) { return }
                    try place(file)
                }
            } catch {
                failure.withLock { if $0 == nil { $0 = error } }
            }
        }
        if let error = failure.withLock({ $0 }) { throw error }
    }

    /// Writes one entry's bytes to a new file at `target`, checking its SHA-256 when given.
    static func write(
        _ entry: ArchiveEntry, from reader: ArchiveReader, to target: String, sha256: String?, syncs: BackgroundSync?, once: Bool = false
    ) throws(ArchiveError) {
        try makeFile(target, syncs: syncs, dropsBehind: once) { (write) throws(ArchiveError) in
            var hasher = SHA256()
            try reader.read(entry, once: once) { (bytes) throws(ArchiveError) in
                if sha256 != nil { hasher.update(bufferPointer: bytes) }
                try write(bytes)
            }
            if let sha256, Hex.encode(hasher.finalize()) != sha256 {
                throw .corrupt("entry '\(entry.path)' of \(reader.path) does not match the SHA-256 its manifest gives: download it again")
            }
        }
    }

    /// Copies an installed file where a hard link cannot be made, checking its SHA-256.
    private static func copy(_ source: String, to target: String, sha256: String, syncs: BackgroundSync?) throws(ArchiveError) {
        let input = try openFile(source)
        defer { try? input.close() }
        try makeFile(target, syncs: syncs) { (write) throws(ArchiveError) in
            var hasher = SHA256()
            var offset: UInt64 = 0
            while true {
                let chunk = try readFully(input, at: offset, count: 1 << 20, path: source)
                if chunk.isEmpty { break }
                hasher.update(data: chunk)
                try withBytes(chunk) { (raw) throws(ArchiveError) in try write(raw) }
                offset += UInt64(chunk.count)
            }
            guard Hex.encode(hasher.finalize()) == sha256 else {
                throw .corrupt("\(source) changed since it was installed: it will be downloaded again")
            }
        }
    }

    /// Creates `target` and has `fill` write it through the function it is given; then hands
    /// the file to `syncs` (which closes it once synced) or closes it. Closed on any error.
    private static func makeFile(
        _ target: String, syncs: BackgroundSync?, dropsBehind: Bool = false,
        _ fill: (_ write: (UnsafeRawBufferPointer) throws(ArchiveError) -> Void) throws(ArchiveError) -> Void
    ) throws(ArchiveError) {
        let fd = try create(target)
        // A large file goes to the disk while the rest of it is written, not all at the end.
        var writeback = Writeback(step: 4 << 20, dropsBehind: dropsBehind)
        var written: UInt64 = 0
        do throws(ArchiveError) {
            try fill { (bytes) throws(ArchiveError) in
                _ = try systemCall("write", target) { try fd.writeAll(bytes) }
                written += UInt64(bytes.count)
                if syncs != nil { writeback.wrote(upTo: written, fd: fd) }
            }
        } catch {
            try? fd.close()
            throw error
        }
        if let syncs { syncs.sync(fd, path: target) } else { try? fd.close() }
    }

    private static func create(_ target: String) throws(ArchiveError) -> FileDescriptor {
        try systemCall("create", target) {
            try FileDescriptor.open(
                target, .writeOnly, options: [.create, .exclusiveCreate, .noFollow],
                permissions: [.ownerReadWrite, .groupRead, .otherRead])
        }
    }

    static func makeParents(of path: String, root: String, made: inout Set<String>) throws(ArchiveError) {
        // At '/' bytes, as the file system splits (``validateEntryPath`` refuses what else could differ).
        let components = Array(path.utf8).split(separator: UInt8(ascii: "/")).dropLast()
        var current = ""
        for component in components {
            let name = String(decoding: component, as: UTF8.self)
            current += current.isEmpty ? name : "/" + name
            if made.contains(current) { continue }
            let full = root + "/" + current
            if mkdir(full, 0o755) != 0 && errno != EEXIST { throw ioError(errno, action: "create folder", path: full) }
            made.insert(current)
        }
    }
}

/// Syncs the files and folders an extraction wrote on a thread of its own, in the order handed
/// over, while the next files are inflated and written.
///
/// Why: an update of 157 files synced each one as it was written, and the 215 syncs (files and
/// folders) took most of its install, the disk idle while a file was inflated and the processor
/// idle while one was synced. At most 64 files wait, so open descriptors stay bounded.
final class BackgroundSync: @unchecked Sendable {
    private let queue = BoundedQueue(label: "iap-extract.sync", limit: 64)
    /// Touched only on `queue`: the first sync that failed.
    private var failure: ArchiveError?

    /// Syncs and then closes `fd`, the file at `path`.
    func sync(_ fd: FileDescriptor, path: String) {
        // The disk starts on the file now, beside those before it: `fsync` alone keeps one file
        // in flight at a time, and the disk waits between them.
        Writeback.startAll(fd)
        queue.async(holding: 1) { [self] in
            if failure == nil && fsync(fd.rawValue) != 0 { failure = ioError(errno, action: "sync", path: path) }
            try? fd.close()
        }
    }

    func sync(directory path: String) {
        queue.async(holding: 1) { [self] in
            guard failure == nil else { return }
            do throws(ArchiveError) { try syncDirectory(path) } catch { failure = error }
        }
    }

    /// Waits for everything handed over; throws the first failure.
    func finish() throws(ArchiveError) {
        if let failure = queue.sync({ failure }) { throw failure }
    }

    /// Waits for everything handed over (every descriptor closed), without asking how it went.
    func waitForAll() { queue.sync {} }
}

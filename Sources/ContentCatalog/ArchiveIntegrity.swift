import Crypto
import DurableFiles
import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What is wrong with a published version's files in the archive folder.
public enum ArchiveDamage: Sendable, Equatable {
    /// No archive file at its path.
    case missing
    /// The archive file's size is not the published size: cut short, or overwritten.
    case wrongSize(onDisk: Int64)
    /// The archive file has the published size but other bytes.
    case wrongDigest(onDisk: String)
    /// The archive or its manifest cannot be read (permissions, an I/O error): the reason,
    /// naming the file and the fix.
    case unreadable(String)
    /// The manifest the server computed at publish is not there.
    case manifestMissing
    /// The manifest file is there with other bytes than were published.
    case manifestWrongDigest(onDisk: String)

    /// A short name for JSON and metrics.
    public var code: String {
        switch self {
        case .missing: "missing"
        case .wrongSize: "wrong-size"
        case .wrongDigest: "wrong-sha256"
        case .unreadable: "unreadable"
        case .manifestMissing: "manifest-missing"
        case .manifestWrongDigest: "manifest-wrong-sha256"
        }
    }

    /// What is wrong with `version`'s files at `store`, and how to put it right.
    public func message(for version: PublishedVersion, in store: ContentStore) -> String {
        let archive = store.archivePath(sha256: version.sha256)
        let what = "\(version.productId) \(version.contentVersion)"
        let repair = "publish the version's archive again (iap-server publish, or PUT /v1/admin/archives) to repair it"
        switch self {
        case .missing:
            let fetched = version.originURL.map { " (a replica with its own archive folder fetches it from \($0) while it runs)" } ?? ""
            return "\(what): its archive \(archive) is missing\(fetched): \(repair)"
        case .wrongSize(let size):
            return "\(what): \(archive) is \(size) bytes, not the \(version.size) published (cut short or overwritten): \(repair)"
        case .wrongDigest(let digest):
            return "\(what): \(archive) has SHA-256 \(digest), not the published \(version.sha256) (damaged on disk): \(repair)"
        case .unreadable(let reason):
            return "\(what): \(reason)"
        case .manifestMissing:
            return "\(what): its manifest \(store.manifestPath(sha256: version.sha256)) is missing (without it, updates to this version are whole downloads, not deltas): \(repair)"
        case .manifestWrongDigest(let digest):
            return
                "\(what): its manifest \(store.manifestPath(sha256: version.sha256)) has SHA-256 \(digest), not the published \(version.manifestSHA256 ?? ""): \(repair)"
        }
    }
}

/// What ``ContentStore/checkArchives(readingContents:found:)`` found.
public struct ArchiveCheckReport: Sendable {
    /// The published versions looked at (removed versions have no files to check).
    public var checked: Int = 0
    /// Archive and manifest bytes read and hashed (0 for a check of sizes only).
    public var bytesRead: Int64 = 0
    /// Each damaged version with what is wrong with it, in catalog order.
    public var damaged: [(version: PublishedVersion, damage: ArchiveDamage)] = []
}

extension ContentStore {
    /// Looks at every published version's archive and manifest: that each is there, of the
    /// published size, and (with `readingContents`) of the published SHA-256. Reads each file
    /// once, in large chunks, on a dispatch queue, with memory flat in the archives' sizes;
    /// pages of the page cache that the read brought in are dropped again, so a check on a live
    /// server does not push out the archives it is serving. `found` is called with each damaged
    /// version as it is found (a check of a large store takes minutes).
    public func checkArchives(
        readingContents: Bool = true, found: @escaping @Sendable (PublishedVersion, ArchiveDamage) -> Void = { _, _ in }
    ) async throws(CatalogError) -> ArchiveCheckReport {
        var report = ArchiveCheckReport()
        for version in try await database.versions(productId: nil) where version.removedAt == nil {
            let (damage, read) = try await Self.offload { () throws(CatalogError) in self.damage(of: version, readingContents: readingContents) }
            report.checked += 1
            report.bytesRead += read
            if let damage {
                report.damaged.append((version, damage))
                found(version, damage)
            }
        }
        return report
    }

    /// What is wrong with `version`'s files, if anything, and the bytes read to tell. Without
    /// `readingContents`, only what `stat` tells: presence and size (for readiness, and a
    /// quick check), and other bytes at the published size that an earlier read in this process
    /// found in the file as it still is (``recordedDigest(sha256:stamp:)``). Without
    /// `includingManifest`, the archive alone (what serving needs).
    /// Blocks: call it off the event loops and the concurrency pool.
    public func damage(of version: PublishedVersion, readingContents: Bool, includingManifest: Bool = true) -> (ArchiveDamage?, Int64) {
        let path = archivePath(sha256: version.sha256)
        var info = stat()
        guard stat(path, &info) == 0 else {
            return (errno == ENOENT ? .missing : .unreadable(ioFailureMessage(errno, action: "read", path: path)), 0)
        }
        guard Int64(info.st_size) == version.size else { return (.wrongSize(onDisk: Int64(info.st_size)), 0) }
        guard access(path, R_OK) == 0 else { return (.unreadable(ioFailureMessage(errno, action: "read", path: path)), 0) }
        let manifest = manifestPath(sha256: version.sha256)
        let stamp = FileIdentity(info)
        guard readingContents else {
            if let digest = recordedDigest(sha256: version.sha256, stamp: stamp) { return (.wrongDigest(onDisk: digest), 0) }
            return (includingManifest && version.manifestSHA256 != nil && access(manifest, F_OK) != 0 ? .manifestMissing : nil, 0)
        }
        var read: Int64 = 0
        switch FileDigest.sha256(path) {
        case .failure(let error): return (.unreadable(error.message), read)
        case .success(let (size, digest)):
            read += size
            guard size == version.size else { return (.wrongSize(onDisk: size), read) }
            // Kept under the file's stamp from before the read: a repair that renamed a new file
            // over it meanwhile has another, and is not taken for the damaged one.
            rotten.withLock { $0[version.sha256] = digest == version.sha256 ? nil : (stamp, digest) }
            shareFind(sha256: version.sha256, stamp: stamp, digest: digest == version.sha256 ? nil : digest)
            guard digest == version.sha256 else { return (.wrongDigest(onDisk: digest), read) }
        }
        guard includingManifest, let published = version.manifestSHA256 else { return (nil, read) }
        guard access(manifest, F_OK) == 0 else { return (.manifestMissing, read) }
        switch FileDigest.sha256(manifest) {
        case .failure(let error): return (.unreadable(error.message), read)
        case .success(let (size, digest)):
            read += size
            return (digest == published ? nil : .manifestWrongDigest(onDisk: digest), read)
        }
    }
}

extension ContentStore {
    /// Reads `version`'s archive through (off the concurrency pool, its pages dropped after, as
    /// ``checkArchives(readingContents:found:)`` does) and returns the damage when its bytes are
    /// not the published ones at the published size and this was not known of the file as it is:
    /// from then on ``damage(of:readingContents:includingManifest:)`` reports it without reading.
    /// Nil for an intact archive, one already known damaged, and one missing or of another size
    /// (what `stat` tells is the readiness check's and the replicas' catch-up's to find).
    public func findRot(in version: PublishedVersion) async -> ArchiveDamage? {
        guard let before = FileIdentity.of(archivePath(sha256: version.sha256)) else { return nil }
        // Known to this process: a find another one recorded (`check`, a replica sharing the
        // folder) is new here, and logged and counted here too.
        let known = foundHere(sha256: version.sha256, stamp: before) != nil
        let damage = try? await Self.offload { () throws(CatalogError) in self.damage(of: version, readingContents: true, includingManifest: false).0 }
        guard case .wrongDigest? = damage, !known else { return nil }
        // Readiness looks again rather than answering from its last "ready".
        forgetReady()
        return damage
    }

    /// The SHA-256 an earlier read found in archive `sha256` (other than the published one)
    /// while the file was as `stamp` says: a read in this process, or one by any process using
    /// the same archive folder (``damageRecordPath(sha256:)``); nil when none was found or the
    /// file has changed since (renamed over, written again in place, its mode changed).
    public func recordedDigest(sha256: String, stamp: FileIdentity) -> String? {
        foundHere(sha256: sha256, stamp: stamp) ?? sharedFind(sha256: sha256, stamp: stamp)
    }

    /// What a read in this process found (``rotten``), for the file as `stamp` says.
    private func foundHere(sha256: String, stamp: FileIdentity) -> String? {
        rotten.withLock { $0[sha256] }.flatMap { $0.stamp == stamp ? $0.digest : nil }
    }

    /// Where a read that found archive `sha256` damaged records it, beside the archive: every
    /// process serving from this folder refuses the file while it is as it was found (`iap-server
    /// check` run by the shipped timer, replicas sharing one folder, the replica whose periodic
    /// read found it), where a record in one process's memory left the others serving bytes that
    /// fail every device's SHA-256. Removed when the file is put back (published or fetched again,
    /// or removed) or read intact.
    public func damageRecordPath(sha256: String) -> String { archivesDirectory + "/" + sha256 + ".damaged.json" }

    /// What a damage record holds: the digest found and the file it was found in. Not the
    /// device number: on a network file system each client mounts with its own.
    private struct DamageRecord: Codable {
        var sha256Found: String
        var inode: UInt64
        var size: UInt64
        var modifiedNanoseconds: Int64
        var changedNanoseconds: Int64

        func describes(_ stamp: FileIdentity) -> Bool {
            inode == stamp.inode && size == stamp.size && modifiedNanoseconds == stamp.modified && changedNanoseconds == stamp.changed
        }
    }

    /// Records (`digest`) or clears (nil) the find of a read of archive `sha256` for the other
    /// processes. Best effort: a folder this process cannot write (a replica mounting the shared
    /// folder read-only) keeps the find in its memory alone, as before.
    private func shareFind(sha256: String, stamp: FileIdentity, digest: String?) {
        let path = damageRecordPath(sha256: sha256)
        guard let digest else {
            unlink(path)
            return
        }
        let record = DamageRecord(
            sha256Found: digest, inode: stamp.inode, size: stamp.size, modifiedNanoseconds: stamp.modified, changedNanoseconds: stamp.changed)
        guard let data = try? JSONEncoder().encode(record) else { return }
        try? AtomicFile.write(data, to: path, permissions: 0o644, durability: .processKill)
    }

    private func sharedFind(sha256: String, stamp: FileIdentity) -> String? {
        let path = damageRecordPath(sha256: sha256)
        // Nearly always absent: one system call (readiness asks this of every published archive).
        guard access(path, F_OK) == 0, let data = FileManager.default.contents(atPath: path),
            let record = try? JSONDecoder().decode(DamageRecord.self, from: data), record.describes(stamp)
        else { return nil }
        return record.sha256Found
    }
}

/// A file's SHA-256, read once in large chunks.
///
/// Written with `pread` and `mincore` rather than `FileHandle`: the pages this read brings into
/// the page cache are dropped again (`POSIX_FADV_DONTNEED`) while those that were there before
/// stay, so checking a store of hundreds of GiB on a serving machine leaves the cache holding
/// what downloads use. Linux's cache would keep its active pages through one sequential scan, but
/// not the recently served archives still on its inactive list.
enum FileDigest {
    static let chunkSize = 8 << 20

    static func sha256(_ path: String) -> Result<(Int64, String), DurableFileError> {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return .failure(failure(path)) }
        defer { close(fd) }
        var info = stat()
        guard fstat(fd, &info) == 0 else { return .failure(failure(path)) }
        let size = Int64(info.st_size)
        _ = posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL)
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: chunkSize, alignment: 4096)
        defer { buffer.deallocate() }
        let page = Int64(sysconf(Int32(_SC_PAGESIZE)))
        // Taken once for the whole file: readahead brings in pages past each chunk, which a
        // look per chunk would take for pages cached before.
        let resident = size > 0 ? residentPages(fd, count: Int(size), page: page) : nil
        var hasher = SHA256()
        var offset: Int64 = 0
        while true {
            // Past the size fstat gave, one more read tells whether the file grew meanwhile.
            let count = pread(fd, buffer.baseAddress, chunkSize, off_t(offset))
            if count < 0 {
                if errno == EINTR { continue }
                return .failure(failure(path))
            }
            if count == 0 { break }
            hasher.update(bufferPointer: UnsafeRawBufferPointer(rebasing: buffer[0..<count]))
            if let resident { dropPages(fd, offset: offset, count: count, page: page, resident: resident) }
            offset += Int64(count)
        }
        if let resident { dropPages(fd, offset: offset, count: Int(max(size - offset, 0)), page: page, resident: resident) }
        return .success((offset, Hex.encode(hasher.finalize())))
    }

    private static func failure(_ path: String) -> DurableFileError {
        DurableFileError(.io, ioFailureMessage(errno, action: "read", path: path))
    }

    /// Which of the file's pages are in the page cache now (one byte per page, bit 0), from a
    /// mapping that reads nothing; nil when that cannot be told (nothing is dropped then).
    private static func residentPages(_ fd: Int32, count: Int, page: Int64) -> [UInt8]? {
        guard let map = mmap(nil, count, PROT_READ, MAP_SHARED, fd, 0), map != MAP_FAILED else { return nil }
        defer { munmap(map, count) }
        var pages = [UInt8](repeating: 1, count: (count + Int(page) - 1) / Int(page))
        guard mincore(map, count, &pages) == 0 else { return nil }
        return pages
    }

    /// Drops the runs of pages in `offset..<offset+count` that were not cached before the read
    /// began (`offset` is a multiple of the page size: chunks are).
    private static func dropPages(_ fd: Int32, offset: Int64, count: Int, page: Int64, resident: [UInt8]) {
        let first = Int(offset / page)
        let end = min(resident.count, Int((offset + Int64(count) + page - 1) / page))
        for run in coldRuns(resident, from: first, to: end) {
            _ = posix_fadvise(fd, off_t(Int64(run.lowerBound) * page), off_t(Int64(run.count) * page), POSIX_FADV_DONTNEED)
        }
    }

    /// The runs of page indices in `first..<end` that `resident` (`mincore`'s bytes: bit 0 set
    /// for a cached page) says were not cached.
    static func coldRuns(_ resident: [UInt8], from first: Int, to end: Int) -> [Range<Int>] {
        guard first < end else { return [] }
        var runs: [Range<Int>] = []
        var start: Int?
        for index in first...end {
            let cold = index < end && resident[index] & 1 == 0
            if cold, start == nil { start = index }
            if !cold, let from = start {
                runs.append(from..<index)
                start = nil
            }
        }
        return runs
    }
}

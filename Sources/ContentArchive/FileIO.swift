import Dispatch
import DurableFiles
import SystemPackage

#if canImport(Glibc)
    import CLinuxWriteback
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// A write-only file with a user-space buffer: thousands of small headers become few syscalls.
///
/// With `direct`, whole aligned blocks go to the disk with `O_DIRECT`, from a buffer that stays
/// the same, instead of being copied into the page cache: the copy takes CPU the compressors need
/// (docs/performance.md has the figures), and the final fsync then has almost nothing left to
/// write. A second, ordinary descriptor writes what is not a whole aligned block
/// (the end of a flush, a patch); those bytes stay in the buffer, and the next direct write of
/// their block replaces them (the kernel keeps the two paths coherent). File systems without
/// direct I/O (tmpfs) get buffered writes.
///
/// A direct write leaves from a second buffer on a thread of its own while the caller fills the
/// first: written in turn, the copy into the buffer and the wait for the disk added up (0.36-0.43
/// s for an incremental build's 569 MB, against 0.31-0.36 overlapped, in C on this machine; the
/// build's copy and its SHA-256 end about together).
final class BufferedFileWriter {
    let path: String
    private let fd: FileDescriptor
    /// The same file opened with O_DIRECT, when direct writes are wanted and possible.
    private var directFD: FileDescriptor?
    private static let alignment = 4096
    private let capacity: Int
    private var buffer: UnsafeMutableRawPointer
    /// The buffer a direct write is leaving from, or will next (allocated with the first).
    private var spare: UnsafeMutableRawPointer?
    /// The direct write under way, if any; its bytes are in `spare`.
    private var pending: DirectWrite?
    private var filled = 0
    /// File offset of the buffer's first byte: a multiple of `alignment` while writing directly.
    private var bufferStart: UInt64 = 0
    /// Bytes written so far, buffered or not.
    var offset: UInt64 { bufferStart + UInt64(filled) }
    private var closed = false
    /// The kernel's write-back, started every 32 MiB (buffered writes only).
    private var writeback = Writeback(step: 32 << 20)

    /// Whether `finish` syncs to disk (and writing back starts early so that it has less to wait for).
    private let durable: Bool

    /// Creates `path`, which must not exist yet. Without `durable`, nothing is synced: the bytes
    /// reach the disk when the kernel writes them back. Memory: two buffers of `capacity` bytes (a
    /// multiple of 4096) when writing directly, one otherwise.
    init(creating path: String, direct: Bool = false, durable: Bool = true, capacity: Int = 8 << 20) throws(ArchiveError) {
        self.path = path
        self.durable = durable
        self.capacity = capacity
        fd = try systemCall("create", path) {
            try FileDescriptor.open(
                path, .writeOnly, options: [.create, .exclusiveCreate, .truncate],
                permissions: [.ownerReadWrite, .groupRead, .otherRead])
        }
        buffer = UnsafeMutableRawPointer.allocate(byteCount: capacity, alignment: Self.alignment)
        #if os(Linux)
            if direct && cwriteback_o_direct != 0 {
                directFD = try? FileDescriptor.open(path, .writeOnly, options: FileDescriptor.OpenOptions(rawValue: cwriteback_o_direct))
            }
        #endif
    }

    deinit {
        close()
        buffer.deallocate()
        spare?.deallocate()
    }

    func write(_ bytes: [UInt8]) throws(ArchiveError) {
        var failure: ArchiveError?
        bytes.withUnsafeBytes { source in
            do throws(ArchiveError) { try write(source) } catch { failure = error }
        }
        if let failure { throw failure }
    }

    func write(_ source: UnsafeRawBufferPointer) throws(ArchiveError) {
        // Large pieces written through the page cache skip the buffer: one copy fewer.
        if directFD == nil && source.count >= capacity / 4 {
            try writeOut(all: true)
            try writeBuffered(source, at: bufferStart)
            bufferStart += UInt64(source.count)
            startWriteback()
            return
        }
        var done = 0
        while done < source.count {
            let count = min(capacity - filled, source.count - done)
            (buffer + filled).copyMemory(from: source.baseAddress! + done, byteCount: count)
            filled += count
            done += count
            if filled == capacity { try writeOut(all: true) }
        }
    }

    /// Appends bytes `range` of `source` inside the kernel (`copy_file_range`), without passing
    /// them through this process; returns false, having written nothing, where that cannot be
    /// done (direct writes, other systems, a file system or kernel that refuses it), and the
    /// caller writes the bytes itself.
    ///
    /// Why: an incremental build copies most of the previous archive. Written from a mapping of
    /// it, the build's system time varied from 0.25 to 0.92 s between runs (570 MB copied through
    /// user addresses while the archive's hasher read the same bytes on the other core); copied
    /// in the kernel it held 0.31-0.36 s (docs/performance.md).
    func copy(from source: FileDescriptor, range: Range<UInt64>) throws(ArchiveError) -> Bool {
        #if os(Linux)
            guard directFD == nil, copyFileRangeWorks else { return false }
            try writeOut(all: true)
            var from = Int64(range.lowerBound)
            var to = Int64(bufferStart)
            while UInt64(from) < range.upperBound {
                let n = cwriteback_copy_file_range(source.rawValue, &from, fd.rawValue, &to, UInt(range.upperBound - UInt64(from)))
                if n > 0 { continue }
                if n < 0 && errno == EINTR { continue }
                guard UInt64(from) == range.lowerBound else {
                    // Part is in: the file is as far as `to`, and the rest cannot follow the same way.
                    if n == 0 { throw .io("\(path): the source ended \(range.upperBound - UInt64(from)) bytes early while copying") }
                    throw ioError(errno, action: "copy into", path: path)
                }
                copyFileRangeWorks = false
                return false
            }
            bufferStart = UInt64(to)
            startWriteback()
            return true
        #else
            return false
        #endif
    }

    /// Cleared at the first refusal of `copy_file_range`, so later copies do not ask again.
    private var copyFileRangeWorks = true

    /// Writes the buffer out. Directly, only whole aligned blocks leave the buffer; with `all`
    /// false the rest is also written through the ordinary descriptor but kept.
    private func writeOut(all: Bool) throws(ArchiveError) {
        guard filled > 0 else { return }
        if directFD != nil {
            let aligned = filled & ~(Self.alignment - 1)
            if aligned > 0 {
                // The full buffer leaves behind; the rest of its last block moves to the other,
                // which is filled meanwhile.
                try awaitDirectWrite()
                let next = spare ?? UnsafeMutableRawPointer.allocate(byteCount: capacity, alignment: Self.alignment)
                next.copyMemory(from: buffer + aligned, byteCount: filled - aligned)
                spare = buffer
                buffer = next
                try startDirectWrite(count: aligned)
                bufferStart += UInt64(aligned)
                filled -= aligned
            }
            if !all {
                // Flushed: the file must hold every byte when this returns.
                try awaitDirectWrite()
            }
            if directFD != nil {
                if !all && filled > 0 {
                    try writeBuffered(UnsafeRawBufferPointer(start: buffer, count: filled), at: bufferStart)
                }
                return
            }
            // Direct I/O was refused: the rest goes the ordinary way, as everything after it will.
        }
        try writeBuffered(UnsafeRawBufferPointer(start: buffer, count: filled), at: bufferStart)
        bufferStart += UInt64(filled)
        filled = 0
        startWriteback()
    }

    /// Starts writing `spare`'s first `count` bytes (a multiple of the alignment) at
    /// `bufferStart` with O_DIRECT, on the writer's thread. Whatever direct I/O will not take (a
    /// short write at a size limit, a file system that refuses it) goes through the ordinary
    /// descriptor, which reports the real error, and direct writing stops (at the next wait).
    private func startDirectWrite(count: Int) throws(ArchiveError) {
        guard let bytes = spare else { return }
        guard let direct = directFD else {
            // Refused by the write just waited for: these go the ordinary way, as all later ones.
            try writeBuffered(UnsafeRawBufferPointer(start: bytes, count: count), at: bufferStart)
            return
        }
        let write = DirectWrite(
            direct: direct.rawValue, ordinary: fd.rawValue, bytes: bytes, count: count, offset: bufferStart, path: path, alignment: Self.alignment)
        pending = write
        Self.writerQueue.async { write.run() }
    }

    /// Waits for the direct write under way, if any, and reports how it went.
    private func awaitDirectWrite() throws(ArchiveError) {
        guard let write = pending else { return }
        pending = nil
        write.done.wait()
        if write.directRefused {
            try? directFD?.close()
            directFD = nil
        }
        if let error = write.error { throw error }
    }

    /// One thread writes for every writer: a build writes one archive at a time.
    private static let writerQueue = DispatchQueue(label: "iap-pack.direct-writes")

    private func writeBuffered(_ bytes: UnsafeRawBufferPointer, at position: UInt64) throws(ArchiveError) {
        _ = try systemCall("write", path) { try fd.writeAll(toAbsoluteOffset: Int64(position), bytes) }
    }

    /// Starts the disk writing what has piled up, without waiting: with gigabytes of RAM the
    /// kernel would otherwise hold it all until `finish`'s fsync, which then waited for the whole
    /// archive with both cores idle.
    private func startWriteback() {
        if durable { writeback.wrote(upTo: bufferStart, fd: fd) }
    }

    /// Overwrites bytes already written (a header whose sizes were not known yet).
    func patch(at position: UInt64, _ bytes: [UInt8]) throws(ArchiveError) {
        try flush()
        // Bytes still in the buffer are written again by the next direct write: patch them there too.
        if position + UInt64(bytes.count) > bufferStart {
            for (index, byte) in bytes.enumerated() where position + UInt64(index) >= bufferStart {
                buffer.storeBytes(of: byte, toByteOffset: Int(position + UInt64(index) - bufferStart), as: UInt8.self)
            }
        }
        _ = try systemCall("write", path) { try bytes.withUnsafeBytes { try fd.writeAll(toAbsoluteOffset: Int64(position), $0) } }
    }

    /// Puts everything written so far in the file.
    func flush() throws(ArchiveError) {
        try writeOut(all: false)
        try awaitDirectWrite()
    }

    /// Flushes, syncs to disk and closes.
    func finish() throws(ArchiveError) {
        try flush()
        guard !durable || fsync(fd.rawValue) == 0 else { throw ioError(errno, action: "sync", path: path) }
        close()
    }

    /// Closes (once) and deletes the file.
    func abandon() {
        close()
        unlink(path)
    }

    private func close() {
        guard !closed else { return }
        closed = true
        // The writer's thread may still be using the descriptors.
        pending?.done.wait()
        pending = nil
        try? directFD?.close()
        directFD = nil
        try? fd.close()
    }
}

/// A direct write on the writer's thread. Its fields are read by the thread that started it only
/// after `done` is signalled.
private final class DirectWrite: @unchecked Sendable {
    let direct: CInt
    let ordinary: CInt
    let bytes: UnsafeMutableRawPointer
    let count: Int
    let offset: UInt64
    let path: String
    let alignment: Int
    let done = DispatchSemaphore(value: 0)
    var error: ArchiveError?
    /// Direct I/O did not take it all: the rest went through `ordinary`, as all later writes will.
    var directRefused = false

    init(direct: CInt, ordinary: CInt, bytes: UnsafeMutableRawPointer, count: Int, offset: UInt64, path: String, alignment: Int) {
        self.direct = direct
        self.ordinary = ordinary
        self.bytes = bytes
        self.count = count
        self.offset = offset
        self.path = path
        self.alignment = alignment
    }

    /// For tests, as iap-fetch's `IAP_FETCH_REFUSE=direct-write` (its `Failpoint`): every direct
    /// write but one at the file's start refused, as by a file system that opens files for direct
    /// I/O but takes no writes of 4096-byte blocks (`EINVAL`).
    private static let refused = getenv("IAP_FETCH_REFUSE").map { String(cString: $0) } == "direct-write"

    func run() {
        defer { done.signal() }
        var written = 0
        while written < count {
            let n = offset > 0 && Self.refused ? -1 : pwrite(direct, bytes + written, count - written, off_t(offset) + off_t(written))
            if n > 0 && n % alignment == 0 {
                written += n
                continue
            }
            if n < 0 && errno == EINTR { continue }
            directRefused = true
            do throws(ArchiveError) {
                _ = try systemCall("write", path) {
                    try FileDescriptor(rawValue: ordinary).writeAll(
                        toAbsoluteOffset: Int64(offset) + Int64(written), UnsafeRawBufferPointer(start: bytes + written, count: count - written))
                }
            } catch {
                self.error = error
            }
            return
        }
    }
}

/// Starts the kernel writing a file's bytes to the disk without waiting for it (Linux;
/// elsewhere nothing), so that the `fsync` at the end finds them on their way: with gigabytes of
/// RAM the kernel would otherwise hold them until then, and the disk would idle meanwhile.
struct Writeback {
    /// Bytes written between two starts.
    let step: UInt64
    /// How far write-back has been started from the file's beginning.
    private var started: UInt64 = 0
    /// Which written-back pages to let go of, when they are (see ``init(step:dropsBehind:)``).
    private var drops: DropBehind?

    /// `dropsBehind`: the page cache lets go of the pages once written back (a file nobody reads
    /// again soon), two steps behind where write-back was last started, so the next bytes are
    /// written into pages just freed rather than fresh ones (``DropBehind``).
    init(step: UInt64, dropsBehind: Bool = false) {
        self.step = step
        drops = dropsBehind ? DropBehind(from: 0, step: 2 * Int64(step)) : nil
    }

    /// The file now holds `written` bytes: starts write-back of those not started yet, once a
    /// `step` of them has piled up.
    mutating func wrote(upTo written: UInt64, fd: FileDescriptor) {
        #if os(Linux)
            guard written >= started + step else { return }
            sync_file_range(fd.rawValue, Int64(started), Int64(written - started), cwriteback_start)
            started = written
            if let range = drops?.advance(to: Int64(started) - 2 * Int64(step)) {
                DropBehind.release(range, of: fd.rawValue)
            }
        #endif
    }

    /// Starts write-back of all of `fd`'s file.
    static func startAll(_ fd: FileDescriptor) {
        #if os(Linux)
            sync_file_range(fd.rawValue, 0, 0, cwriteback_start)
        #endif
    }
}

/// Bytes of a file mapped read-only, unmapped when the last holder lets go.
///
/// The packer copies a previous archive's reused bytes through a mapping rather than `pread`
/// into arrays: the writer and both hashers then read the page cache itself, and the one copy
/// left is the write into the new archive (the reads' copies cost the writer's thread as much as
/// the write). Mappings are a few MiB each and live only until hashed, so memory stays flat. The
/// file must keep its size while mapped: its size was checked against its manifest before. The
/// downloader hashes its partial file the same way (it is the only writer, and does not truncate
/// while a mapping lives).
package final class MappedBytes: @unchecked Sendable {
    package let bytes: UnsafeRawBufferPointer
    private let mapping: UnsafeMutableRawPointer
    private let length: Int

    /// Maps bytes `range` of `fd` (a non-empty range within the file).
    package init(_ fd: FileDescriptor, range: Range<UInt64>, path: String) throws(ArchiveError) {
        let page = UInt64(sysconf(Int32(_SC_PAGESIZE)))
        let start = range.lowerBound / page * page
        length = Int(range.upperBound - start)
        // Populated at once: the pages are in the page cache already, and one call maps them all.
        guard let mapped = mmap(nil, length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd.rawValue, off_t(start)), mapped != MAP_FAILED else {
            throw ioError(errno, action: "map", path: path)
        }
        mapping = mapped
        bytes = UnsafeRawBufferPointer(start: mapped + Int(range.lowerBound - start), count: range.count)
    }

    deinit { munmap(mapping, length) }
}

/// Reads exactly `count` bytes at `offset`, or fewer only at the end of the file.
func readFully(_ fd: FileDescriptor, at offset: UInt64, count: Int, path: String) throws(ArchiveError) -> [UInt8] {
    // Uninitialized: zero-filling first cost a pass over every byte packed. Only what read()
    // filled is counted as initialized.
    var failure: ArchiveError?
    let result = [UInt8](unsafeUninitializedCapacity: count) { buffer, initialized in
        let raw = UnsafeMutableRawBufferPointer(buffer)
        while initialized < count {
            do throws(ArchiveError) {
                let n = try systemCall("read", path) {
                    try fd.read(
                        fromAbsoluteOffset: Int64(offset) + Int64(initialized),
                        into: UnsafeMutableRawBufferPointer(rebasing: raw[initialized...]))
                }
                if n == 0 { break }
                initialized += n
            } catch {
                failure = error
                return
            }
        }
    }
    if let failure { throw failure }
    return result
}

/// A finished file moved to its final name by ``PlacedFile/move(_:to:)``. A file it replaced
/// waits under the temporary name until ``commit()`` removes it, or ``rollback()`` puts it back.
struct PlacedFile {
    let path: String
    let temp: String
    /// Whether a file was at `path` before (it is at `temp` now).
    let replaced: Bool

    /// Moves `temp` to `path`. A regular file already at `path` is swapped with `temp` in one step
    /// (`renameat2` with `RENAME_EXCHANGE`) rather than renamed over.
    ///
    /// Why: when a rename replaces a file, ext4 (its `auto_da_alloc` guard for programs that skip
    /// fsync) allocates and starts writing back the new file there and then. A `--no-sync`
    /// incremental build of 540 MB into a folder holding the last build's archive took 1.3-2.1 s
    /// instead of 0.6 s, most of it in that rename. The swap also lets a failed build put the
    /// last build's archive back.
    static func move(_ temp: String, to path: String) throws(ArchiveError) -> PlacedFile {
        #if os(Linux)
            var info = stat()
            if lstat(path, &info) == 0 && info.st_mode & S_IFMT == S_IFREG {
                if cwriteback_exchange(temp, path) == 0 { return PlacedFile(path: path, temp: temp, replaced: true) }
                // EINVAL or ENOSYS: a file system or kernel without exchange; a rename does it.
                guard errno == EINVAL || errno == ENOSYS else { throw ioError(errno, action: "rename into", path: path) }
            }
        #endif
        guard rename(temp, path) == 0 else { throw ioError(errno, action: "rename into", path: path) }
        return PlacedFile(path: path, temp: temp, replaced: false)
    }

    /// Removes the replaced file, if any.
    func commit() {
        if replaced { unlink(temp) }
    }

    /// Puts back what was at `path` before, or removes the new file when nothing was.
    func rollback() {
        #if os(Linux)
            if replaced && cwriteback_exchange(temp, path) == 0 {
                unlink(temp)
                return
            }
        #endif
        unlink(path)
    }
}

/// Makes a folder and its parents, like `mkdir -p`.
func makeDirectories(_ path: String) throws(ArchiveError) {
    do { try Directory.create(path) } catch { throw .io(error.message) }
}

/// Syncs a folder so that renames into it survive a crash.
func syncDirectory(_ path: String) throws(ArchiveError) {
    do { try Directory.sync(path) } catch { throw .io(error.message) }
}

/// Runs a swift-system call, turning its `Errno` into an ``ArchiveError`` that names the path.
func systemCall<T>(_ action: String, _ path: String, _ body: () throws -> T) throws(ArchiveError) -> T {
    do {
        return try body()
    } catch let error as Errno {
        throw ioError(error.rawValue, action: action, path: path)
    } catch {
        throw .io("cannot \(action) \(path): \(error)")
    }
}

/// Opens a file, turning the failure into an ``ArchiveError`` that names the path.
func openFile(
    _ path: String, _ mode: FileDescriptor.AccessMode = .readOnly,
    action: String = "read"
) throws(ArchiveError) -> FileDescriptor {
    try systemCall(action, path) { try FileDescriptor.open(path, mode) }
}

import SystemPackage
#if canImport(Glibc)
import CLinuxWriteback
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A write-only file with a user-space buffer: thousands of small headers become few syscalls,
/// while large chunks go straight through.
final class BufferedFileWriter {
    let path: String
    private let fd: FileDescriptor
    private var buffer: [UInt8] = []
    private let bufferLimit = 1 << 20
    /// Bytes written so far, buffered or not.
    private(set) var offset: UInt64 = 0
    private var closed = false
    /// How far the kernel's write-back has been started.
    private var writebackStarted: UInt64 = 0
    private let writebackStep: UInt64 = 32 << 20

    /// Creates `path`, which must not exist yet.
    init(creating path: String) throws(ArchiveError) {
        self.path = path
        fd = try systemCall("create", path) {
            try FileDescriptor.open(path, .writeOnly, options: [.create, .exclusiveCreate, .truncate],
                                    permissions: [.ownerReadWrite, .groupRead, .otherRead])
        }
        buffer.reserveCapacity(bufferLimit)
    }

    func write(_ bytes: [UInt8]) throws(ArchiveError) {
        offset += UInt64(bytes.count)
        if buffer.count + bytes.count <= bufferLimit {
            buffer.append(contentsOf: bytes)
            return
        }
        try flush()
        if bytes.count >= bufferLimit / 2 {
            try writeAll(bytes)
        } else {
            buffer.append(contentsOf: bytes)
        }
        startWriteback()
    }

    /// Starts the disk writing what has piled up, without waiting: with gigabytes of RAM the
    /// kernel would otherwise hold it all until `finish`'s fsync, which then waited for the whole
    /// archive with both cores idle.
    private func startWriteback() {
        #if os(Linux)
        let written = offset - UInt64(buffer.count)  // what the kernel has
        if written - writebackStarted >= writebackStep {
            sync_file_range(fd.rawValue, Int64(writebackStarted), Int64(written - writebackStarted), cwriteback_start)
            writebackStarted = written
        }
        #endif
    }

    /// Overwrites bytes already written (a header whose sizes were not known yet).
    func patch(at position: UInt64, _ bytes: [UInt8]) throws(ArchiveError) {
        try flush()
        _ = try systemCall("write", path) {
            try bytes.withUnsafeBytes { try fd.writeAll(toAbsoluteOffset: Int64(position), $0) }
        }
    }

    func flush() throws(ArchiveError) {
        guard !buffer.isEmpty else { return }
        try writeAll(buffer)
        buffer.removeAll(keepingCapacity: true)
    }

    private func writeAll(_ bytes: [UInt8]) throws(ArchiveError) {
        _ = try systemCall("write", path) { try bytes.withUnsafeBytes { try fd.writeAll($0) } }
    }

    /// Flushes, syncs to disk and closes.
    func finish() throws(ArchiveError) {
        try flush()
        guard fsync(fd.rawValue) == 0 else { throw ioError(errno, action: "sync", path: path) }
        closed = true
        try? fd.close()
    }

    /// Closes (once) and deletes the file.
    func abandon() {
        if !closed { try? fd.close() }
        closed = true
        unlink(path)
    }
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
                    try fd.read(fromAbsoluteOffset: Int64(offset) + Int64(initialized),
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

/// Makes a folder and its parents, like `mkdir -p`.
func makeDirectories(_ path: String) throws(ArchiveError) {
    var current = path.hasPrefix("/") ? "" : "."
    for component in path.split(separator: "/") {
        current += "/" + component
        if mkdir(current, 0o755) != 0 && errno != EEXIST {
            throw ioError(errno, action: "create folder", path: current)
        }
    }
    var info = stat()
    guard stat(path, &info) == 0, info.st_mode & S_IFMT == S_IFDIR else {
        throw .io("\(path) exists and is not a folder: choose another output folder")
    }
}

/// Syncs a folder so that renames into it survive a crash.
func syncDirectory(_ path: String) {
    let fd = open(path, O_RDONLY | O_DIRECTORY)
    guard fd >= 0 else { return }
    fsync(fd)
    close(fd)
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
func openFile(_ path: String, _ mode: FileDescriptor.AccessMode = .readOnly,
              action: String = "read") throws(ArchiveError) -> FileDescriptor {
    try systemCall(action, path) { try FileDescriptor.open(path, mode) }
}

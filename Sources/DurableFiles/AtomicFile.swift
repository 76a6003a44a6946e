import Foundation
import IAPProtocol

#if os(Linux)
    import CLinuxWriteback
#endif

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// How far a replaced file must survive.
public enum Durability: Sendable {
    /// A killed process or a power cut leaves the old contents or the new: the file is synced
    /// before the rename and the folder after it.
    case powerLoss
    /// A killed process leaves the old contents or the new (the rename is atomic), but after a
    /// power cut the file may hold the old contents: no fsync, for files rewritten often whose
    /// loss costs only repeated work.
    case processKill
}

/// Whole-file writes that never leave a mix of old and new bytes.
///
/// On Linux the bytes are written to a file with no name yet (`O_TMPFILE`), which is named only
/// once complete: a process killed while writing leaves nothing behind in the folder. Elsewhere,
/// and where the file system cannot hold unnamed files, they go to a temporary sibling instead.
public enum AtomicFile {
    /// Replaces (or creates) `path` with `data`: written, synced when `durability` asks for it,
    /// and renamed over `path`.
    public static func write(
        _ data: Data, to path: String, permissions: mode_t = 0o600,
        durability: Durability = .powerLoss
    ) throws(DurableFileError) {
        let sync = durability == .powerLoss
        var temp = temporaryName(for: path)
        let unnamed = try Unnamed(data, beside: path, permissions: permissions, sync: sync)
        if unnamed?.link(to: temp) != 0 {
            temp = try writeTemporary(data, beside: path, permissions: permissions, sync: sync)
        }
        guard rename(temp, path) == 0 else {
            let code = errno
            unlink(temp)
            throw .io("replace", path, errno: code)
        }
        if sync { try Directory.sync(parent(of: path)) }
    }

    /// Creates `path` with `data`, complete or not at all, and only if it does not exist: a
    /// second process creating the same file at the same moment gets `.exists` and keeps the
    /// first one's (a `link` of a synced file, which fails when the name is taken).
    public static func create(_ data: Data, at path: String, permissions: mode_t = 0o600) throws(DurableFileError) {
        if let unnamed = try Unnamed(data, beside: path, permissions: permissions, sync: true) {
            switch unnamed.link(to: path) {
            case 0:
                return try Directory.sync(parent(of: path))
            case EEXIST:
                throw DurableFileError(.exists, "\(path) exists already")
            case let code where code != ENOENT:
                throw .io("create", path, errno: code)
            default:
                break  // no /proc to link through: a named temporary below
            }
        }
        let temp = try writeTemporary(data, beside: path, permissions: permissions, sync: true)
        defer { unlink(temp) }
        guard link(temp, path) == 0 else {
            let code = errno
            if code == EEXIST { throw DurableFileError(.exists, "\(path) exists already") }
            throw .io("create", path, errno: code)
        }
        try Directory.sync(parent(of: path))
    }

    private static func temporaryName(for path: String) -> String {
        path + ".tmp-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
    }

    private static func writeTemporary(_ data: Data, beside path: String, permissions: mode_t, sync: Bool) throws(DurableFileError) -> String {
        let temp = temporaryName(for: path)
        let fd = open(temp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, permissions)
        guard fd >= 0 else { throw .io("write", path, errno: errno) }
        var failure = data.withUnsafeBytes { writeFully(fd, $0) }
        if failure == 0, sync, fsync(fd) != 0 { failure = errno }
        close(fd)
        guard failure == 0 else {
            unlink(temp)
            throw .io("write", path, errno: failure)
        }
        return temp
    }

    /// A complete (and synced, when asked) file in a folder under no name: closing it unlinked
    /// frees it, so an interrupted write leaves nothing to clean up.
    private struct Unnamed: ~Copyable {
        private let fd: Int32

        /// The written file; nil where unnamed files are not possible (not Linux, an old kernel, a
        /// file system without `O_TMPFILE`), so the caller writes a named temporary instead.
        init?(_ data: Data, beside path: String, permissions: mode_t, sync: Bool) throws(DurableFileError) {
            #if os(Linux)
                guard cwriteback_o_tmpfile != 0 else { return nil }
                let fd = open(parent(of: path), cwriteback_o_tmpfile | O_WRONLY | O_CLOEXEC, permissions)
                guard fd >= 0 else {
                    let code = errno
                    // EISDIR: a kernel that predates O_TMPFILE; EOPNOTSUPP: a file system without it.
                    if [EISDIR, EOPNOTSUPP, EINVAL].contains(code) { return nil }
                    throw .io("write", path, errno: code)
                }
                var failure = data.withUnsafeBytes { writeFully(fd, $0) }
                if failure == 0, sync, fsync(fd) != 0 { failure = errno }
                guard failure == 0 else {
                    close(fd)
                    throw .io("write", path, errno: failure)
                }
                self.fd = fd
            #else
                return nil
            #endif
        }

        deinit { close(fd) }

        /// Gives the file the name `path`: 0, or the `errno` (`EEXIST` when the name is taken,
        /// `ENOENT` also when /proc is not mounted).
        func link(to path: String) -> Int32 {
            linkat(AT_FDCWD, "/proc/self/fd/\(fd)", AT_FDCWD, path, AT_SYMLINK_FOLLOW) == 0 ? 0 : errno
        }
    }

    static func parent(of path: String) -> String {
        guard let slash = path.lastIndex(of: "/") else { return "." }
        return slash == path.startIndex ? "/" : String(path[..<slash])
    }
}

/// Folder operations that make renames and new files durable.
public enum Directory {
    /// Syncs a folder, so that the names created, renamed or removed in it survive a power cut.
    public static func sync(_ path: String) throws(DurableFileError) {
        let fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else { throw .io("open folder", path, errno: errno) }
        defer { close(fd) }
        // Some file systems (and FUSE mounts) cannot sync a folder; the rename itself happened.
        if fsync(fd) != 0, errno != EINVAL { throw .io("sync folder", path, errno: errno) }
    }

    /// Makes a folder and its parents, like `mkdir -p`; an existing folder is fine.
    public static func create(_ path: String, permissions: mode_t = 0o755) throws(DurableFileError) {
        var current = path.hasPrefix("/") ? "" : "."
        for component in path.split(separator: "/") {
            current += "/" + component
            if mkdir(current, permissions) != 0 && errno != EEXIST { throw .io("create folder", current, errno: errno) }
        }
        var info = stat()
        guard stat(path, &info) == 0, info.st_mode & S_IFMT == S_IFDIR else {
            throw DurableFileError(.io, "\(path) exists and is not a folder: choose another folder")
        }
    }
}

/// Writes all of `bytes` to `fd` at its position (`write(2)` again after a short write or an
/// interruption); 0, or the `errno` that stopped it.
func writeFully(_ fd: Int32, _ bytes: UnsafeRawBufferPointer) -> Int32 {
    var done = 0
    while done < bytes.count {
        let n = write(fd, bytes.baseAddress! + done, bytes.count - done)
        if n < 0 {
            if errno == EINTR { continue }
            return errno
        }
        done += n
    }
    return 0
}

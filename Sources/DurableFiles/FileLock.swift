import IAPProtocol

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// An advisory `flock` on a file, held until ``release()`` or deinit. It never continues
/// silently without the lock: a lock that cannot be taken is an error naming the file.
public final class FileLock {
    public let path: String
    private var fd: Int32

    /// Takes an exclusive lock on `path` (created, mode 0600, when missing). With `wait` the call
    /// blocks until the holder releases it; without, a held lock throws `.locked` at once.
    public init(exclusive path: String, wait: Bool = true) throws(DurableFileError) {
        self.path = path
        fd = open(path, O_CREAT | O_RDWR | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw .io("open the lock file", path, errno: errno) }
        try Self.lock(fd, path: path, wait: wait)
    }

    /// Takes an exclusive lock on `path`, which must exist: never creates it. For a file another
    /// part of the process made and may already have removed (an interrupt handler cleaning up),
    /// where creating it again would leave an empty file behind. Throws when it is missing.
    public init(existing path: String, wait: Bool = true) throws(DurableFileError) {
        self.path = path
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
        guard fd >= 0 else { throw .io("open the file to lock", path, errno: errno) }
        try Self.lock(fd, path: path, wait: wait)
    }

    /// Takes an exclusive lock on an open descriptor the caller keeps (and closes); the lock
    /// goes with the descriptor. Throws `.locked` when another holds it.
    public static func lock(_ fd: Int32, path: String, wait: Bool) throws(DurableFileError) {
        while flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB)) != 0 {
            let code = errno
            if code == EINTR { continue }
            if code == EWOULDBLOCK { throw DurableFileError(.locked, "\(path) is locked by another process") }
            throw DurableFileError(.locked, "cannot lock \(path): \(errnoDescription(code)); locking must work on this folder (not every network file system supports it)")
        }
    }

    /// Releases the lock (once).
    public func release() {
        guard fd >= 0 else { return }
        close(fd)
        fd = -1
    }

    deinit { release() }
}

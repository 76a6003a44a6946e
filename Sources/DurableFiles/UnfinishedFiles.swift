import Foundation
import Synchronization

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Files (or folders) written under temporary names before they are renamed into place: locked
/// while their writer lives, removable all at once when the process is interrupted, and swept by a
/// later run when their writer died without cleaning up.
///
/// Why: a writer stopped part-way (Ctrl-C, a cancelled CI job, `kill -9`, a crash, a power cut)
/// left its temporary file, up to 2 GiB that nothing removed. The lock (`flock`) is how a sweep
/// tells a leftover from the file of a writer still running, in this process or another, on this
/// machine or in another container sharing the folder: the kernel drops it when its holder
/// dies, however it dies.
public enum UnfinishedFiles {
    /// This process's files still under their temporary names.
    private static let registered = Mutex<Set<String>>([])

    /// One temporary file or folder of this process's: registered from before it exists (so an
    /// interruption at any point removes it), locked once created, and let go of by ``release()``
    /// once renamed into place or removed.
    public final class Claim: @unchecked Sendable {
        public let path: String
        /// Touched by the owner only.
        private var held: FileLock?

        public init(_ path: String) {
            self.path = path
            _ = UnfinishedFiles.registered.withLock { $0.insert(path) }
        }

        /// Locks the file, now created. Where locking is not possible (some network file
        /// systems), sweeps cannot tell a leftover from a live file and leave both alone.
        public func lock() {
            // Never created here: when Ctrl-C's handler has just removed the file, opening it to
            // lock with O_CREAT made it again, empty, and the process then exited leaving it.
            held = try? FileLock(existing: path, wait: false)
        }

        /// The file is in place or removed: no longer this process's to clean up.
        public func release() {
            _ = UnfinishedFiles.registered.withLock { $0.remove(path) }
            held?.release()
            held = nil
        }

        deinit { release() }
    }

    /// Removes this process's unfinished files and folders, for an interrupt handler to call
    /// before the process exits; returns how many there were.
    public static func removeAll() -> Int {
        registered.withLock { paths in paths.filter { (try? FileManager.default.removeItem(atPath: $0)) != nil }.count }
    }

    /// Removes, in `directory`, the files (or folders, with all they hold) whose names `matching`
    /// accepts that writers no longer running left behind: not locked, and not modified for
    /// `minimumAge` seconds (which covers the moment between a writer creating its file and
    /// locking it). Returns the paths removed.
    public static func removeLeftovers(in directory: String, minimumAge: TimeInterval = 5, matching: (String) -> Bool) -> [String] {
        guard let listing = try? FileManager.default.contentsOfDirectory(atPath: directory) else { return [] }
        let now = Date().timeIntervalSince1970
        var removed: [String] = []
        for name in listing where matching(name) {
            let path = directory + "/" + name
            let fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
            guard fd >= 0 else { continue }
            defer { close(fd) }
            var status = stat()
            guard fstat(fd, &status) == 0, [S_IFREG, S_IFDIR].contains(status.st_mode & S_IFMT),
                now - Double(FileIdentity(status).modified) / 1e9 >= minimumAge
            else { continue }
            // A lock held means a writer is still at work; a file system without locks refuses
            // with another error, and the file is left alone.
            guard (try? FileLock.lock(fd, path: path, wait: false)) != nil else { continue }
            if status.st_mode & S_IFMT == S_IFDIR {
                if (try? FileManager.default.removeItem(atPath: path)) != nil { removed.append(path) }
            } else if unlink(path) == 0 {
                removed.append(path)
            }
        }
        return removed
    }
}

import DurableFiles
import Foundation
import Synchronization

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// The temporary files a build writes before renaming them into place (and the folder an
/// extraction fills before renaming it): locked while their build lives, removed when it is
/// interrupted (``ArchivePacker/removeUnfinishedFiles()``), and removed by a later build into the
/// same folder when their build died without cleaning up.
///
/// Why: a build stopped part-way (Ctrl-C, a cancelled or timed-out CI job, `kill -9`, a power
/// cut) left its hidden `.<archive>.partial-<pid>` behind, up to 2 GiB that nothing removed.
/// The lock (`flock`) is how a later build tells a leftover from the file of a build still
/// running, in this process or another, on this machine or in another container sharing the
/// folder: the kernel drops it when its holder dies, however it dies.
enum UnfinishedOutputs {
    /// This process's files still under their temporary names.
    private static let registered = Mutex<Set<String>>([])

    /// The temporary name `name` is written under by this process.
    static func temporaryName(for name: String) -> String {
        "." + name + marker + String(getpid())
    }

    private static let marker = ".partial-"

    /// One temporary file of this process's: registered from before it exists (an interruption
    /// at any point removes it), locked once created, and let go of by ``release()``.
    final class Claim {
        let path: String
        private var lockFD: Int32 = -1

        init(_ path: String) {
            self.path = path
            _ = UnfinishedOutputs.registered.withLock { $0.insert(path) }
        }

        /// Locks the file, now created. Where locking is not possible (some network file
        /// systems), later builds cannot tell a leftover from a live file and leave both alone.
        func lock() {
            lockFD = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
            if lockFD >= 0 && flock(lockFD, LOCK_EX | LOCK_NB) != 0 {
                close(lockFD)
                lockFD = -1
            }
        }

        /// The file is renamed into place or removed: it is no longer this build's to clean up.
        func release() {
            _ = UnfinishedOutputs.registered.withLock { $0.remove(path) }
            if lockFD >= 0 { close(lockFD) }
            lockFD = -1
        }

        deinit { release() }
    }

    /// Removes this process's unfinished files and folders; returns how many there were.
    static func removeAll() -> Int {
        registered.withLock { paths in
            paths.filter { path in
                var info = stat()
                guard lstat(path, &info) == 0 else { return false }
                return (try? FileManager.default.removeItem(atPath: path)) != nil
            }.count
        }
    }

    /// Whether `name` is a build's temporary archive or manifest: `.<id>-<version>.zip.partial-<pid>`
    /// or `.<id>-<version>.manifest.json.partial-<pid>`.
    static func isTemporaryName(_ name: String) -> Bool {
        guard name.hasPrefix("."), let range = name.range(of: marker, options: .backwards) else { return false }
        let pid = name[range.upperBound...]
        let base = name[..<range.lowerBound]
        return !pid.isEmpty && pid.allSatisfy(\.isASCII) && pid.allSatisfy(\.isNumber)
            && (base.hasSuffix(".zip") || base.hasSuffix(".manifest.json"))
    }

    /// Removes, in `directory`, the temporary archives and manifests that builds no longer running
    /// left behind: not locked, and not modified for `minimumAge` seconds (which covers the moment
    /// between a build creating its file and locking it). Returns the paths removed.
    static func removeLeftovers(in directory: String, minimumAge: TimeInterval = 5) -> [String] {
        guard let listing = try? FileManager.default.contentsOfDirectory(atPath: directory) else { return [] }
        let now = Date().timeIntervalSince1970
        var removed: [String] = []
        for name in listing where isTemporaryName(name) {
            let path = directory + "/" + name
            var info = stat()
            guard lstat(path, &info) == 0, info.st_mode & S_IFMT == S_IFREG else { continue }
            #if canImport(Darwin)
                let modified = Double(info.st_mtimespec.tv_sec)
            #else
                let modified = Double(info.st_mtim.tv_sec)
            #endif
            guard now - modified >= minimumAge else { continue }
            let fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
            guard fd >= 0 else { continue }
            defer { close(fd) }
            // A lock held means a build is still writing it; a file system without locks
            // refuses with another error, and the file is left alone.
            guard flock(fd, LOCK_EX | LOCK_NB) == 0 else { continue }
            if unlink(path) == 0 { removed.append(path) }
        }
        return removed
    }
}

extension ArchivePacker {
    /// Removes the temporary files of the builds and extractions under way in this process, for
    /// a command's interrupt handler to call before it exits: they then fail, and nothing they
    /// wrote stays behind. Returns how many files and folders were removed.
    public static func removeUnfinishedFiles() -> Int {
        UnfinishedOutputs.removeAll()
    }
}

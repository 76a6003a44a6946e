import Foundation
import Synchronization

/// A server's grant keys, read again when the file changes, so keys rotate without a restart.
public final class GrantKeys: Sendable {
    public let path: String
    private struct Loaded {
        var ring: GrantKeyRing
        var generation = 0
        /// The file as last read: device, inode, size and modification time.
        var signature: [Int]
    }
    private let loaded: Mutex<Loaded>

    /// Loads the file at `path`, creating it with one fresh key when missing.
    public init(path: String) throws(GrantKeyFileError) {
        self.path = path
        let before = Self.signature(path)
        let ring = try GrantKeyFile.loadOrCreate(path: path).ring
        let after = Self.signature(path)
        // Changed while being read: the file is read again at the first look.
        loaded = Mutex(Loaded(ring: ring, signature: before.isEmpty || before == after ? after : []))
    }

    /// The ring in force now.
    public var ring: GrantKeyRing { loaded.withLock { $0.ring } }

    /// The ring in force now, and a number that changes with every ring read since: a cache of
    /// checked tokens keeps an entry only while the ring that checked it is still in force.
    public var current: (ring: GrantKeyRing, generation: Int) { loaded.withLock { ($0.ring, $0.generation) } }

    /// Reads the file again if it changed since the last read: the new ring (in force from
    /// now), nil when unchanged, or why the new file cannot be used (the ring in force stays).
    public func reloadIfChanged() -> Result<GrantKeyRing, GrantKeyFileError>? {
        let signature = Self.signature(path)
        guard signature != loaded.withLock({ $0.signature }) else { return nil }
        do throws(GrantKeyFileError) {
            let ring = try GrantKeyFile.load(path: path).ring
            loaded.withLock { $0 = Loaded(ring: ring, generation: $0.generation + 1, signature: signature) }
            return .success(ring)
        } catch {
            // Said once per change of the file, not at every look.
            loaded.withLock { $0.signature = signature }
            return .failure(error)
        }
    }

    private static func signature(_ path: String) -> [Int] {
        var info = stat()
        guard stat(path, &info) == 0 else { return [] }
        return [Int(info.st_dev), Int(info.st_ino), Int(info.st_size), Int(info.st_mtim.tv_sec), Int(info.st_mtim.tv_nsec)]
    }
}

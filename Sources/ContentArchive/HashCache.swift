import DurableFiles
import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// The SHA-256 of each content file a build packed, with the file's identity (device, inode,
/// size, modification and change times) when it was read: the next `--previous` build takes the
/// digest of a file whose identity is unchanged instead of reading it again, as git's index and
/// rsync do. Hashing every unchanged file was most of an incremental build's time (SHA-256 runs at
/// about 1.3 GB/s per core here, and the content is larger than the archive).
///
/// Kept beside the archive as `.<archive name>.hashes` (tab-separated lines, never part of what
/// is published); a missing or damaged cache only means files are hashed. Files changed within
/// two seconds of the build are left out: a later change in the same clock tick could keep their
/// times.
struct HashCache: Sendable {
    private(set) var digests: [String: (identity: FileIdentity, sha256: String)] = [:]

    static func path(besideArchive archive: String) -> String {
        let url = URL(fileURLWithPath: archive)
        return url.deletingLastPathComponent().path + "/." + url.lastPathComponent + ".hashes"
    }

    /// The digest of `path` if the cache holds it for the file as it is now.
    func digest(of path: String, identity: FileIdentity?) -> String? {
        guard let identity, let cached = digests[path], cached.identity == identity else { return nil }
        return cached.sha256
    }

    mutating func insert(_ path: String, identity: FileIdentity, sha256: String) {
        digests[path] = (identity, sha256)
    }

    static func load(besideArchive archive: String) -> HashCache {
        var cache = HashCache()
        guard let data = FileManager.default.contents(atPath: path(besideArchive: archive)) else { return cache }
        let lines = String(decoding: data, as: UTF8.self).split(separator: "\n")
        guard lines.first == "iap-pack-hashes 1" else { return cache }
        for line in lines.dropFirst() {
            let f = line.split(separator: "\t", maxSplits: 6, omittingEmptySubsequences: false)
            guard f.count == 7, f[0].utf8.count == 64, let device = UInt64(f[1]), let inode = UInt64(f[2]), let size = UInt64(f[3]),
                let modified = Int64(f[4]), let changed = Int64(f[5])
            else { return HashCache() }
            cache.insert(
                String(f[6]), identity: FileIdentity(device: device, inode: inode, size: size, modified: modified, changed: changed),
                sha256: String(f[0]))
        }
        return cache
    }

    /// Writes the cache beside `archive`; failures are ignored (the next build hashes instead).
    func write(besideArchive archive: String, now: Date = Date()) {
        let recent = Int64((now.timeIntervalSince1970 - 2) * 1_000_000_000)
        var text = "iap-pack-hashes 1\n"
        for (path, entry) in digests.sorted(by: { $0.key < $1.key })
        where entry.identity.modified < recent && entry.identity.changed < recent && !path.contains("\n") && !path.contains("\t") {
            let i = entry.identity
            text += "\(entry.sha256)\t\(i.device)\t\(i.inode)\t\(i.size)\t\(i.modified)\t\(i.changed)\t\(path)\n"
        }
        try? AtomicFile.write(Data(text.utf8), to: Self.path(besideArchive: archive), permissions: 0o644, durability: .processKill)
    }
}

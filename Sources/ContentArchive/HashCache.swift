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
        guard let data = FileManager.default.contents(atPath: path(besideArchive: archive)) else { return HashCache() }
        // Parsed on bytes: thousands of lines through String.split cost more than the files
        // the cache saves reading on a small change.
        return data.withUnsafeBytes { raw in
            let bytes = raw.bindMemory(to: UInt8.self)
            var cache = HashCache()
            var lines = bytes.split(separator: UInt8(ascii: "\n"))[...]
            guard let first = lines.popFirst(), first.elementsEqual("iap-pack-hashes 1".utf8) else { return cache }
            cache.digests.reserveCapacity(lines.count)
            for line in lines {
                let f = line.split(separator: UInt8(ascii: "\t"), maxSplits: 6, omittingEmptySubsequences: false)
                guard f.count == 7, f[0].count == 64, let device = number(f[1]), let inode = number(f[2]), let size = number(f[3]),
                    let modified = number(f[4]), let changed = number(f[5])
                else { return HashCache() }
                cache.insert(
                    String(decoding: f[6], as: UTF8.self),
                    identity: FileIdentity(device: device, inode: inode, size: size, modified: Int64(bitPattern: modified), changed: Int64(bitPattern: changed)),
                    sha256: String(decoding: f[0], as: UTF8.self))
            }
            return cache
        }
    }

    /// A decimal number, optionally negative (as two's complement: times before 1970).
    private static func number(_ digits: Slice<UnsafeBufferPointer<UInt8>>) -> UInt64? {
        var rest = digits[...]
        let negative = rest.first == UInt8(ascii: "-")
        if negative { rest = rest.dropFirst() }
        guard !rest.isEmpty else { return nil }
        var value: UInt64 = 0
        for byte in rest {
            guard (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(byte) else { return nil }
            let (times10, overflow) = value.multipliedReportingOverflow(by: 10)
            let (sum, carry) = times10.addingReportingOverflow(UInt64(byte - UInt8(ascii: "0")))
            guard !overflow, !carry else { return nil }
            value = sum
        }
        return negative ? 0 &- value : value
    }

    /// Writes the cache beside `archive`; failures are ignored (the next build hashes instead).
    func write(besideArchive archive: String, now: Date = Date()) {
        let recent = Int64((now.timeIntervalSince1970 - 2) * 1_000_000_000)
        // Built as bytes: String interpolation and Foundation's `contains` per line were half of
        // what an incremental build of 5,000 files did after its last archive byte.
        var text = Array("iap-pack-hashes 1\n".utf8)
        text.reserveCapacity(digests.count * 160)
        for (path, entry) in digests.sorted(by: { $0.key < $1.key })
        where entry.identity.modified < recent && entry.identity.changed < recent
            && !path.utf8.contains(UInt8(ascii: "\n")) && !path.utf8.contains(UInt8(ascii: "\t"))
        {
            let i = entry.identity
            text += entry.sha256.utf8
            for field in [String(i.device), String(i.inode), String(i.size), String(i.modified), String(i.changed)] {
                text.append(UInt8(ascii: "\t"))
                text += field.utf8
            }
            text.append(UInt8(ascii: "\t"))
            text += path.utf8
            text.append(UInt8(ascii: "\n"))
        }
        try? AtomicFile.write(Data(text), to: Self.path(besideArchive: archive), permissions: 0o644, durability: .processKill)
    }
}

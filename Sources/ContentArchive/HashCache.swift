import Crypto
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
/// about 1.3 GB/s per core here, and the content is larger than the archive). Since version 2 it
/// also keeps the measurements the level choice made of samples (``SampleKey``).
///
/// Kept beside the archive as `.<archive name>.hashes` (tab-separated lines, never part of what
/// is published); a missing or damaged cache only means files are hashed and sampled. Files changed within
/// two seconds of the build are left out: a later change in the same clock tick could keep their
/// times.
struct HashCache: Sendable {
    private(set) var digests: [String: (identity: FileIdentity, sha256: String)] = [:]
    /// Measurements of content samples (``SampleKey``), by the digest of what was sampled, with
    /// the newest modification or change time of the files sampled.
    private(set) var samples: [String: (newest: Int64, value: String)] = [:]

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

    /// The measurement recorded for `key`, if any.
    func sample(_ key: SampleKey) -> String? { samples[key.digest]?.value }

    mutating func insertSample(_ key: SampleKey, value: String) {
        samples[key.digest] = (key.newest, value)
    }

    static func load(besideArchive archive: String) -> HashCache {
        guard let data = FileManager.default.contents(atPath: path(besideArchive: archive)) else { return HashCache() }
        // Parsed on bytes: thousands of lines through String.split cost more than the files
        // the cache saves reading on a small change.
        return data.withUnsafeBytes { raw in
            let bytes = raw.bindMemory(to: UInt8.self)
            var cache = HashCache()
            var lines = bytes.split(separator: UInt8(ascii: "\n"))[...]
            // Version 1 had no sample lines; its digests are as good.
            guard let first = lines.popFirst(), first.elementsEqual("iap-pack-hashes 2".utf8) || first.elementsEqual("iap-pack-hashes 1".utf8)
            else { return cache }
            cache.digests.reserveCapacity(lines.count)
            // Digests must be hex as written: a damaged one would be written back as text of
            // another length, which the next read refuses together with the whole cache.
            for line in lines {
                if line.starts(with: "sample\t".utf8) {
                    let f = line.split(separator: UInt8(ascii: "\t"), maxSplits: 3, omittingEmptySubsequences: false)
                    guard f.count == 4, Hex.isSHA256(f[1]), let newest = number(f[2]) else { return HashCache() }
                    cache.samples[String(decoding: f[1], as: UTF8.self)] = (Int64(bitPattern: newest), String(decoding: f[3], as: UTF8.self))
                    continue
                }
                let f = line.split(separator: UInt8(ascii: "\t"), maxSplits: 6, omittingEmptySubsequences: false)
                guard f.count == 7, Hex.isSHA256(f[0]), let device = number(f[1]), let inode = number(f[2]), let size = number(f[3]),
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
        Self.write(encoded(now: now), besideArchive: archive)
    }

    /// Writes bytes from ``encoded(now:)`` beside `archive`; failures are ignored.
    static func write(_ encoded: [UInt8], besideArchive archive: String) {
        try? AtomicFile.write(Data(encoded), to: path(besideArchive: archive), permissions: 0o644, durability: .processKill)
    }

    /// The file's bytes: what a file changed within 2 s of `now` would be recorded with is left out.
    func encoded(now: Date) -> [UInt8] {
        let recent = Int64((now.timeIntervalSince1970 - 2) * 1_000_000_000)
        // Built as bytes: String interpolation and Foundation's `contains` per line were a third
        // of what an incremental build of 5,000 files did after its last archive byte (perf).
        var text = Array("iap-pack-hashes 2\n".utf8)
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
        for (digest, sample) in samples.sorted(by: { $0.key < $1.key }) where sample.newest < recent && !sample.value.utf8.contains(where: { $0 < 0x20 }) {
            text += "sample\t\(digest)\t\(sample.newest)\t\(sample.value)\n".utf8
        }
        return text
    }
}

/// What a sample measurement depends on, as a ``HashCache`` key: what is measured, the level
/// asked, the encoder (another libdeflate may measure otherwise), and each file sampled with
/// its identity and the bytes taken from it. A build whose sampled files are unchanged takes
/// the measurement instead of reading and compressing the samples again: on 5,000 files of six
/// kinds that was a third of an incremental build's time before its first byte.
struct SampleKey: Sendable {
    private var hasher = SHA256()
    private(set) var newest: Int64 = .min

    init(_ what: String, level: Int, encoder: String) {
        add("\(what)\u{0}\(level)\u{0}\(encoder)")
    }

    mutating func add(file: String, identity: FileIdentity, taken: Int) {
        add("\u{0}\(file)\u{0}\(identity.device)\u{0}\(identity.inode)\u{0}\(identity.size)\u{0}\(identity.modified)\u{0}\(identity.changed)\u{0}\(taken)")
        newest = max(newest, identity.modified, identity.changed)
    }

    private mutating func add(_ text: String) {
        hasher.update(data: Data(text.utf8))
    }

    var digest: String { Hex.encode(hasher.finalize()) }
}

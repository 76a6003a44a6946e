import Crypto
import DurableFiles
import Foundation
import SystemPackage

/// SHA-256 (and, when asked, CRC-32) of a stream of bytes, computed on a thread of its own in the
/// order the bytes are handed over.
///
/// Why a thread: the packer's writer reads and copies every large stored file and writes the
/// whole archive; with the archive's hash and those files' own hashes on top, it was the packer's
/// bottleneck through the benchmark corpus's 256 MiB of video (1.3 s in which the compressors,
/// done with everything after the media, idled). At most `limit` bytes wait, so memory stays flat.
final class BackgroundHasher: @unchecked Sendable {
    private let queue: DispatchQueue
    private let limit: Int
    private let checksums: Bool
    /// Guards `waiting` and `failure`.
    private let condition = NSCondition()
    private var waiting = 0
    private var failure: ArchiveError?
    /// Touched only on `queue`.
    private var hasher = SHA256()
    private var crc: UInt32 = 0

    init(label: String, checksums: Bool = false, limit: Int = 16 << 20) {
        queue = DispatchQueue(label: label)
        self.checksums = checksums
        self.limit = limit
    }

    /// Hashes `bytes` after everything handed over before; waits while too much is waiting.
    func update(_ bytes: [UInt8]) {
        condition.lock()
        while waiting > 0 && waiting + bytes.count > limit { condition.wait() }
        waiting += bytes.count
        condition.unlock()
        queue.async { [self] in
            bytes.withUnsafeBytes { buffer in
                hasher.update(bufferPointer: buffer)
                if checksums { crc = crc32(crc, buffer) }
            }
            condition.lock()
            waiting -= bytes.count
            condition.broadcast()
            condition.unlock()
        }
    }

    /// Hashes bytes `start..<end` of a file, read back when their turn comes: they must be in the
    /// file by then.
    func update(file path: String, from start: UInt64, to end: UInt64) {
        queue.async { [self] in
            do throws(ArchiveError) {
                try ArchivePacker.hash(path, from: start, to: end, into: &hasher)
            } catch {
                condition.lock()
                if failure == nil { failure = error }
                condition.unlock()
            }
        }
    }

    /// The SHA-256 (hex) and CRC-32 of everything handed over, once it is all hashed.
    func finalize() throws(ArchiveError) -> (sha256: String, crc32: UInt32) {
        let digest = queue.sync { (Hex.encode(hasher.finalize()), crc) }
        condition.lock()
        defer { condition.unlock() }
        if let failure { throw failure }
        return digest
    }
}

/// SHA-256 of each fixed-size piece of a stream of bytes (a manifest's `chunks`).
public struct ChunkHasher: Sendable {
    public let chunkSize: UInt64
    private var hasher = SHA256()
    private var filled: UInt64 = 0
    public private(set) var digests: [String] = []

    public init(chunkSize: UInt64) { self.chunkSize = chunkSize }

    public mutating func update(_ bytes: UnsafeRawBufferPointer) {
        var rest = bytes[...]
        while !rest.isEmpty {
            let take = Int(min(UInt64(rest.count), chunkSize - filled))
            hasher.update(bufferPointer: UnsafeRawBufferPointer(rebasing: rest.prefix(take)))
            filled += UInt64(take)
            rest = rest.dropFirst(take)
            if filled == chunkSize {
                digests.append(Hex.encode(hasher.finalize()))
                hasher = SHA256()
                filled = 0
            }
        }
    }

    /// The chunk digests of `count` bytes of a file at `offset` (an entry's stored bytes, say),
    /// read in 1 MiB pieces; nil when the file is shorter.
    public static func digests(of fd: FileDescriptor, at offset: UInt64, count: UInt64, chunkSize: UInt64) -> [String]? {
        var hasher = ChunkHasher(chunkSize: chunkSize)
        var position = offset
        while position < offset + count {
            guard let piece = try? readFully(fd, at: position, count: Int(min(1 << 20, offset + count - position)), path: ""), !piece.isEmpty else {
                return nil
            }
            piece.withUnsafeBytes { hasher.update($0) }
            position += UInt64(piece.count)
        }
        return hasher.finalize()
    }

    /// The digests, the last (shorter) piece included.
    public mutating func finalize() -> [String] {
        if filled > 0 {
            digests.append(Hex.encode(hasher.finalize()))
            hasher = SHA256()
            filled = 0
        }
        return digests
    }
}

/// The chunk hashes of every entry's stored bytes, computed on a thread of its own in the order
/// the bytes are written (as ``BackgroundHasher`` does for the archive's hash).
final class BackgroundChunkHasher: @unchecked Sendable {
    private let queue = DispatchQueue(label: "iap-pack.chunk-hash")
    private let limit: Int
    private let condition = NSCondition()
    private var waiting = 0
    /// Touched only on `queue`.
    private var current: ChunkHasher
    private var finished: [[String]] = []

    init(chunkSize: UInt64, limit: Int = 16 << 20) {
        current = ChunkHasher(chunkSize: chunkSize)
        self.limit = limit
    }

    func update(_ bytes: [UInt8]) {
        guard !bytes.isEmpty else { return }
        condition.lock()
        while waiting > 0 && waiting + bytes.count > limit { condition.wait() }
        waiting += bytes.count
        condition.unlock()
        queue.async { [self] in
            bytes.withUnsafeBytes { current.update($0) }
            condition.lock()
            waiting -= bytes.count
            condition.broadcast()
            condition.unlock()
        }
    }

    /// Ends an entry whose digests are known already (nothing was handed over for it).
    func endEntry(known digests: [String]) {
        queue.async { [self] in finished.append(digests) }
    }

    /// Ends the current entry.
    func endEntry() {
        queue.async { [self] in
            finished.append(current.finalize())
            current = ChunkHasher(chunkSize: current.chunkSize)
        }
    }

    /// Every ended entry's digests, in order, once all are computed.
    func results() -> [[String]] { queue.sync { finished } }
}

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
    private let queue: BoundedQueue
    private let checksums: Bool
    /// Guards `failure`.
    private let condition = NSCondition()
    private var failure: ArchiveError?
    /// Touched only on `queue`.
    private var hasher = SHA256()
    private var crc: UInt32 = 0

    init(label: String, checksums: Bool = false, limit: Int = 16 << 20) {
        queue = BoundedQueue(label: label, limit: limit)
        self.checksums = checksums
    }

    /// Hashes `bytes` after everything handed over before; waits while too much is waiting.
    func update(_ bytes: [UInt8]) {
        queue.async(holding: bytes.count) { [self] in bytes.withUnsafeBytes { hash($0) } }
    }

    /// Hashes mapped bytes after everything handed over before (the mapping is kept until then).
    func update(_ mapped: MappedBytes) {
        queue.async(holding: mapped.bytes.count) { [self] in hash(mapped.bytes) }
    }

    private func hash(_ buffer: UnsafeRawBufferPointer) {
        hasher.update(bufferPointer: buffer)
        if checksums { crc = crc32(crc, buffer) }
    }

    /// Hashes bytes `start..<end` of a file, read back when their turn comes: they must be in the
    /// file by then.
    func update(file path: String, from start: UInt64, to end: UInt64) {
        queue.async(holding: 0) { [self] in
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

/// The chunk hashes and CRC-32 of every entry's stored bytes, computed on a thread of its own in
/// the order the bytes are written (as ``BackgroundHasher`` does for the archive's hash); and the
/// check of entries copied from a previous archive.
final class BackgroundChunkHasher: @unchecked Sendable {
    private let queue: BoundedQueue

    /// The digests of one entry's stored bytes, as the manifest lists them.
    struct Digests: Sendable {
        var chunks: [String]
        var crc32: UInt32
    }

    /// Touched only on `queue`: the entry being hashed, and every ended entry's digests.
    private var current: ChunkHasher
    private var currentCRC: UInt32 = 0
    private var finished: [Digests] = []

    init(chunkSize: UInt64, limit: Int = 16 << 20) {
        current = ChunkHasher(chunkSize: chunkSize)
        queue = BoundedQueue(label: "iap-pack.chunk-hash", limit: limit)
    }

    func update(_ bytes: [UInt8]) {
        guard !bytes.isEmpty else { return }
        queue.async(holding: bytes.count) { [self] in
            bytes.withUnsafeBytes {
                current.update($0)
                currentCRC = crc32(currentCRC, $0)
            }
        }
    }

    /// Ends the current entry.
    func endEntry() {
        queue.async(holding: 0) { [self] in
            finished.append(Digests(chunks: current.finalize(), crc32: currentCRC))
            current = ChunkHasher(chunkSize: current.chunkSize)
            currentCRC = 0
        }
    }

    /// Ends an entry copied from a previous archive, whose chunk hashes its manifest gave; its
    /// bytes, `range` of that archive, are checked as ``check(_:at:)`` hands them over: by their
    /// CRC-32 when the manifest gave it (libdeflate's CRC-32 runs many times faster than
    /// SHA-256), by their chunk hashes otherwise.
    func endEntry(copiedFrom range: Range<UInt64>, crc32 expected: UInt32?, chunks: [String], entryPath: String) {
        queue.async(holding: 0) { [self] in
            copied.append(Copied(range: range, crc32: expected, chunks: chunks, path: entryPath, index: finished.count))
            finished.append(Digests(chunks: chunks, crc32: expected ?? 0))
        }
    }

    /// Checks `mapped`, bytes of the previous archive at `offset`, against the copied entries it
    /// holds (ended before, in the order they were copied); bytes between them (headers) are
    /// skipped.
    func check(_ mapped: MappedBytes, at offset: UInt64) {
        queue.async(holding: mapped.bytes.count) { [self] in
            let piece = mapped.bytes
            let end = offset + UInt64(piece.count)
            var position = offset
            while position < end, copiedNext < copied.count, copied[copiedNext].range.lowerBound < end {
                let entry = copied[copiedNext]
                position = max(position, entry.range.lowerBound)
                let upTo = min(end, entry.range.upperBound)
                let part = UnsafeRawBufferPointer(rebasing: piece[Int(position - offset)..<Int(upTo - offset)])
                copiedCRC = crc32(copiedCRC, part)
                if entry.crc32 == nil { copiedChunks.update(part) }
                position = upTo
                guard upTo == entry.range.upperBound else { break }
                let good = entry.crc32.map { $0 == copiedCRC } ?? (copiedChunks.finalize() == entry.chunks)
                if !good && mismatch == nil { mismatch = entry.path }
                finished[entry.index].crc32 = copiedCRC
                copiedCRC = 0
                copiedChunks = ChunkHasher(chunkSize: current.chunkSize)
                copiedNext += 1
            }
        }
    }

    private struct Copied {
        let range: Range<UInt64>
        let crc32: UInt32?
        let chunks: [String]
        let path: String
        /// Where its digests are in `finished`.
        let index: Int
    }

    /// Touched only on `queue`: the copied entries, how many are checked, the running checksums
    /// of the one being checked, and the first whose bytes were not what they should be.
    private var copied: [Copied] = []
    private var copiedNext = 0
    private var copiedCRC: UInt32 = 0
    private lazy var copiedChunks = ChunkHasher(chunkSize: current.chunkSize)
    private var mismatch: String?

    /// Every ended entry's digests, in order, once all are computed; and the first entry copied
    /// from a previous archive whose bytes were not what its manifest says.
    func results() -> (digests: [Digests], mismatch: String?) {
        queue.sync {
            // An entry whose bytes never all came is not what the manifest says either.
            if mismatch == nil && copiedNext < copied.count { mismatch = copied[copiedNext].path }
            return (finished, mismatch)
        }
    }
}

/// A serial queue whose work holds bytes (to hash, say) until it runs: `async` waits while more
/// than `limit` bytes are waiting, so memory stays flat however far the producer gets ahead.
final class BoundedQueue: @unchecked Sendable {
    private let queue: DispatchQueue
    private let limit: Int
    /// Guards `waiting`.
    private let condition = NSCondition()
    private var waiting = 0

    init(label: String, limit: Int) {
        queue = DispatchQueue(label: label)
        self.limit = limit
    }

    /// Runs `work` after everything queued before; it holds `count` bytes until it has run.
    func async(holding count: Int, _ work: @escaping @Sendable () -> Void) {
        guard count > 0 else { return queue.async(execute: work) }
        condition.lock()
        while waiting > 0 && waiting + count > limit { condition.wait() }
        waiting += count
        condition.unlock()
        queue.async { [self] in
            work()
            condition.lock()
            waiting -= count
            condition.broadcast()
            condition.unlock()
        }
    }

    /// Runs `work` after everything queued before, and returns its result.
    func sync<T>(_ work: () throws -> T) rethrows -> T { try queue.sync(execute: work) }
}

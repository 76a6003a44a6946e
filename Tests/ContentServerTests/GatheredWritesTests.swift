import Foundation
import IAPTestSupport
import NIOCore
import Testing

@testable import ContentServer

/// What arrives in pieces reaches the file in writes of 4 MiB, every byte once and in order: the
/// page cache keeps the stored archive in folios as large as the writes that made them.
@Suite struct GatheredWritesTests {
    /// Feeds `pieces` (sizes) of a random stream through ``GatheredWrites`` into a real file;
    /// returns the stream, the file's bytes and the size of each write.
    func gather(_ pieces: [Int]) throws -> (sent: [UInt8], stored: [UInt8], writes: [Int]) {
        let tmp = try TemporaryFolder()
        let path = tmp.sub("archive")
        #expect(FileManager.default.createFile(atPath: path, contents: nil))
        let file = try #require(FileHandle(forWritingAtPath: path))
        var writes: [Int] = []
        let gathered = GatheredWrites { buffer in
            writes.append(buffer.readableBytes)
            try buffer.withUnsafeReadableBytes { try file.write(contentsOf: $0) }
        }
        let random = try #require(FileHandle(forReadingAtPath: "/dev/urandom"))
        defer { try? random.close() }
        var sent: [UInt8] = []
        for size in pieces {
            let piece = Array(random.readData(ofLength: size))
            sent += piece
            try gathered.append(ByteBuffer(bytes: piece))
        }
        try gathered.flush()
        try file.close()
        return (sent, Array(try Data(contentsOf: URL(fileURLWithPath: path))), writes)
    }

    @Test("64 KiB pieces of 9 MiB (what a socket read gives) reach the file as 4 MiB, 4 MiB and the last 1 MiB")
    func socketSizedPieces() throws {
        let (sent, stored, writes) = try gather(Array(repeating: 64 << 10, count: 144))
        #expect(stored == sent)
        #expect(writes == [4 << 20, 4 << 20, 1 << 20])
    }

    @Test("pieces of every size, down to empty and up to twice the gathering size: the same bytes, every write but the last whole 4 MiB blocks")
    func piecesOfEverySize() throws {
        let size = GatheredWrites<any Error>.size
        let pieces = [0, 2 * size + 5, 1, 1_000, size - 1, 1, size, 3, 0, 70_000, size / 2, size / 2, 1, 12_345]
        let (sent, stored, writes) = try gather(pieces)
        #expect(stored == sent)
        let total = pieces.reduce(0, +)
        #expect(writes.reduce(0, +) == total)
        // So each write starts at a multiple of 4 MiB in the file, where the largest folios can.
        #expect(writes.dropLast().allSatisfy { $0 > 0 && $0 % size == 0 }, "\(writes)")
        #expect(writes.last == total % size)
        // A piece that fills blocks on its own is written from where it lies: two blocks at once.
        #expect(writes.contains(2 * size), "\(writes)")
    }

    @Test("a write that fails stops the gathering with the caller's error: nothing is dropped silently")
    func failedWrite() throws {
        struct DiskFull: Error {}
        var written = 0
        let gathered = GatheredWrites { (buffer: ByteBuffer) throws(DiskFull) in
            guard written == 0 else { throw DiskFull() }
            written += buffer.readableBytes
        }
        let piece = ByteBuffer(repeating: 7, count: 3 << 20)
        try gathered.append(piece)
        try gathered.append(piece)  // the first 4 MiB are written here
        #expect(written == 4 << 20)
        #expect(throws: DiskFull.self) {
            try gathered.append(piece)
            try gathered.flush()
        }
    }
}

import Foundation
import IAPTestSupport
import SystemPackage
import Testing

@testable import ContentArchive

@Suite("Archive file writer", .onTestThreads)
struct FileWriterTests {
    static let pattern = Array(pseudoRandomBytes(10 << 20, seed: 21))

    /// Writes pieces of awkward sizes (around the 4 KiB alignment and the 8 MiB buffer), with
    /// flushes and with patches both far behind and among bytes still buffered, and checks after
    /// every flush and at the end that the file holds exactly what was written.
    func exercise(in folder: String) throws {
        let path = folder + "/out.bin"
        let writer = try BufferedFileWriter(creating: path, direct: true)
        var expected: [UInt8] = []
        var state: UInt64 = 3
        func next(_ bound: Int) -> Int {
            state = state &* 6364136223846793005 &+ 1442695040888963407
            return Int(state >> 33) % bound
        }
        for round in 0..<40 {
            let size = [1, 100, 4095, 4096, 4097, 70_000, 3 << 20, 9 << 20][next(8)]
            let start = next(Self.pattern.count - size + 1)
            let piece = Array(Self.pattern[start..<(start + size)])
            try writer.write(piece)
            expected += piece
            if next(3) == 0 {
                // Half the time among the last bytes, which may still sit in the buffer.
                let position = next(2) == 0 ? max(0, expected.count - 1 - next(5000)) : next(expected.count)
                let patch = [UInt8](repeating: UInt8(truncatingIfNeeded: round), count: min(12, expected.count - position))
                try writer.patch(at: UInt64(position), patch)
                expected.replaceSubrange(position..<(position + patch.count), with: patch)
            }
            if next(4) == 0 {
                try writer.flush()
                #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == Data(expected), "after round \(round)")
            }
        }
        try writer.finish()
        #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == Data(expected))
    }

    @Test("direct writes, flushes and patches leave exactly the bytes written")
    func directWrites() throws {
        let tmp = try TemporaryFolder()
        try withExtendedLifetime(tmp) { try exercise(in: tmp.path) }
    }

    @Test("the same on tmpfs, which may refuse direct I/O")
    func onTmpfs() throws {
        let folder = "/dev/shm/iap-tests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: folder) }
        try exercise(in: folder)
    }

    @Test("ranges of another file copied in the kernel land between buffered writes, in order")
    func kernelCopies() throws {
        let tmp = try TemporaryFolder()
        let sourcePath = tmp.path + "/source.bin"
        try Data(Self.pattern).write(to: URL(fileURLWithPath: sourcePath))
        let source = try FileDescriptor.open(sourcePath, .readOnly)
        defer { try? source.close() }

        let path = tmp.path + "/out.bin"
        let writer = try BufferedFileWriter(creating: path, durable: false)
        var expected: [UInt8] = []
        var copied = 0
        for (head, range) in [(5, 100..<70_000), (0, 3_000_000..<(9 << 20)), (4097, 0..<1), (100, 7..<4_000_000)] {
            let written = Array(Self.pattern[..<head])
            try writer.write(written)
            expected += written
            if try writer.copy(from: source, range: UInt64(range.lowerBound)..<UInt64(range.upperBound)) {
                copied += 1
            } else {
                try writer.write(Array(Self.pattern[range]))
            }
            expected += Self.pattern[range]
            #expect(writer.offset == UInt64(expected.count))
        }
        try writer.write([1, 2, 3])
        expected += [1, 2, 3]
        try writer.finish()
        #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == Data(expected))
        #if os(Linux)
            #expect(copied == 4, "copy_file_range is available on any Linux since 5.3")
        #endif
    }
}

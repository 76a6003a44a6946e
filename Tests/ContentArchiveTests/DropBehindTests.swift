import Foundation
import IAPTestSupport
import SystemPackage
import Testing

@testable import ContentArchive

@Suite("DropBehind: which pages a moving point lets go of")
struct DropBehindTests {
    static let mib: Int64 = 1 << 20

    @Test("a step at a time, each range covering the step before again, never before its origin; the rest at the end")
    func ranges() {
        var drops = DropBehind(from: 3 * Self.mib, step: 8 * Self.mib)
        var given: [Range<Int64>] = []
        // Points that go back (a frontier read late) or move less than a step give nothing.
        for point in [0, 2, 7, 10, 11, 9, 12, 19, 20, 27, 40, 41, 45].map({ $0 * Self.mib }) {
            if let range = drops.advance(to: point) { given.append(range) }
        }
        #expect(given == [(3 * Self.mib)..<(11 * Self.mib), (3 * Self.mib)..<(19 * Self.mib), (11 * Self.mib)..<(27 * Self.mib), (19 * Self.mib)..<(40 * Self.mib)])
        #expect(drops.finish(at: 45 * Self.mib) == (32 * Self.mib)..<(45 * Self.mib), "the rest, with the step before")
        #expect(drops.finish(at: 45 * Self.mib) == (37 * Self.mib)..<(45 * Self.mib), "asked again, only the step before")

        var short = DropBehind(from: 0, step: 8 * Self.mib)
        #expect(short.advance(to: 5 * Self.mib) == nil)
        #expect(short.finish(at: 5 * Self.mib) == 0..<(5 * Self.mib), "a read shorter than a step lets all of it go at its end")
        var backwards = DropBehind(from: 10 * Self.mib, step: Self.mib)
        #expect(backwards.finish(at: 4 * Self.mib).isEmpty, "an end before the origin gives nothing")
    }

    #if os(Linux)
        @Test("a written file's pages go two steps behind its write-back once clean; the newest stay; the bytes are intact")
        func writebackDropsBehind() throws {
            let mib = Int(Self.mib)
            let piece = [UInt8](repeating: 0xa5, count: mib)
            let stayed = try pagesStayed {
                let tmp = try TemporaryFolder(onDisk: ())
                let path = tmp.sub("written")
                let fd = try FileDescriptor.open(path, .readWrite, options: [.create], permissions: .ownerReadWrite)
                defer { try? fd.close() }
                var writeback = Writeback(step: 4 << 20, dropsBehind: true)
                var written: UInt64 = 0
                func write(upTo end: UInt64) throws {
                    while written < end {
                        _ = try piece.withUnsafeBytes { try fd.writeAll(toAbsoluteOffset: Int64(written), $0) }
                        written += UInt64(mib)
                        writeback.wrote(upTo: written, fd: fd)
                    }
                }
                try write(upTo: 24 << 20)
                // Clean now: what the next ranges drop does not depend on the disk's pace.
                #expect(fsync(fd.rawValue) == 0)
                try write(upTo: 40 << 20)
                #expect(cachedBytes(of: path, in: (8 * mib)..<(24 * mib)) == 0, "written back, and two steps behind: dropped")
                let newest = cachedBytes(of: path, in: (32 * mib)..<(40 * mib))
                let data = try Data(contentsOf: URL(fileURLWithPath: path))
                #expect(data.count == 40 * mib && data.allSatisfy { $0 == 0xa5 })
                return newest == 8 * mib
            }
            #expect(stayed, "the last two steps stay")

            let kept = try pagesStayed {
                let tmp = try TemporaryFolder(onDisk: ())
                var keeping = Writeback(step: 4 << 20)
                let other = try FileDescriptor.open(tmp.sub("kept"), .readWrite, options: [.create], permissions: .ownerReadWrite)
                defer { try? other.close() }
                // As above: clean after 24 MiB, then written on, where a dropping writer lets the
                // clean pages behind go.
                for index in 0..<40 {
                    if index == 24 { #expect(fsync(other.rawValue) == 0) }
                    _ = try piece.withUnsafeBytes { try other.writeAll(toAbsoluteOffset: Int64(index * mib), $0) }
                    keeping.wrote(upTo: UInt64((index + 1) * mib), fd: other)
                }
                return cachedBytes(of: tmp.sub("kept"), in: 0..<(24 * mib)) == 24 * mib
            }
            #expect(kept, "without dropsBehind every page stays")
        }
    #endif
}

import Foundation
import IAPTestSupport
import SystemPackage
import Testing

@testable import ContentFetch

#if os(Linux)
    import Glibc

    @Suite("WriteBehind: a body's pages go to disk early and leave the page cache once hashed")
    struct WriteBehindTests {
        static let mib = 1 << 20

        /// Writes 1 MiB pieces from `position` up to `end` and runs the work `pacing` returns, as a
        /// body source does.
        func write(_ fd: FileDescriptor, _ pacing: inout BodyPacing, from position: inout Int64, upTo end: Int64) throws {
            let piece = [UInt8](repeating: 0x5a, count: Self.mib)
            while position < end {
                try piece.withUnsafeBytes { try BodyPacing.write($0, to: fd, at: position, end: end) }
                let next = pacing.wrote(piece.count, at: position, windowFull: false)
                position += Int64(piece.count)
                next.work?.run()
            }
        }

        /// Runs `body` with a new partial file (its path and descriptor) in a disk-backed folder.
        func withPartialFile(_ body: (String, FileDescriptor) throws -> Void) throws {
            let tmp = try TemporaryFolder(onDisk: ())
            let path = tmp.sub("partial")
            let fd = try FileDescriptor.open(path, .readWrite, options: [.create], permissions: .ownerReadWrite)
            defer { try? fd.close() }
            try withExtendedLifetime(tmp) { try body(path, fd) }
        }

        @Test("pages the hash has read are dropped once written back; the rest stay cached, and the bytes are intact")
        func dropsHashedPages() throws {
            let stayed = try pagesStayed {
                var stayed = false
                try withPartialFile { path, fd in
                    let frontier = HashFrontier()
                    var behind = BodyPacing(limiter: nil, behind: WriteBehind(fd: fd.rawValue, from: 0, frontier: frontier))
                    var position: Int64 = 0
                    try write(fd, &behind, from: &position, upTo: 32 << 20)
                    // Clean now: what is dropped next does not depend on the disk's pace.
                    #expect(fsync(fd.rawValue) == 0)
                    let unhashed = cachedBytes(of: path, in: 0..<(32 * Self.mib))
                    frontier.store(24 << 20)
                    try write(fd, &behind, from: &position, upTo: 40 << 20)
                    #expect(cachedBytes(of: path, in: 0..<(24 * Self.mib)) == 0, "hashed and written back: dropped")
                    let notHashed = cachedBytes(of: path, in: (24 * Self.mib)..<(40 * Self.mib))
                    let data = try Data(contentsOf: URL(fileURLWithPath: path))
                    #expect(data.count == 40 * Self.mib && data.allSatisfy { $0 == 0x5a })
                    stayed = unhashed == 32 * Self.mib && notHashed == 16 * Self.mib
                }
                return stayed
            }
            #expect(stayed, "nothing is dropped before it is hashed, and what is not hashed yet stays cached")
        }

        @Test("without a frontier (a delta update) nothing is dropped; a segment's drops stay inside it, behind its writeback")
        func keepsWhatIsNotItsOwn() throws {
            let kept = try pagesStayed {
                var kept = false
                try withPartialFile { path, fd in
                    var unhashed = BodyPacing(limiter: nil, behind: WriteBehind(fd: fd.rawValue, from: 0, frontier: nil))
                    var position: Int64 = 0
                    try write(fd, &unhashed, from: &position, upTo: 16 << 20)
                    #expect(fsync(fd.rawValue) == 0)
                    try write(fd, &unhashed, from: &position, upTo: 48 << 20)
                    kept = cachedBytes(of: path, in: 0..<(16 * Self.mib)) == 16 * Self.mib
                }
                return kept
            }
            #expect(kept, "without a frontier nothing is dropped")
            try withPartialFile { _, fd in
                // A segment from 64 MiB with the hash far past it: every drop lies within the
                // segment and at least `lag` behind where its writeback has started.
                let frontier = HashFrontier()
                frontier.store(1 << 40)
                var segment = WriteBehind(fd: fd.rawValue, from: 64 << 20, frontier: frontier)
                var dropped: [Range<Int64>] = []
                var started: [Range<Int64>] = []
                for end in stride(from: Int64(65 << 20), through: Int64(128 << 20), by: Int64.Stride(1 << 20)) {
                    guard let work = segment.wrote(through: end) else { continue }
                    started.append(work.start)
                    if !work.release.isEmpty { dropped.append(work.release) }
                    #expect(work.release.isEmpty || (work.release.lowerBound >= 64 << 20 && work.release.upperBound <= end - WriteBehind.lag))
                }
                #expect(started.first?.lowerBound == 64 << 20 && started.last?.upperBound == 128 << 20)
                #expect(zip(started, started.dropFirst()).allSatisfy { $0.upperBound == $1.lowerBound }, "writeback starts for every byte once")
                #expect(!dropped.isEmpty)
            }
        }
    }
#endif

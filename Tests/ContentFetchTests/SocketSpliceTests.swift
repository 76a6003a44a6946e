import Foundation
import IAPTestSupport
import SystemPackage
import Testing

@testable import ContentFetch

#if os(Linux)
    import Glibc

    @Suite("SocketSplice: a socket's bytes into the file through a pipe")
    struct SocketSpliceTests {
        /// A connected pair of stream sockets: bytes sent on `peer` arrive on `socket`.
        final class Connection: Sendable {
            let socket: Int32
            let peer: Int32
            init() throws {
                var ends: [Int32] = [-1, -1]
                guard socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &ends) == 0 else { throw Errno(rawValue: errno) }
                (socket, peer) = (ends[0], ends[1])
            }
            func send(_ bytes: [UInt8]) {
                var sent = 0
                while sent < bytes.count {
                    let n = bytes.withUnsafeBytes { Glibc.send(peer, $0.baseAddress! + sent, $0.count - sent, Int32(MSG_NOSIGNAL)) }
                    guard n > 0 else { return }
                    sent += n
                }
            }
            func closePeer() { shutdown(peer, Int32(SHUT_WR)) }
            deinit {
                close(socket)
                close(peer)
            }
        }

        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: 64 << 10, alignment: 16)
        func failure(_ action: String) -> Error { FetchError(.network, "cannot \(action): \(String(cString: strerror(errno)))") }

        /// Moves everything the peer sends (until it closes) into `fd` from `start`, as the reader does.
        func moveAll(_ splice: SocketSplice, from connection: Connection, to fd: FileDescriptor, at start: Int64, end: Int64) throws -> [SocketSplice.Moved] {
            var steps: [SocketSplice.Moved] = []
            var position = start
            while true {
                let step = try splice.move(from: connection.socket, to: fd, at: position, upTo: SocketSplice.size, end: end, buffer: buffer, socketError: failure)
                steps.append(step)
                switch step {
                case .bytes(0): return steps
                case .bytes(let n), .unsupported(let n): position += Int64(n)
                }
                if case .unsupported = step { return steps }
            }
        }

        @Test("bytes land at their offset in the file, and a closed peer ends the body")
        func movesAtOffset() throws {
            let tmp = try TemporaryFolder()
            let fd = try FileDescriptor.open(tmp.sub("partial"), .readWrite, options: [.create], permissions: .ownerReadWrite)
            defer { try? fd.close() }
            let body = (0..<300_000).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ $0 >> 9) }
            let connection = try Connection()
            let sender = Thread {
                connection.send(body)
                connection.closePeer()
            }
            sender.start()
            let splice = try #require(SocketSplice())
            let steps = try moveAll(splice, from: connection, to: fd, at: 1000, end: 1000 + Int64(body.count))
            guard case .bytes(0) = steps.last else {
                Issue.record("the body did not end with the peer's close: \(steps)")
                return
            }
            let moved = steps.reduce(0) { sum, step in if case .bytes(let n) = step { sum + n } else { sum } }
            #expect(moved == body.count)
            let written = try Data(contentsOf: URL(fileURLWithPath: tmp.sub("partial")))
            // Compared whole, so that a failure names the sizes rather than printing every byte.
            let landed = written.count == 1000 + body.count && written.dropFirst(1000).elementsEqual(body) && written.prefix(1000).allSatisfy { $0 == 0 }
            #expect(landed, "\(written.count) bytes in the file, \(1000 + body.count) expected")
        }

        @Test("bytes past the range asked for are refused, naming the last byte asked for")
        func pastEnd() throws {
            let tmp = try TemporaryFolder()
            let fd = try FileDescriptor.open(tmp.sub("partial"), .readWrite, options: [.create], permissions: .ownerReadWrite)
            defer { try? fd.close() }
            let connection = try Connection()
            connection.send([UInt8](repeating: 1, count: 5000))
            connection.closePeer()
            let splice = try #require(SocketSplice())
            #expect {
                _ = try moveAll(splice, from: connection, to: fd, at: 0, end: 4000)
            } throws: { ($0 as? FetchError)?.message.contains("more than the bytes asked for (up to byte 4000)") == true }
            // Nothing past the end reached the file.
            #expect(try fd.seek(offset: 0, from: .end) == 0)
        }

        @Test("a file the kernel cannot splice into gets the bytes already taken the long way, and the reader reads from then on")
        func fileThatCannotSplice() throws {
            let tmp = try TemporaryFolder()
            // splice(2) refuses a file opened to append (EINVAL), as it does on file systems
            // without splice support.
            let fd = try FileDescriptor.open(tmp.sub("partial"), .readWrite, options: [.create, .append], permissions: .ownerReadWrite)
            defer { try? fd.close() }
            let body = (0..<100_000).map { UInt8(truncatingIfNeeded: $0 &* 13) }
            let connection = try Connection()
            connection.send(body)
            connection.closePeer()
            let splice = try #require(SocketSplice())
            let steps = try moveAll(splice, from: connection, to: fd, at: 0, end: Int64(body.count))
            guard steps.count == 1, case .unsupported(let moved) = steps[0] else {
                Issue.record("expected one unsupported step: \(steps)")
                return
            }
            #expect(moved > 0)
            let written = try Data(contentsOf: URL(fileURLWithPath: tmp.sub("partial")))
            let kept = written.elementsEqual(body[..<moved])
            #expect(kept, "\(written.count) bytes in the file, \(moved) taken from the socket")
        }
    }
#endif

#if os(Linux)
    import Foundation
    import IAPTestSupport
    import NIOCore
    import NIOPosix
    import Testing

    @testable import ContentDelivery

    /// `ContentFastPath.sendInline` over a real TCP connection on 127.0.0.1: what it sends, and
    /// what it leaves for the usual ways when the socket has no room.
    @Suite struct InlineSendTests {
        typealias Connection = FileSenderTests.Connection

        /// A served file of `size` pseudo-random bytes, in a folder of its own; closed and removed
        /// with this.
        final class Served {
            let folder: TemporaryFolder
            let handle: NIOFileHandle
            let bytes: [UInt8]

            init(size: Int) throws {
                folder = try TemporaryFolder()
                bytes = [UInt8](pseudoRandomBytes(size, seed: 5))
                handle = try NIOFileHandle(_deprecatedPath: try folder.write("served.bin", Data(bytes)))
            }

            deinit { try? handle.close() }
        }

        /// A connected pair whose sending end has a send buffer of `sendBuffer` bytes when given.
        static func connection(sendBuffer: Int? = nil) throws -> Connection {
            let connection = try FileSenderTests.connection()
            if let sendBuffer { setBuffer(connection.sending, SO_SNDBUF, sendBuffer) }
            return connection
        }

        static func setBuffer(_ descriptor: CInt, _ option: CInt, _ size: Int) {
            var value = CInt(size)
            setsockopt(descriptor, SOL_SOCKET, option, &value, socklen_t(MemoryLayout<CInt>.size))
        }

        static let head = ByteBuffer(string: "HTTP/1.1 206 Partial Content\r\nContent-Length: 1\r\n\r\n")

        /// Closes the sending end and reads what the peer got.
        static func received(_ connection: Connection) async -> [UInt8] {
            close(connection.sending)
            defer { close(connection.receiving) }
            return await FileSenderTests.readAll(connection.receiving)
        }

        @Test("a range the socket has room for leaves whole, its head first, in one call")
        func sendsHeadAndBody() async throws {
            let file = try Served(size: 3 << 20)
            // Room for all of it whatever the kernel's autotuning starts from.
            let connection = try Self.connection(sendBuffer: 4 << 20)
            var head = Self.head
            var pieces = [IOData.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: 1_000, endIndex: 1_000 + (2 << 20)))]
            let outcome = ContentFastPath.sendInline(&head, &pieces, socket: connection.sending)
            guard case .sent = outcome else {
                Issue.record("not sent whole: \(outcome)")
                return
            }
            #expect(pieces.isEmpty)
            let got = await Self.received(connection)
            #expect(got == Array(Self.head.readableBytesView) + Array(file.bytes[1_000..<(1_000 + (2 << 20))]))
        }

        @Test("a socket with room for part of the body: what left is the head and the region's start, and the region passed back is the rest")
        func leavesTheRestWhenTheSocketFills() async throws {
            let file = try Served(size: 3 << 20)
            let connection = try Self.connection(sendBuffer: 64 << 10)
            var head = Self.head
            var pieces = [IOData.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: 0, endIndex: 2 << 20))]
            let outcome = ContentFastPath.sendInline(&head, &pieces, socket: connection.sending)
            guard case .unfinished = outcome, pieces.count == 1, case .fileRegion(let region) = pieces[0] else {
                Issue.record("a 2 MiB body fit in a socket of 64 KiB: \(outcome), \(pieces.count) pieces left")
                return
            }
            #expect(head.readableBytes == 0, "the head left")
            let left = region.readerIndex
            #expect(left > 0 && left < 2 << 20 && region.endIndex == 2 << 20, "\(left) of the body's bytes left")
            let got = await Self.received(connection)
            #expect(got == Array(Self.head.readableBytesView) + Array(file.bytes[0..<left]))
        }

        /// A multipart answer's pieces: part heads and tail as buffers, the ranges as regions.
        static func multipart(_ file: Served, ranges: [Range<Int>]) -> (pieces: [IOData], bytes: [UInt8]) {
            var pieces: [IOData] = []
            var bytes: [UInt8] = []
            for (index, range) in ranges.enumerated() {
                let part = "\r\n--b\r\nContent-Range: bytes \(range.lowerBound)-\(range.upperBound - 1)/\(file.bytes.count)\r\n\r\n"
                pieces.append(.byteBuffer(ByteBuffer(string: part)))
                bytes += Array(part.utf8)
                pieces.append(.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: range.lowerBound, endIndex: range.upperBound)))
                bytes += file.bytes[range]
                if index == ranges.count - 1 {
                    pieces.append(.byteBuffer(ByteBuffer(string: "\r\n--b--\r\n")))
                    bytes += Array("\r\n--b--\r\n".utf8)
                }
            }
            return (pieces, bytes)
        }

        static func corked(_ socket: CInt) -> CInt {
            var value: CInt = -1
            var length = socklen_t(MemoryLayout<CInt>.size)
            getsockopt(socket, CInt(IPPROTO_TCP), ChannelSocket.tcpCork, &value, &length)
            return value
        }

        @Test("a multipart answer the socket has room for leaves whole, its pieces in order, and the socket is uncorked after it")
        func sendsMultipart() async throws {
            let file = try Served(size: 3 << 20)
            let connection = try Self.connection(sendBuffer: 4 << 20)
            var (pieces, bytes) = Self.multipart(file, ranges: (0..<16).map { $0 * 150_000..<($0 * 150_000 + 65_536) })
            var head = Self.head
            let outcome = ContentFastPath.sendInline(&head, &pieces, socket: connection.sending)
            guard case .sent = outcome else {
                Issue.record("not sent whole: \(outcome)")
                return
            }
            #expect(pieces.isEmpty)
            #expect(Self.corked(connection.sending) == 0, "left corked: the answer's end would wait 200 ms")
            let got = await Self.received(connection)
            #expect(got == Array(Self.head.readableBytesView) + bytes)
        }

        @Test("a multipart answer the socket fills during: the pieces passed back are what is left, from where it stopped, and the socket stays corked for the rest")
        func multipartLeavesTheRest() async throws {
            let file = try Served(size: 3 << 20)
            let connection = try Self.connection(sendBuffer: 64 << 10)
            var (pieces, bytes) = Self.multipart(file, ranges: (0..<16).map { $0 * 150_000..<($0 * 150_000 + 100_000) })
            let total = pieces.count
            var head = Self.head
            let outcome = ContentFastPath.sendInline(&head, &pieces, socket: connection.sending)
            guard case .unfinished = outcome else {
                Issue.record("1.6 MB fit in a socket of 64 KiB: \(outcome)")
                return
            }
            #expect(!pieces.isEmpty && pieces.count < total, "\(pieces.count) of \(total) pieces left")
            #expect(Self.corked(connection.sending) == 1)
            let left = pieces.reduce(0) { $0 + $1.readableBytes }
            let got = await Self.received(connection)
            #expect(got == Array(Self.head.readableBytesView) + bytes.prefix(bytes.count - left))
        }

        @Test("a socket with no room: nothing is sent, head and region are left whole")
        func fullSocket() async throws {
            let file = try Served(size: 1 << 20)
            let connection = try Self.connection()
            defer {
                close(connection.sending)
                close(connection.receiving)
            }
            Self.setBuffer(connection.sending, SO_SNDBUF, 64 << 10)
            Self.setBuffer(connection.receiving, SO_RCVBUF, 64 << 10)
            let filler = [UInt8](repeating: 7, count: 64 << 10)
            var filled = 0
            while filler.withUnsafeBytes({ send(connection.sending, $0.baseAddress, $0.count, CInt(MSG_DONTWAIT | MSG_NOSIGNAL)) }) > 0 {
                filled += 1
                try #require(filled < 1_000, "the socket never filled")
            }
            var head = Self.head
            var pieces = [IOData.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: 10, endIndex: 1 << 20))]
            let outcome = ContentFastPath.sendInline(&head, &pieces, socket: connection.sending)
            guard case .unfinished = outcome, pieces.count == 1, case .fileRegion(let region) = pieces[0] else {
                Issue.record("\(outcome), \(pieces.count) pieces left")
                return
            }
            #expect(head.readableBytes == Self.head.readableBytes)
            #expect(region.readerIndex == 10 && region.endIndex == 1 << 20)
        }

        @Test("a range that starts past the file's end, or that the file ends within, fails, as does a connection the peer has reset; none raises SIGPIPE")
        func failures() async throws {
            let file = try Served(size: 100_000)

            // Past the file's end: the head leaves, then nothing. Cut short within the range (on
            // disk after it was looked at): what there was leaves, then it fails rather than
            // leaving the rest to a path that would find nothing.
            for (range, sent) in [(150_000..<250_000, 0..<0), (50_000..<150_000, 50_000..<100_000)] {
                let connection = try Self.connection(sendBuffer: 4 << 20)
                var head = Self.head
                var pieces = [IOData.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: range.lowerBound, endIndex: range.upperBound))]
                let outcome = ContentFastPath.sendInline(&head, &pieces, socket: connection.sending)
                #expect("\(outcome)".hasPrefix("failed"), "\(range): \(outcome)")
                let got = await Self.received(connection)
                #expect(got == Array(Self.head.readableBytesView) + Array(file.bytes[sent]), "\(range)")
            }

            // The peer reads nothing and closes: its close resets the connection, and the next
            // send fails. On a thread of its own with SIGPIPE blocked, as NIO ignores it in a
            // server: the test process keeps its default action, which would end it.
            let reset = try FileSenderTests.connection()
            defer { close(reset.sending) }
            var linger = linger(l_onoff: 1, l_linger: 0)
            setsockopt(reset.receiving, SOL_SOCKET, SO_LINGER, &linger, socklen_t(MemoryLayout<linger>.size))
            close(reset.receiving)
            let handle = file.handle
            let outcome = await withCheckedContinuation { continuation in
                Thread {
                    var pipe = sigset_t()
                    sigemptyset(&pipe)
                    sigaddset(&pipe, SIGPIPE)
                    pthread_sigmask(SIG_BLOCK, &pipe, nil)
                    var head = Self.head
                    var pieces = [IOData.fileRegion(FileRegion(fileHandle: handle, readerIndex: 0, endIndex: 100_000))]
                    let outcome = ContentFastPath.sendInline(&head, &pieces, socket: reset.sending)
                    continuation.resume(returning: "\(outcome)")
                }.start()
            }
            #expect(outcome.hasPrefix("failed"), "\(outcome)")
        }
    }
#endif

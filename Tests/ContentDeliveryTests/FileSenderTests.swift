#if os(Linux)
    import Foundation
    import IAPTestSupport
    import Synchronization
    import Testing

    @testable import ContentDelivery

    /// `FileSender` over a real TCP connection on 127.0.0.1: the sending end is given to the
    /// sender, the test reads the other.
    @Suite struct FileSenderTests {
        /// A connected pair: `sending` non-blocking, as NIO's sockets are.
        struct Connection {
            let sending: CInt
            let receiving: CInt
        }

        static func connection() throws -> Connection {
            let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
            defer { close(listener) }
            var address = sockaddr_in()
            address.sin_family = sa_family_t(AF_INET)
            address.sin_addr.s_addr = inet_addr("127.0.0.1")
            var length = socklen_t(MemoryLayout<sockaddr_in>.size)
            let listening = withUnsafeMutablePointer(to: &address) { pointer in
                pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                    bind(listener, $0, length) == 0 && listen(listener, 1) == 0 && getsockname(listener, $0, &length) == 0
                }
            }
            try #require(listening)
            let receiving = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
            let connected = withUnsafeMutablePointer(to: &address) { pointer in
                pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(receiving, $0, length) == 0 }
            }
            try #require(connected)
            let sending = accept(listener, nil, nil)
            try #require(sending >= 0)
            _ = fcntl(sending, F_SETFL, fcntl(sending, F_GETFL) | O_NONBLOCK)
            return Connection(sending: sending, receiving: receiving)
        }

        /// Reads until the peer's end (or an error) on a thread of its own.
        static func readAll(_ descriptor: CInt) async -> [UInt8] {
            await withCheckedContinuation { continuation in
                Thread {
                    var bytes: [UInt8] = []
                    var buffer = [UInt8](repeating: 0, count: 1 << 16)
                    while true {
                        let count = buffer.withUnsafeMutableBytes { read(descriptor, $0.baseAddress, $0.count) }
                        if count <= 0 { break }
                        bytes += buffer[0..<count]
                    }
                    continuation.resume(returning: bytes)
                }.start()
            }
        }

        /// A file of `size` pseudo-random bytes, opened for reading (the caller closes it).
        static func file(_ folder: TemporaryFolder, size: Int) throws -> (descriptor: CInt, bytes: [UInt8]) {
            let bytes = [UInt8](pseudoRandomBytes(size, seed: 11))
            let path = try folder.write("body.bin", Data(bytes))
            let descriptor = open(path, O_RDONLY | O_CLOEXEC)
            try #require(descriptor >= 0)
            return (descriptor, bytes)
        }

        /// How a send ended, comparable.
        static func ending(_ result: Result<Void, FileSender.Failure>) -> FileSender.Failure? {
            if case .failure(let failure) = result { return failure }
            return nil
        }

        /// Sends through `sender` and waits for its completion.
        static func send(
            _ sender: FileSender, socket: CInt, file: CInt, offset: Int64, count: Int64, then: ((FileSender.Ticket) -> Void)? = nil
        ) async -> Result<Void, FileSender.Failure> {
            await withCheckedContinuation { continuation in
                let ticket = sender.send(socket: dup(socket), file: dup(file), offset: offset, count: count) { continuation.resume(returning: $0) }
                then?(ticket)
            }
        }

        /// Sends `count` bytes from `offset` of a file of `size` pseudo-random bytes to a peer
        /// that reads until the end; returns how the send ended, the file and what the peer read.
        static func sendToReader(
            threads: Int, size: Int, offset: Int64, count: Int64
        ) async throws -> (result: Result<Void, FileSender.Failure>, file: [UInt8], received: [UInt8]) {
            let folder = try TemporaryFolder()
            let sender = try FileSender(threads: threads)
            let (file, bytes) = try Self.file(folder, size: size)
            defer { close(file) }
            let connection = try Self.connection()
            defer { close(connection.receiving) }
            let received = Task { await Self.readAll(connection.receiving) }
            let result = await Self.send(sender, socket: connection.sending, file: file, offset: offset, count: count)
            close(connection.sending)
            let got = await received.value
            await sender.shutdown()
            return (result, bytes, got)
        }

        @Test("the bytes asked for leave, from the offset asked for, however many waits the socket takes")
        func sendsTheRange() async throws {
            let (result, bytes, got) = try await Self.sendToReader(threads: 2, size: 24 << 20, offset: 1_000, count: 20 << 20)
            #expect((try? result.get()) != nil, "\(result)")
            #expect(got.count == 20 << 20)
            #expect(got == Array(bytes[1_000..<(1_000 + (20 << 20))]))
        }

        @Test("a file that ends before the bytes asked for ends the send with what was sent, not a wait for ever")
        func fileEndedEarly() async throws {
            let (result, _, got) = try await Self.sendToReader(threads: 1, size: 100_000, offset: 0, count: 1 << 20)
            #expect(Self.ending(result) == .fileEnded(sent: 100_000))
            #expect(got.count == 100_000)
        }

        @Test("a peer that goes away ends the send with the socket's error; a cancelled send ends as cancelled, also on a peer that reads nothing; none starts after shutdown")
        func endings() async throws {
            let folder = try TemporaryFolder()
            let sender = try FileSender(threads: 1)
            let (file, _) = try Self.file(folder, size: 64 << 20)
            defer { close(file) }

            // The peer reads a byte and closes: its unread bytes make the close a reset, and the
            // next send raises SIGPIPE, which would end this process unless the sending thread
            // keeps it from it (the test process does not ignore SIGPIPE).
            let gone = try Self.connection()
            defer { close(gone.sending) }
            let reset = await Self.send(sender, socket: gone.sending, file: file, offset: 0, count: 64 << 20) { _ in
                var one: UInt8 = 0
                _ = read(gone.receiving, &one, 1)
                close(gone.receiving)
            }
            #expect([.socket(ECONNRESET), .socket(EPIPE)].contains(Self.ending(reset)), "\(reset)")

            // A peer that reads nothing: the send waits on a full socket until it is cancelled.
            let stalled = try Self.connection()
            defer {
                close(stalled.sending)
                close(stalled.receiving)
            }
            let cancelled = await Self.send(sender, socket: stalled.sending, file: file, offset: 0, count: 64 << 20) { ticket in
                sender.cancel(ticket)
            }
            #expect(Self.ending(cancelled) == .cancelled)

            await sender.shutdown()
            let late = await Self.send(sender, socket: stalled.sending, file: file, offset: 0, count: 1)
            #expect(Self.ending(late) == .cancelled)
        }
    }
#endif

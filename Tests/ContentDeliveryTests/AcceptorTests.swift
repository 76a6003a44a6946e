import Foundation
import IAPTestSupport
import NIOCore
import NIOHTTP1
import NIOPosix
import Synchronization
import Testing

@testable import ContentDelivery

/// Real sockets on a real listener: what `ContentAcceptor` does happens between the kernel's
/// accept and NIO's set-up of the connection, which only a listening socket has.
@Suite struct ContentAcceptorTests {
    /// The server side: a listener with the acceptor, whose connections (those it passes on)
    /// get the fast path and, behind it, a recorder of the bytes the fast path hands off.
    final class Server: @unchecked Sendable {
        let file: OneFileResolver
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let listener: any Channel
        let port: Int
        let tally = Tally()
        let observer = CountingObserver()

        /// `sendBuffer`: each connection's `SO_SNDBUF` (inherited from the listener), fixed.
        init(fileSize: Int = 200_000, sendBuffer: Int? = nil) async throws {
            let file = try OneFileResolver(size: fileSize)
            self.file = file
            let (tally, observer) = (tally, observer)
            var bootstrap = ServerBootstrap(group: group)
            if let sendBuffer {
                bootstrap = bootstrap.serverChannelOption(ChannelOptions.socketOption(.so_sndbuf), value: SocketOptionValue(sendBuffer))
            }
            listener =
                try await bootstrap
                .serverChannelOption(ContentAcceptor.deferAccept, value: 1)
                // As the server's: a client's half-close reaches the handlers.
                .childChannelOption(ChannelOptions.allowRemoteHalfClosure, value: true)
                .serverChannelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHandler(
                            ContentAcceptor(prefix: "/v1/content/", resolver: file, observer: observer), position: .first)
                    }
                }
                .childChannelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        tally.setUp.add(1, ordering: .relaxed)
                        try channel.pipeline.syncOperations.addHandlers([
                            WriteCounter(tally: tally), ContentFastPath(prefix: "/v1/content/", resolver: file, observer: observer, writesToSocket: true),
                            Recorder(tally: tally, observer: observer),
                        ])
                    }
                }
                .bind(host: "127.0.0.1", port: 0).get()
            port = try #require(listener.localAddress?.port)
        }

        func stop() async throws {
            try await listener.close()
            try await group.shutdownGracefully()
        }
    }

    final class Tally: Sendable {
        /// Connections the acceptor passed on to be set up.
        let setUp = Atomic<Int>(0)
        /// What the fast path handed off to the handler behind it.
        let handedOff = Mutex<[UInt8]>([])
        /// Writes the fast path made through NIO's channel (not straight to the socket).
        let channelWrites = Atomic<Int>(0)
        /// How many responses had finished each time bytes were handed off.
        let finishedAtHandOff = Mutex<[Int]>([])
    }

    /// Ahead of the fast path: counts the writes it makes through the channel.
    final class WriteCounter: ChannelOutboundHandler, @unchecked Sendable {
        typealias OutboundIn = IOData
        let tally: Tally
        init(tally: Tally) { self.tally = tally }
        func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
            tally.channelWrites.add(1, ordering: .relaxed)
            context.write(data, promise: promise)
        }
    }

    final class Recorder: ChannelInboundHandler, @unchecked Sendable {
        typealias InboundIn = ByteBuffer
        let tally: Tally
        let observer: CountingObserver
        init(tally: Tally, observer: CountingObserver) {
            self.tally = tally
            self.observer = observer
        }
        func channelRead(context: ChannelHandlerContext, data: NIOAny) {
            let buffer = unwrapInboundIn(data)
            let finished = observer.finished.withLock { $0.count }
            tally.finishedAtHandOff.withLock { $0.append(finished) }
            tally.handedOff.withLock { $0 += buffer.readableBytesView }
        }
    }

    final class CountingObserver: ContentObserver {
        let finished = Mutex<[(UInt, Bool)]>([])
        func responseStarted(status: HTTPResponseStatus, bytes: UInt64) {}
        func responseFinished(status: HTTPResponseStatus, bytes: UInt64, duration: Duration, succeeded: Bool) {
            finished.withLock { $0.append((status.code, succeeded)) }
        }
    }

    static func body(of response: [UInt8]) -> (head: String, body: [UInt8]) {
        guard let split = response.firstRange(of: Array("\r\n\r\n".utf8)) else { return (String(decoding: response, as: UTF8.self), []) }
        return (String(decoding: response[..<split.lowerBound], as: UTF8.self), Array(response[split.upperBound...]))
    }

    @Test("a new connection's small range, refusal or HEAD is answered as it is accepted, and a Connection: close closes it, with no NIO channel set up")
    func answeredAtAccept() async throws {
        let server = try await Server()
        let requests = [
            ("GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=1000-5095\r\nConnection: close\r\n\r\n", "206 Partial Content", Array(server.file.bytes[1000..<5096])),
            ("GET /v1/content/gone/p-1.0.zip HTTP/1.1\r\nConnection: close\r\n\r\n", "403 Forbidden", nil),
            ("HEAD /v1/content/ok/p-1.0.zip HTTP/1.1\r\nConnection: close\r\n\r\n", "200 OK", []),
            ("GET /v1/content/ok/p-1.0.zip HTTP/1.0\r\nRange: bytes=0-99\r\n\r\n", "206 Partial Content", Array(server.file.bytes[0..<100])),
        ]
        for (request, status, expected) in requests {
            let fd = try LoopbackSocket.connect(server.port)
            defer { close(fd) }
            LoopbackSocket.send(fd, request)
            let (bytes, closed) = LoopbackSocket.readToClose(fd)
            let (head, body) = Self.body(of: bytes)
            #expect(head.hasPrefix("HTTP/1.") && head.contains(status), "\(request): \(head)")
            #expect(closed, "the server closed the connection after the answer")
            if let expected { #expect(body == expected) } else { #expect(body.starts(with: Array(#"{"error""#.utf8))) }
        }
        #expect(server.tally.setUp.load(ordering: .relaxed) == 0, "every request was answered before a channel was set up")
        #expect(server.observer.finished.withLock { $0.map(\.0) } == [206, 403, 200, 206])
        #expect(server.observer.finished.withLock { $0.allSatisfy(\.1) })
        try await server.stop()
    }

    @Test("a client that sends more after asking to close still gets its answer: the write side is closed with the answer before the close resets what is unread")
    func answerBeforeReset() async throws {
        let server = try await Server()
        let fd = try LoopbackSocket.connect(server.port)
        defer { close(fd) }
        // More than the accept's read takes (RequestHeadParser.maxHead): bytes left unread at the close.
        let junk = String(repeating: "x", count: 2 * RequestHeadParser.maxHead)
        LoopbackSocket.send(fd, "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=1000-5095\r\nConnection: close\r\n\r\n" + junk)
        let (bytes, _) = LoopbackSocket.readToClose(fd)
        let (head, body) = Self.body(of: bytes)
        #expect(head.hasPrefix("HTTP/1.1 206 Partial Content"), "\(head)")
        let whole = body == Array(server.file.bytes[1000..<5096])
        #expect(whole, "the range's bytes: \(body.count) of 4096 read")
        try await server.stop()
    }

    @Test("a kept-alive connection goes on through the fast path after its first answer, with the requests it pipelined, in order")
    func keptAliveGoesOn() async throws {
        let server = try await Server()
        let fd = try LoopbackSocket.connect(server.port)
        defer { close(fd) }
        LoopbackSocket.send(
            fd,
            "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=0-9\r\n\r\nGET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=10-19\r\n\r\n")
        let responses = Responses(fd)
        let first = responses.next()
        let second = responses.next()
        #expect(first.head.hasPrefix("HTTP/1.1 206") && first.body == Array(server.file.bytes[0..<10]))
        #expect(second.head.hasPrefix("HTTP/1.1 206") && second.body == Array(server.file.bytes[10..<20]))
        LoopbackSocket.send(fd, "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=20-29\r\n\r\n")
        let third = responses.next()
        #expect(third.head.hasPrefix("HTTP/1.1 206") && third.body == Array(server.file.bytes[20..<30]))
        #expect(server.tally.setUp.load(ordering: .relaxed) == 1)
        try await server.stop()
    }

    @Test("a request it does not take (another path, a body from the file) reaches the connection's handlers byte for byte")
    func othersPassOnWithTheirBytes() async throws {
        let server = try await Server()
        let other = "POST /v1/downloads HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
        let fd = try LoopbackSocket.connect(server.port)
        defer { close(fd) }
        LoopbackSocket.send(fd, other)
        // The fast path hands the connection to what is behind it, which records and answers
        // nothing: the bytes arrive there (polled: the handing over is on the server's loop).
        var waited = 0
        while server.tally.handedOff.withLock({ $0.count }) < other.utf8.count, waited < 2_000 {
            try await Task.sleep(for: .milliseconds(5))
            waited += 1
        }
        #expect(server.tally.handedOff.withLock { $0 } == Array(other.utf8))

        // A body the fast path sends from the file (sendfile, corked): passed on unanswered.
        let whole = try LoopbackSocket.connect(server.port)
        defer { close(whole) }
        LoopbackSocket.send(whole, "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nConnection: close\r\n\r\n")
        let (bytes, closed) = LoopbackSocket.readToClose(whole)
        let (head, body) = Self.body(of: bytes)
        #expect(head.hasPrefix("HTTP/1.1 200 OK") && closed)
        let same = body == server.file.bytes
        #expect(same, "the file's \(server.file.bytes.count) bytes arrived, not \(body.count) that may differ")
        #expect(server.tally.setUp.load(ordering: .relaxed) == 2)
        try await server.stop()
    }

    @Test(
        "an answer the new socket has no room for is finished by the connection's channel, then the connection closes, as it asked or by a half-close that came meanwhile",
        arguments: ["Connection: close\r\n", ""])
    func restOfAnAnswer(closing: String) async throws {
        // Send and receive buffers of a few KiB and a 64 KiB range: the socket takes part of the
        // answer (on loopback the kernel otherwise sizes a new socket's buffer for far more).
        let server = try await Server(sendBuffer: 4096)
        let fd = try LoopbackSocket.connect(server.port, receiveBuffer: 4096)
        defer { close(fd) }
        LoopbackSocket.send(fd, "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=7-65542\r\n\(closing)\r\n")
        // Kept alive: the client says it sends nothing more, which the fast path behind hears
        // while the rest of the answer is still on its way.
        if closing.isEmpty { shutdown(fd, Int32(SHUT_WR)) }
        // Nothing is read until the channel for the rest is set up: a reader draining the socket
        // while the answer is written can let the kernel take all of it at once (seen in CI).
        var waited = 0
        while server.tally.setUp.load(ordering: .relaxed) == 0, waited < 2_000 {
            try await Task.sleep(for: .milliseconds(5))
            waited += 1
        }
        let (bytes, closed) = LoopbackSocket.readToClose(fd)
        let (head, body) = Self.body(of: bytes)
        #expect(head.hasPrefix("HTTP/1.1 206") && closed)
        let whole = body == Array(server.file.bytes[7..<65543])
        #expect(whole, "the range's 65,536 bytes arrived, not \(body.count) that may differ")
        #expect(server.tally.setUp.load(ordering: .relaxed) == 1, "the rest was sent by a channel set up for it")
        #expect(server.observer.finished.withLock { $0.map(\.0) } == [206])
        #expect(server.observer.finished.withLock { $0.allSatisfy(\.1) }, "counted once, when all of it had left")
        try await server.stop()
    }

    @Test("bytes read after an answer the new socket had no room for reach the fast path only once all of that answer has left")
    func restOfAnAnswerBeforeTheNext() async throws {
        // The fast path writes small answers straight to the socket when NIO holds nothing of
        // its own: given a request while the acceptor's rest still waits in NIO, its answer
        // could pass that rest. A request it hands off shows when it got the bytes.
        let (server, responses) = try await Self.connection(buffers: 4096)
        let other = "POST /v1/downloads HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
        LoopbackSocket.send(responses.fd, "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=7-65542\r\n\r\n" + other)
        let first = responses.next()
        let whole = first.body == Array(server.file.bytes[7..<65543])
        #expect(first.head.hasPrefix("HTTP/1.1 206") && whole, "the range's 65,536 bytes arrived, not \(first.body.count) that may differ")
        var waited = 0
        while server.tally.handedOff.withLock({ $0.count }) < other.utf8.count, waited < 2_000 {
            try await Task.sleep(for: .milliseconds(5))
            waited += 1
        }
        #expect(server.tally.handedOff.withLock { $0 } == Array(other.utf8))
        #expect(server.tally.finishedAtHandOff.withLock { $0.first } == 1, "the first answer had left when the next request was passed on")
        try await server.stop()
    }

    /// A server and a connection to it; `buffers`: the server's send and the client's receive
    /// buffer, fixed; `answered`: one request answered first (by the acceptor), so that the
    /// connection has met the fast path.
    static func connection(buffers: Int? = nil, answered: Bool = false) async throws -> (Server, Responses) {
        let server = try await Server(sendBuffer: buffers)
        let responses = Responses(try LoopbackSocket.connect(server.port, receiveBuffer: buffers), owning: true)
        if answered {
            LoopbackSocket.send(responses.fd, pipelined(1, from: 0))
            expectRanges(responses, 1, from: 0, in: server)
        }
        return (server, responses)
    }

    /// `count` requests for 4 KiB ranges, the i-th at `start + i * 4096`, in one send.
    static func pipelined(_ count: Int, from start: Int) -> String {
        (0..<count).map { "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=\(start + $0 * 4096)-\(start + $0 * 4096 + 4095)\r\n\r\n" }.joined()
    }

    static func expectRanges(_ responses: Responses, _ count: Int, from start: Int, in server: Server) {
        for i in 0..<count {
            let response = responses.next()
            let offset = start + i * 4096
            let same = response.body == Array(server.file.bytes[offset..<(offset + 4096)])
            #expect(response.head.hasPrefix("HTTP/1.1 206") && same, "answer \(i + 1) of \(count): \(response.head.prefix(40)), \(response.body.count) bytes")
            if !same { return }
        }
    }

    @Test("a kept-alive connection's small answers are written straight to its socket, none through NIO's channel, in order")
    func smallAnswersGoStraightToTheSocket() async throws {
        let (server, responses) = try await Self.connection(answered: true)
        LoopbackSocket.send(responses.fd, Self.pipelined(40, from: 100))
        Self.expectRanges(responses, 40, from: 100, in: server)
        #expect(server.tally.channelWrites.load(ordering: .relaxed) == 0, "no answer went through the channel")
        #expect(server.observer.finished.withLock { $0.count } == 41)
        try await server.stop()
    }

    @Test("answers the socket has no room for go through NIO's channel behind those written straight to it, in order; once they have left, answers go straight again")
    func straightAndChannelWritesKeepTheirOrder() async throws {
        let (server, responses) = try await Self.connection(buffers: 4096, answered: true)
        // Forty 4 KiB answers to a client that reads none until all its requests are sent:
        // the socket's few KiB fill and the rest waits in the channel.
        LoopbackSocket.send(responses.fd, Self.pipelined(40, from: 3))
        Self.expectRanges(responses, 40, from: 3, in: server)
        let throughChannel = server.tally.channelWrites.load(ordering: .relaxed)
        #expect(throughChannel > 0, "part of the answers waited in the channel")
        LoopbackSocket.send(responses.fd, Self.pipelined(1, from: 9))
        Self.expectRanges(responses, 1, from: 9, in: server)
        #expect(server.tally.channelWrites.load(ordering: .relaxed) == throughChannel, "the next answer went straight to the socket")
        try await server.stop()
    }

    @Test("a channel's socket handle reads the descriptor NIO uses while the channel is open, and -1 once NIO has closed it, so a direct write after the close reaches no other connection")
    func socketHandleAfterClose() async throws {
        let server = try await Server()
        let client = try await ClientBootstrap(group: server.group).connect(host: "127.0.0.1", port: server.port).get()
        let (open, channels, closed) = try await client.eventLoop.flatSubmit {
            let handle = ChannelSocket.handle(of: client)
            let open = handle?.descriptor ?? -2
            let channels = ChannelSocket.descriptor(of: client) ?? -2
            return client.close().assumeIsolated().map { (open, channels, handle?.descriptor ?? -2) }.nonisolated()
        }.get()
        #expect(open >= 0 && open == channels, "the handle read \(open), the channel's socket is \(channels)")
        #expect(closed == -1)
        try await server.stop()
    }

    @Test("a connection that sends nothing is still handed over once the deferral ends, and served")
    func silentConnectionIsHandedOver() async throws {
        let server = try await Server()
        let fd = try LoopbackSocket.connect(server.port)
        defer { close(fd) }
        var waited = 0
        while server.tally.setUp.load(ordering: .relaxed) == 0, waited < 2_000 {
            try await Task.sleep(for: .milliseconds(5))
            waited += 1
        }
        #expect(server.tally.setUp.load(ordering: .relaxed) == 1, "accepted without a byte, within 10 s")
        LoopbackSocket.send(fd, "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=0-9\r\n\r\n")
        let response = Responses(fd).next()
        #expect(response.head.hasPrefix("HTTP/1.1 206") && response.body == Array(server.file.bytes[0..<10]))
        try await server.stop()
    }
}

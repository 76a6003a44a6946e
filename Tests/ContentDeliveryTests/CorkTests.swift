import Foundation
import IAPTestSupport
import NIOCore
import NIOPosix
import Synchronization
import Testing

@testable import ContentDelivery

/// A real socket: `TCP_CORK` exists only there. A cork left on holds the end of every response
/// for 200 ms, which no byte-checking test notices, so the socket's state is read back.
@Suite struct CorkTests {
    /// Keeps the server side of the one connection the test makes.
    final class Accepted: ChannelInboundHandler, @unchecked Sendable {
        typealias InboundIn = ByteBuffer
        let channel = Mutex<(any Channel)?>(nil)
        func handlerAdded(context: ChannelHandlerContext) { channel.withLock { $0 = context.channel } }
    }

    @Test(
        "a response with a file region, a range or a whole archive, is corked until all of it has left, and uncorked then",
        arguments: [
            (300_000, "Range: bytes=1000-200999\r\n", 1000..<201_000),
            (9_500_000, "", 0..<9_500_000),
        ])
    func corkIsReleased(size: Int, range: String, expected: Range<Int>) async throws {
        let file = try OneFileResolver(size: size)
        let accepted = Accepted()
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let server = try await ServerBootstrap(group: group)
            .childChannelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.addHandler(accepted)
                    try channel.pipeline.syncOperations.addHandler(ContentFastPath(prefix: "/v1/content/", resolver: file), position: .first)
                }
            }
            .bind(host: "127.0.0.1", port: 0).get()
        let port = try #require(server.localAddress?.port)

        let fd = try LoopbackSocket.connect(port)
        defer { close(fd) }
        let request = Array("GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\n\(range)\r\n".utf8)
        #expect(send(fd, request, request.count, 0) == request.count)
        var received: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        var headEnd: Int?
        while headEnd.map({ received.count - $0 }) ?? -1 < expected.count {
            let count = recv(fd, &chunk, chunk.count, 0)
            guard count > 0 else { break }
            received += chunk[..<count]
            if headEnd == nil { headEnd = received.firstRange(of: Array("\r\n\r\n".utf8))?.upperBound }
        }
        #expect(received.count > expected.count, "the whole response arrived")
        #expect(Array(received.suffix(expected.count)) == Array(file.bytes[expected]))

        let channel = try #require(accepted.channel.withLock { $0 })
        let cork = try await channel.eventLoop.submit {
            try channel.syncOptions!.getOption(ChannelOptions.tcpOption(.init(rawValue: 3)))
        }.get()
        #expect(cork == 0, "TCP_CORK is off again once the response has been flushed")
        try await server.close()
        try await group.shutdownGracefully()
    }
}

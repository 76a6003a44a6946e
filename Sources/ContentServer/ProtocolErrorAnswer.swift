import Foundation
import IAPProtocol
import NIOCore
import NIOHTTP1

/// Answers a request head NIO's decoder refuses with the API's error envelope, naming the problem
/// and the limit, instead of Hummingbird's bare 400 with no body: 431 for a head over the
/// decoder's limits (a header flood, a huge field), 400 for anything else that is not HTTP/1.1.
/// The connection is closed after it, as the bytes that follow cannot be trusted to start a
/// request.
///
/// Only between requests: an error in the middle of a request (a malformed chunked body) goes on
/// to Hummingbird, whose answer for that request may already have started.
final class ProtocolErrorAnswer: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias InboundOut = HTTPServerRequestPart
    typealias OutboundIn = HTTPServerResponsePart
    typealias OutboundOut = HTTPServerResponsePart

    /// Why a head is refused, for the message: the limits `ContentHTTPChannel` gives the decoder.
    let limits: String
    /// From a request's head until its response has been written.
    private var inRequest = false

    init(limits: String) {
        self.limits = limits
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        if case .head = unwrapInboundIn(data) { inRequest = true }
        context.fireChannelRead(data)
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        if case .end = unwrapOutboundIn(data) { inRequest = false }
        context.write(data, promise: promise)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        guard let parse = error as? HTTPParserError, !inRequest else {
            context.fireErrorCaught(error)
            return
        }
        let (status, refusal): (HTTPResponseStatus, APIError) =
            switch parse {
            case .headerOverflow:
                (.requestHeaderFieldsTooLarge, APIError(.tooLarge, "the request head is over the server's limits (\(limits)): send fewer or smaller header fields"))
            default:
                (.badRequest, APIError(.malformed, "the request is not valid HTTP/1.1 (\(parse)): check the client sending it"))
            }
        let body = WireJSON.line(refusal.envelope)
        var headers = HTTPHeaders()
        headers.add(name: "Date", value: HTTPDate.format(Date()))
        headers.add(name: "Content-Type", value: "application/json")
        headers.add(name: "Cache-Control", value: "no-store")
        headers.add(name: "Content-Length", value: String(body.count))
        headers.add(name: "Connection", value: "close")
        context.write(wrapOutboundOut(.head(HTTPResponseHead(version: .http1_1, status: status, headers: headers))), promise: nil)
        context.write(wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(bytes: body)))), promise: nil)
        context.writeAndFlush(wrapOutboundOut(.end(nil))).assumeIsolated().whenComplete { _ in
            // Closed in two steps, as nginx's lingering close: the rest of a flood still unread
            // would make an immediate close reset the connection, and a client told of the reset
            // may drop the answer before reading it. The output ends now; what still arrives is
            // read and dropped (the decoder has failed) until the connection closes.
            context.close(mode: .output, promise: nil)
            context.eventLoop.assumeIsolated().scheduleTask(in: Self.linger) { context.close(promise: nil) }
        }
    }

    /// How long the input stays open after the answer.
    static let linger = TimeAmount.seconds(2)
}

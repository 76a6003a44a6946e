import NIOCore
import NIOHTTP1

/// Drops `Expect` from HTTP/1.0 request heads before the routes see them: RFC 9110 §10.1.1 says
/// a server must ignore a 100-continue expectation in an HTTP/1.0 request, whose client cannot
/// read an interim response, and the routes' context (``ServerRequestContext``) sees no version.
final class HTTP10Expectations: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias InboundOut = HTTPServerRequestPart

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        if case .head(var head) = unwrapInboundIn(data), head.version.major == 1, head.version.minor == 0, head.headers.contains(name: "expect") {
            head.headers.remove(name: "expect")
            context.fireChannelRead(wrapInboundOut(.head(head)))
            return
        }
        context.fireChannelRead(data)
    }
}

import NIOCore

/// Holds the server's "stop taking requests" event (`ChannelShouldQuiesceEvent`) until every
/// write behind it has completed, then passes it on.
///
/// Why: NIO's HTTP/1 pipelining handler closes a connection on that event as soon as the last
/// response's end has been *written*, which for an archive sent with sendfile is long before it
/// has left: a download in flight at shutdown was cut off instead of finishing within the drain
/// period. Placed in front of the HTTP/1 handlers, this handler sees their writes complete.
public final class QuiesceAfterWrites: ChannelDuplexHandler, RemovableChannelHandler {
    public typealias InboundIn = NIOAny
    public typealias OutboundIn = NIOAny

    private var pendingWrites = 0
    private var quiesceHeld = false

    public init() {}

    public func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let written = promise ?? context.eventLoop.makePromise()
        pendingWrites += 1
        written.futureResult.assumeIsolated().whenComplete { [self] _ in
            pendingWrites -= 1
            if pendingWrites == 0, quiesceHeld {
                quiesceHeld = false
                context.fireUserInboundEventTriggered(ChannelShouldQuiesceEvent())
            }
        }
        context.write(data, promise: written)
    }

    public func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if event is ChannelShouldQuiesceEvent, pendingWrites > 0 {
            quiesceHeld = true
            return
        }
        context.fireUserInboundEventTriggered(event)
    }
}

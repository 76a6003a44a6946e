import ContentDelivery
import NIOCore
import NIOHTTP1

/// Closes a connection whose next request head is not complete within `timeout` of the
/// connection opening or of the previous request ending, as nginx's `client_header_timeout` does.
///
/// The read-idle timeout alone does not stop a slow-loris client: one byte every few seconds keeps
/// the connection "active" for ever while it holds a slot. The deadline runs from the moment the
/// previous response was sent (not its request: a 2 GiB response takes minutes), so it also
/// bounds how long a kept-alive connection may sit between requests.
final class RequestHeadDeadline: ChannelDuplexHandler, RemovableChannelHandler, RequestHeadObserver {
    typealias InboundIn = HTTPServerRequestPart
    typealias InboundOut = HTTPServerRequestPart
    typealias OutboundIn = HTTPServerResponsePart
    typealias OutboundOut = HTTPServerResponsePart

    private let timeout: TimeAmount
    /// When the next request head must be complete; nil while a request is being served.
    private var deadline: NIODeadline?
    /// One timer at a time, moved forward lazily when it fires early: re-arming a timer for every
    /// request showed in the profile of small range requests.
    private var timer: Scheduled<Void>?
    /// Kept for the fast path's calls, which arrive outside this handler's own events.
    private var context: ChannelHandlerContext?

    init(timeout: TimeAmount) {
        self.timeout = timeout
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        if context.channel.isActive { arm(context) }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.context = nil
    }

    func channelActive(context: ChannelHandlerContext) {
        arm(context)
        context.fireChannelActive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head:
            deadline = nil
        case .body, .end:
            break
        }
        context.fireChannelRead(data)
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        guard case .end = unwrapOutboundIn(data) else {
            context.write(data, promise: promise)
            return
        }
        // Armed once the whole response has left, file regions included.
        let sent = promise ?? context.eventLoop.makePromise()
        sent.futureResult.assumeIsolated().whenSuccess { [self] in
            if context.channel.isActive { arm(context) }
        }
        context.write(data, promise: sent)
    }

    // MARK: RequestHeadObserver (requests answered by the fast path ahead of the decoder)

    func requestHeadReceived() {
        deadline = nil
    }

    func responseSent() {
        if let context, context.channel.isActive { arm(context) }
    }

    func channelInactive(context: ChannelHandlerContext) {
        timer?.cancel()
        timer = nil
        deadline = nil
        context.fireChannelInactive()
    }

    private func arm(_ context: ChannelHandlerContext) {
        let due = NIODeadline.now() + timeout
        deadline = due
        if timer == nil { schedule(context, at: due) }
    }

    private func schedule(_ context: ChannelHandlerContext, at due: NIODeadline) {
        timer = context.eventLoop.assumeIsolated().scheduleTask(deadline: due) { [self] in
            fired(context)
        }
    }

    private func fired(_ context: ChannelHandlerContext) {
        timer = nil
        guard let deadline else { return }  // a request is being served; the next response end re-arms
        if deadline <= .now() {
            context.close(promise: nil)
        } else {
            schedule(context, at: deadline)
        }
    }
}

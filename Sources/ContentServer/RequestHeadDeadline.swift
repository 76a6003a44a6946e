import ContentDelivery
import NIOCore
import NIOHTTP1

/// Closes a connection whose next request head is not complete within `timeout` of the
/// connection opening or of the previous request ending, as nginx's `client_header_timeout` does,
/// or whose request body sends nothing for `bodyTimeout`, as its `client_body_timeout` does
/// (``HeadDeadline`` holds the rules).
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

    private var state: HeadDeadline<ContinuousClock.Instant>
    private var timer: Scheduled<Void>?
    /// Kept for the fast path's calls, which arrive outside this handler's own events.
    private var context: ChannelHandlerContext?
    /// Whether the channel is active, kept from its events: the fast path reports every response,
    /// and asking the channel each time retained and released it.
    private var active = false

    init(timeout: Duration, bodyTimeout: Duration) {
        state = HeadDeadline(timeout: timeout, bodyTimeout: bodyTimeout)
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        active = context.channel.isActive
        if active { awaitHead(context) }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.context = nil
    }

    func channelActive(context: ChannelHandlerContext) {
        active = true
        awaitHead(context)
        context.fireChannelActive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head(let head):
            state.headReceived()
            // Only a head that announces a body opens one: a GET's end follows in the same read,
            // and arming a timer for it would cost one per request.
            if head.headers.contains(name: "transfer-encoding") || head.headers.first(name: "content-length").map({ $0 != "0" }) == true {
                state.bodyOpened()
            }
        case .body:
            state.partArrived()
        case .end:
            state.bodyEnded()
        }
        context.fireChannelRead(data)
    }

    func read(context: ChannelHandlerContext) {
        // The body's clock runs from when the server asks for more, not from the last part: a
        // handler busy with what it has (an upload parsed and written to disk) asks for nothing
        // meanwhile, and that pause is the server's, not the client's.
        if state.bodyOpen { perform(state.moreRequested(now: .now), context) }
        context.read()
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        guard case .end = unwrapOutboundIn(data) else {
            context.write(data, promise: promise)
            return
        }
        // Due again once the whole response has left, file regions included.
        let sent = promise ?? context.eventLoop.makePromise()
        sent.futureResult.assumeIsolated().whenSuccess { [self] in
            if context.channel.isActive { awaitHead(context) }
        }
        context.write(data, promise: sent)
    }

    // MARK: RequestHeadObserver (requests answered by the fast path ahead of the decoder)

    func requestHeadReceived() {
        state.headReceived()
    }

    func responseSent() {
        if active, let context { awaitHead(context) }
    }

    func channelInactive(context: ChannelHandlerContext) {
        active = false
        if state.connectionClosed() { timer?.cancel() }
        timer = nil
        context.fireChannelInactive()
    }

    private func awaitHead(_ context: ChannelHandlerContext) {
        perform(state.awaitHead(now: .now), context)
    }

    private func perform(_ action: HeadDeadline<ContinuousClock.Instant>.Action, _ context: ChannelHandlerContext) {
        switch action {
        case .none:
            break
        case .close:
            timer = nil
            context.close(promise: nil)
        case .scheduleTimer(let due):
            timer?.cancel()
            let delay = ContinuousClock.now.duration(to: due)
            timer = context.eventLoop.assumeIsolated().scheduleTask(in: TimeAmount(max(.zero, delay))) { [self] in
                timer = nil
                perform(state.timerFired(now: .now), context)
            }
        }
    }
}

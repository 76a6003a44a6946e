import NIOCore

#if canImport(Glibc)
    import Glibc
#endif

/// Answers a new connection's first request as the connection is accepted, before NIO sets the
/// connection up, when that request is one ``ContentFastPath`` takes and its whole answer is one
/// buffer (a range of up to 64 KiB, a refusal, a `HEAD`): the request is read and answered, and
/// a connection that asked to close is closed, without ever being registered with the event
/// loop. Every other connection goes on to the listener's accept handler and meets the fast path
/// and NIO's decoder as before, with the bytes read (a request it did not take, or those after
/// the one answered) and any part of the answer the socket had no room for.
///
/// Why: a client that opens a connection per request (HTTP/1.0, `Connection: close`, many
/// devices behind a proxy) cost the server about 114 µs of CPU per request through NIO's
/// channel (options applied through futures, a pipeline of four handlers, two timers, three
/// `epoll_ctl` calls, the pending-writes machinery and the close's), against nginx's 41 µs
/// (docs/performance.md, twenty-second stop). Here it is read, answered and closed in three
/// system calls after the accept: 59 µs, the rest mostly the kernel's. NIO offers no hook
/// between its accept and its channel set-up, so this sits on the listener's pipeline, where
/// accepted channels pass before they are registered, and finds the socket with
/// ``ChannelSocket``.
///
/// Added to each listening channel's pipeline, ahead of the accept handler; it holds its
/// listener's loop's state (the receive buffer, the last resolution and `Date` field), so one
/// instance serves one listener.
public final class ContentAcceptor: ChannelInboundHandler {
    public typealias InboundIn = any Channel
    public typealias InboundOut = any Channel

    private let prefix: String
    private let resolver: any ContentResolver
    private let observer: (any ContentObserver)?
    private let maxRanges: Int
    private let parser: RequestHeadParser
    /// Touched only on the listener's event loop, one accepted connection at a time. The last
    /// resolution is reused for the next connection that asks for the same URL, under the same
    /// conditions as on one connection (see `ResolvedContent`): the grant token in the URL is the
    /// whole credential, whichever connection it arrives on.
    private var memory = ResponseMemory()
    private var scratch = ByteBuffer()
    private var received: ByteBuffer?

    /// `TCP_DEFER_ACCEPT` (9 in <netinet/tcp.h>, not imported into Swift), in seconds, for the
    /// listener (Linux only): the kernel hands a connection to `accept` once its first bytes
    /// have arrived, as nginx's `listen ... deferred` does, so the first request is there to
    /// answer. Without it most new connections were accepted before their request arrived and
    /// went through NIO after all: a new connection for each 4 KiB range, 3 alternated rounds,
    /// 9-17% more requests a second than before this handler; with it 30-39%, and a p99 of
    /// 1.0-1.3 ms against 1.9-2.0 at 16 connections (docs/performance.md, twenty-second stop).
    /// A connection that sends nothing is handed over when the deferral ends (one SYN-ACK
    /// retransmission, about a second, for a value of 1) and meets the same timeouts.
    public static let deferAccept = ChannelOptions.tcpOption(.init(rawValue: 9))

    public init(
        prefix: String, resolver: any ContentResolver, observer: (any ContentObserver)? = nil,
        maxRanges: Int = RangeEvaluator.defaultMaxRanges
    ) {
        self.prefix = prefix
        self.resolver = resolver
        self.observer = observer
        self.maxRanges = maxRanges
        parser = RequestHeadParser(prefix: prefix)
    }

    public func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        #if os(Linux)
            if answerFirst(unwrapInboundIn(data), context: context) { return }
        #endif
        context.fireChannelRead(data)
    }

    #if os(Linux)
        /// Whether `child` was dealt with here (answered and closed, or answered and passed on
        /// with what it still needs); false passes it on untouched.
        private func answerFirst(_ child: any Channel, context: ChannelHandlerContext) -> Bool {
            // The child's loop is the listener's (each listener has a group of one loop): its
            // pipeline is set up here, synchronously.
            guard child.eventLoop.inEventLoop, let socket = ChannelSocket.descriptor(of: child) else { return false }
            // Taken out while in use: a buffer referenced twice would be copied by the writes.
            var buffer = received ?? context.channel.allocator.buffer(capacity: RequestHeadParser.maxHead)
            received = nil
            defer { received = buffer }
            buffer.clear()
            var count = 0
            buffer.writeWithUnsafeMutableBytes(minimumWritableBytes: RequestHeadParser.maxHead) { raw in
                count = recv(socket, raw.baseAddress, RequestHeadParser.maxHead, Int32(MSG_DONTWAIT))
                return max(0, count)
            }
            // Nothing yet (the request is still on its way), the peer gone, or an error: NIO's
            // channel waits for it, or finds out.
            guard count > 0 else { return false }
            guard case .request(let request, let length) = parser.parse(buffer, knownURI: memory.resolved?.uri) else {
                return handOver(child, AcceptedBytes(input: buffer), context: context)
            }
            var response = ContentResponse.make(
                request.content, prefix: prefix, maxRanges: maxRanges, resolver: resolver, memory: &memory,
                eventLoop: context.eventLoop, allocator: context.channel.allocator)
            // One buffer is left when the body was one or none (see `serialize`).
            var (head, pieces) = response.serialize(http10: request.http10, scratch: &scratch)
            guard pieces.isEmpty else {
                // A body from the file: the channel's fast path answers it (sendfile, corked).
                return handOver(child, AcceptedBytes(input: buffer), context: context)
            }
            let report = ResponseReport(response, observer: observer)
            buffer.moveReaderIndex(forwardBy: length)
            let rest = buffer.readableBytes > 0 && response.keepAlive ? buffer : nil
            // An answer the connection closes after is held (`MSG_MORE`) for the FIN to go with
            // it: one segment, as nginx's corked answers leave, where two cost the loopback's
            // sending and the client's wake-up twice. A rest the socket had no room for goes
            // through the channel, which pushes it all.
            switch ContentFastPath.sendBuffer(&head, more: !response.keepAlive, socket: socket) {
            case .sent:
                _ = report.finished(.success(()), observer: observer)
                guard response.keepAlive else {
                    // The write side first: the answer and the FIN leave now. A close alone with
                    // bytes still unread (a client that sent more after asking to close, which
                    // RFC 9112 §9.6 forbids) would reset the connection and drop the held answer.
                    shutdown(socket, CInt(SHUT_WR))
                    child.close(promise: nil)
                    return true
                }
                return rest.map { handOver(child, AcceptedBytes(input: $0), context: context) } ?? false
            case .failed(let error):
                _ = report.finished(.failure(error), observer: observer)
                child.close(promise: nil)
                return true
            case .unfinished:
                break
            }
            // The socket took part of the answer (or none): the channel sends the rest, then goes on.
            let unsent = AcceptedBytes.Unsent(bytes: head, report: report, observer: observer, closeAfter: !response.keepAlive)
            return handOver(child, AcceptedBytes(input: rest, unsent: unsent), context: context)
        }

        /// Passes `child` on with `bytes` first in its pipeline; closes it if that is refused.
        private func handOver(_ child: any Channel, _ bytes: AcceptedBytes, context: ChannelHandlerContext) -> Bool {
            do {
                try child.pipeline.syncOperations.addHandler(bytes, position: .first)
            } catch {
                child.close(promise: nil)
                return true
            }
            context.fireChannelRead(wrapInboundOut(child))
            return true
        }
    #endif
}

/// What ``ContentAcceptor`` leaves for an accepted connection it passes on: the rest of an answer
/// the socket had no room for, sent first, and the bytes it read and did not answer, handed to
/// the handlers behind as the connection's first read. First in the pipeline; removes itself
/// once done, unless the connection is to close after the answer, when it drops what is read.
///
/// While the rest of the answer is on its way, a shutdown's quiesce event and the client's
/// half-close wait here: the fast path behind knows nothing of this answer and, seeing either
/// with nothing of its own in flight, would close the connection under it. So do the bytes read
/// (and reading stops): the fast path writes its answers straight to the socket when NIO holds
/// nothing of its own, and must not pass this one.
final class AcceptedBytes: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    struct Unsent {
        let bytes: ByteBuffer
        let report: ResponseReport
        let observer: (any ContentObserver)?
        /// The answer said `Connection: close`: nothing more is read or answered.
        let closeAfter: Bool
    }

    private var input: ByteBuffer?
    private var unsent: Unsent?
    private let closeAfter: Bool
    /// The rest of the answer has been written and has not left yet.
    private var sending = false
    /// Events held back while `sending`, passed on once the answer has left.
    private var held: [Any] = []
    /// A read asked for while `sending`, made once the answer has left.
    private var readHeld = false

    init(input: ByteBuffer?, unsent: Unsent? = nil) {
        self.input = input
        self.unsent = unsent
        closeAfter = unsent?.closeAfter ?? false
    }

    func channelActive(context: ChannelHandlerContext) {
        // First, so the handlers behind arm their timers (a client that stops reading the rest
        // of the answer is cut by the idle timeout, as on any connection).
        context.fireChannelActive()
        guard context.channel.isActive else { return }
        if let unsent {
            self.unsent = nil
            sending = true
            let written = context.eventLoop.makePromise(of: Void.self)
            context.writeAndFlush(wrapOutboundOut(unsent.bytes), promise: written)
            written.futureResult.assumeIsolated().whenComplete { [self] result in
                sending = false
                if !unsent.report.finished(result, observer: unsent.observer) || unsent.closeAfter {
                    context.close(promise: nil)
                    return
                }
                passInput(context: context)
                for event in held { context.fireUserInboundEventTriggered(event) }
                held = []
                if readHeld {
                    readHeld = false
                    context.read()
                }
                context.pipeline.syncOperations.removeHandler(context: context, promise: nil)
            }
        }
        guard !closeAfter, !sending else { return }
        passInput(context: context)
        context.pipeline.syncOperations.removeHandler(context: context, promise: nil)
    }

    private func passInput(context: ChannelHandlerContext) {
        guard let input else { return }
        self.input = nil
        context.fireChannelRead(wrapInboundOut(input))
        context.fireChannelReadComplete()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        // After an answer that closes the connection nothing more is taken.
        guard !closeAfter else { return }
        guard sending else {
            context.fireChannelRead(data)
            return
        }
        var bytes = unwrapInboundIn(data)
        if input == nil { input = bytes } else { input!.writeBuffer(&bytes) }
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        if !closeAfter, !sending { context.fireChannelReadComplete() }
    }

    func read(context: ChannelHandlerContext) {
        // What is read while the answer is on its way waits here: read no more of it meanwhile.
        if sending {
            readHeld = true
            return
        }
        context.read()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if sending, event is ChannelShouldQuiesceEvent || (event as? ChannelEvent) == .inputClosed {
            // After an answer that closes the connection they change nothing.
            if !closeAfter { held.append(event) }
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        // Closed before it became active: the answer never left.
        if let unsent {
            self.unsent = nil
            _ = unsent.report.finished(.failure(ChannelError.ioOnClosedChannel), observer: unsent.observer)
        }
    }
}

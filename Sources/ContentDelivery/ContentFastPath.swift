import NIOCore
import NIOHTTP1
import NIOPosix

#if canImport(Glibc)
    import Glibc
#endif

/// Told of the requests `ContentFastPath` answers, so that a request-head deadline behind it
/// (which sees only what NIO's decoder parses) covers them too. Called on the channel's event loop.
/// A direct call rather than a user event: an event would cross four handlers per request.
public protocol RequestHeadObserver: AnyObject {
    /// A complete request head was read: its deadline is met.
    func requestHeadReceived()
    /// A response has been sent completely: the deadline for the next head starts.
    func responseSent()
}

/// Answers plain content requests straight from the bytes read, ahead of NIO's HTTP/1 decoder:
/// `GET` or `HEAD` of a path under the prefix, HTTP/1.1 or 1.0, no body, well-formed headers
/// within limits. At the first request it does not take (any other path, a body, an `Upgrade`,
/// a malformed or oversized head) it hands the connection to the decoder for good, passing on
/// the bytes it holds, so everything unusual meets NIO's parser and the handlers behind it.
///
/// Why it exists: small range requests are bound by per-request CPU, and NIO's HTTP/1 path
/// (llhttp, `HTTPHeaders`, the pipelining handler, the encoder, three more handlers) costs far
/// more per request than nginx spends on the whole request (docs/performance.md). The answer itself is decided by
/// the same `ContentResponse` as for requests that come through the decoder.
///
/// Responses leave in request order: they are written as the requests are parsed, and after a
/// hand-off the decoder's responses queue behind them. A response of one buffer (a small range,
/// a refusal, a `HEAD`) is written straight to the socket as the event loop's pass ends, when
/// nothing of the connection's waits in NIO's queue (Linux); one with a body from the file of up
/// to 2 MiB (a range, or a multipart answer's parts) is sent straight to the socket at once
/// (`sendInline`); anything else, and what the socket had no room for, goes through NIO, or a
/// sending thread for a large body, after whatever was kept for the direct write. While the
/// channel is not writable (a big file on its way, or a client that pipelines without reading)
/// it stops parsing and reading.
public final class ContentFastPath: ChannelDuplexHandler {
    public typealias InboundIn = ByteBuffer
    public typealias InboundOut = ByteBuffer
    public typealias OutboundIn = IOData
    public typealias OutboundOut = IOData

    private let prefix: String
    private let resolver: any ContentResolver
    private let observer: (any ContentObserver)?
    private let heads: (any RequestHeadObserver)?
    private let maxRanges: Int
    private let parser: RequestHeadParser
    private let installDecoder: ((ChannelPipeline.SynchronousOperations) throws -> Void)?
    #if os(Linux)
        private let sender: FileSender?
        /// The send of a large body in progress on a sending thread, to cancel if the connection closes.
        @exclusivity(unchecked) private var ticket: FileSender.Ticket?
    #endif
    /// A body is on its way outside NIO: nothing else may be written or parsed until it has left.
    @exclusivity(unchecked) private var sendingElsewhere = false
    #if os(Linux)
        /// The connection's socket, for answers written directly (see `writeUnsent`), found at
        /// the first: nil before then, when it cannot be had, or without `writesToSocket`.
        @exclusivity(unchecked) private var directSocket: ChannelSocket.Handle?
        @exclusivity(unchecked) private var directLooked: Bool
        /// Answers of one buffer made in this pass, written straight to the socket when it ends.
        @exclusivity(unchecked) private var unsent: ByteBuffer?
    #endif
    @exclusivity(unchecked) private var stalls = StalledReader()

    // The state is touched only on the channel's event loop, one call at a time; unchecked
    // exclusivity drops runtime access checks that every request would pay for.

    /// Bytes read and not yet answered (a head split over reads, or pipelined requests).
    @exclusivity(unchecked) private var pending: ByteBuffer?
    @exclusivity(unchecked) private var handedOff = false
    /// Responses with a file, or before a close, written and not yet sent completely (responses
    /// of one buffer are done with once written).
    @exclusivity(unchecked) private var inFlight = 0
    /// A response said `Connection: close`, or the client closed its side: no more requests.
    @exclusivity(unchecked) private var closing = false
    @exclusivity(unchecked) private var readHeld = false
    /// The response head is built here, then copied in front of a small body (or sent as is).
    @exclusivity(unchecked) private var headScratch = ByteBuffer()
    @exclusivity(unchecked) private var memory = ResponseMemory()
    /// The channel's writability and allocator, kept here: every `context.channel` access retains
    /// and releases the channel through an existential, several times per request.
    @exclusivity(unchecked) private var writable = true
    @exclusivity(unchecked) private var allocator = ByteBufferAllocator()

    /// Bodies of one file region at least this long go through the `FileSender` when there is
    /// one, once the event loop's own send (up to ``inlineMaximum``) has found the socket full:
    /// below it, the two hops between threads cost more than the sending saves. From the sending
    /// threads, 1 MiB ranges at 64 connections ran at 1.00-1.13x the rate with 0.64-0.89x the p99
    /// they had through NIO (docs/performance.md, twenty-third stop); sent from the event loop
    /// first, at 1.28-1.36x nginx's rate (thirty-eighth stop).
    public static let elsewhereMinimum = 1 << 20

    /// - Parameters:
    ///   - installDecoder: adds the HTTP/1 handlers behind this one at the first request it does
    ///     not take. A connection that only downloads then never has them: every `read` and every
    ///     event would otherwise cross them on every request. Without it, the handlers behind must
    ///     be in place from the start.
    ///   - sender: sends bodies of ``elsewhereMinimum`` bytes or more (Linux); without it, or
    ///     where it cannot take a connection, they go through NIO.
    ///   - writesToSocket: answers of one buffer are written straight to the connection's socket
    ///     (Linux), not through the handlers ahead of this one. Only for a pipeline where nothing
    ///     ahead changes the bytes written (no TLS handler): like `sender`, these writes skip it.
    public init(
        prefix: String, resolver: any ContentResolver, observer: (any ContentObserver)? = nil,
        heads: (any RequestHeadObserver)? = nil, maxRanges: Int = RangeEvaluator.defaultMaxRanges,
        sender: FileSender? = nil, writesToSocket: Bool = false,
        installDecoder: ((ChannelPipeline.SynchronousOperations) throws -> Void)? = nil
    ) {
        #if os(Linux)
            self.sender = sender
            directLooked = !writesToSocket
        #endif
        self.installDecoder = installDecoder
        self.prefix = prefix
        self.resolver = resolver
        self.observer = observer
        self.heads = heads
        self.maxRanges = maxRanges
        parser = RequestHeadParser(prefix: prefix)
    }

    /// A flush is due once the event loop has handled the connections ready with this one.
    private var flushScheduled = false

    public func handlerAdded(context: ChannelHandlerContext) {
        writable = context.channel.isWritable
        allocator = context.channel.allocator
    }

    public func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard !handedOff else {
            context.fireChannelRead(data)
            return
        }
        var buffer = unwrapInboundIn(data)
        if pending != nil {
            pending!.writeBuffer(&buffer)
        } else {
            pending = buffer
        }
        answerPending(context: context)
    }

    public func channelReadComplete(context: ChannelHandlerContext) {
        // Until a hand-off nothing behind has been given a read to complete: the event would
        // cross every handler for nothing, on every request.
        if handedOff { context.fireChannelReadComplete() }
    }

    public func channelWritabilityChanged(context: ChannelHandlerContext) {
        writable = context.channel.isWritable
        resumeAnswering(context: context)
        context.fireChannelWritabilityChanged()
    }

    /// Once responses can be written again: answers what is pending, then reads again if reads
    /// were held and the answers left nothing to wait for.
    private func resumeAnswering(context: ChannelHandlerContext) {
        guard writable, !handedOff, !sendingElsewhere else { return }
        answerPending(context: context)
        if readHeld, !handedOff, writable, !sendingElsewhere {
            readHeld = false
            context.read()
        }
    }

    public func read(context: ChannelHandlerContext) {
        // Pipelined requests wait in the socket while responses cannot be written.
        if !handedOff, !writable || sendingElsewhere {
            readHeld = true
            return
        }
        context.read()
    }

    public func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let idle = event as? IdleStateHandler.IdleStateEvent, idle == .read {
            // A client downloading sends nothing for minutes; one that has also taken nothing
            // since the last event has stopped reading, whoever sends its body.
            if inFlight > 0 {
                if stalls.hasStopped(context.channel) { context.close(promise: nil) }
                return
            }
            if !handedOff {  // between requests: idle
                context.close(promise: nil)
                return
            }
        }
        // The client will send nothing more (half-close), or the server is shutting down: finish
        // the responses in flight (a download may take the whole drain period), take no new
        // request, then close. Passed on, a shutdown would reach Hummingbird's connection
        // handler, which sees no request of ours and would close at once, cutting downloads.
        if !handedOff, event is ChannelShouldQuiesceEvent || (event as? ChannelEvent) == .inputClosed {
            pending = nil
            closing = true
            #if os(Linux)
                writeUnsent(context: context)
            #endif
            if inFlight == 0 {
                // A small response answered in this pass waits for its flush: send it first.
                context.flush()
                context.close(promise: nil)
            }
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    public func channelInactive(context: ChannelHandlerContext) {
        pending = nil
        #if os(Linux)
            if let ticket, let sender { sender.cancel(ticket) }
            unsent = nil
        #endif
        context.fireChannelInactive()
    }

    // MARK: Answering

    private func answerPending(context: ChannelHandlerContext) {
        var wrote = false
        defer {
            if wrote && !flushScheduled {
                // Responses are flushed once the event loop has read every connection that was
                // ready, not one by one: each flush wakes a client, which on a machine shared
                // with the clients could take the core while requests read in the same pass
                // waited. 4 KiB ranges, 16 connections, 9 alternated rounds twice: p99 1.17 and
                // 1.29 ms against 1.75 and 1.82 flushed at once, for the same rate
                // (docs/performance.md).
                flushScheduled = true
                context.eventLoop.assumeIsolated().execute { [self] in
                    flushScheduled = false
                    context.flush()
                    // Not for a connection that closes after its answer: its client is woken by
                    // the close too, and the yield only delayed the loop's next accept. A new
                    // connection for each 4 KiB range, 5 alternated rounds, two runs: 10-13% and
                    // 15-16% more requests/s at 16 and 64 connections, p99 the same or lower
                    // (docs/performance.md, twenty-first stop). Flushing such an answer at once,
                    // not with the pass's others, was 2% slower, its p99 higher.
                    if !closing { PassEnd.afterFlushes(on: context.eventLoop) }
                }
            }
        }
        while !closing, writable, !sendingElsewhere, let buffer = pending, buffer.readableBytes > 0 {
            switch parser.parse(buffer, knownURI: memory.resolved?.uri) {
            case .incomplete:
                return
            case .handOff:
                handOff(context: context)
                return
            case .request(let request, let length):
                if buffer.readableBytes == length {
                    pending = nil
                } else {
                    pending!.moveReaderIndex(forwardBy: length)
                }
                heads?.requestHeadReceived()
                if answer(request, context: context) { wrote = true }
            }
        }
        if let buffer = pending, buffer.readableBytes == 0 { pending = nil }
    }

    private func handOff(context: ChannelHandlerContext) {
        // The decoder's answers go through NIO, after this pass's direct ones.
        #if os(Linux)
            writeUnsent(context: context)
        #endif
        handedOff = true
        if let installDecoder {
            do {
                try installDecoder(context.pipeline.syncOperations)
            } catch {
                pending = nil
                context.close(promise: nil)
                return
            }
        }
        if let buffer = pending {
            pending = nil
            context.fireChannelRead(wrapInboundOut(buffer))
            context.fireChannelReadComplete()
        }
        if readHeld {
            readHeld = false
            context.read()
        }
    }

    /// Writes the answer to one request; returns whether it was written through NIO (the caller
    /// flushes), not kept for this pass's direct write.
    private func answer(_ request: RequestHeadParser.Head, context: ChannelHandlerContext) -> Bool {
        var response = ContentResponse.make(
            request.content, prefix: prefix, maxRanges: maxRanges, resolver: resolver, memory: &memory,
            eventLoop: context.eventLoop, allocator: allocator)
        if !response.keepAlive { closing = true }

        var (head, pieces) = response.serialize(http10: request.http10, scratch: &headScratch)

        let report = ResponseReport(response, observer: observer)
        // A response that is one buffer (a small range, an error, a HEAD) on a connection that
        // stays open is done with once written: no promise, no completion callback, which were
        // 6-8% of the server's CPU on 4 KiB ranges (docs/performance.md). It is counted as served
        // when written; a connection reset that loses it closes the channel all the same.
        if pieces.isEmpty, !closing {
            // With nothing of this connection's queued in NIO, the answer is kept to be written
            // straight to the socket as the pass ends (`writeUnsent`); behind a response still in
            // NIO's queue it goes through NIO, counted in `inFlight` so that direct writes resume
            // only once that queue is empty.
            let direct = directWrites(context)
            if !direct || inFlight == 0 {
                if direct {
                    #if os(Linux)
                        keepForPass(head, context: context)
                    #endif
                } else {
                    context.write(wrapOutboundOut(.byteBuffer(head)), promise: nil)
                }
                _ = report.finished(.success(()), observer: observer)
                heads?.responseSent()
                return !direct
            }
        }
        #if os(Linux)
            writeUnsent(context: context)
            if inFlight == 0, !closing, !pieces.isEmpty, pieces.reduce(0, { $0 + $1.readableBytes }) <= Self.inlineMaximum,
                directWrites(context), let socket = directSocket?.descriptor, socket >= 0
            {
                switch Self.sendInline(&head, &pieces, socket: socket) {
                case .sent:
                    _ = report.finished(.success(()), observer: observer)
                    heads?.responseSent()
                    PassEnd.afterFlushes(on: context.eventLoop)
                    return false
                case .failed(let error):
                    _ = report.finished(.failure(error), observer: observer)
                    context.close(promise: nil)
                    return false
                case .unfinished:
                    // The socket is full: what is left (in `head` and `pieces`) goes the usual
                    // way, corked as it would be.
                    break
                }
            }
        #endif
        inFlight += 1
        #if os(Linux)
            if let sender, pieces.count == 1, case .fileRegion(let region) = pieces[0], region.readableBytes >= Self.elsewhereMinimum,
                sendElsewhere(head: head, region: region, sender: sender, report: report, context: context)
            {
                return true
            }
        #endif
        // A head followed by a file: corked until all of it has left (see `setCork`).
        let corked = !pieces.isEmpty
        if corked { context.setCork(true) }
        let sent = context.eventLoop.makePromise(of: Void.self)
        if pieces.isEmpty {
            context.write(wrapOutboundOut(.byteBuffer(head)), promise: sent)
        } else {
            context.write(wrapOutboundOut(.byteBuffer(head)), promise: nil)
            for piece in pieces.dropLast() { context.write(wrapOutboundOut(piece), promise: nil) }
            context.write(wrapOutboundOut(pieces.last!), promise: sent)
        }
        sent.futureResult.assumeIsolated().whenComplete { [self] result in
            if corked { context.setCork(false) }
            responseLeft(result, report: report, context: context)
        }
        return true
    }

    /// The last write of a response counted in `inFlight` has ended (`report` nil: the rest of
    /// direct answers, reported when they were made).
    private func responseLeft(_ result: Result<Void, any Error>, report: ResponseReport?, context: ChannelHandlerContext) {
        inFlight -= 1
        if inFlight == 0 { stalls.reset() }
        let succeeded = report.map { $0.finished(result, observer: observer) } ?? ((try? result.get()) != nil)
        if !succeeded {
            context.close(promise: nil)
        } else if closing, inFlight == 0 {
            context.close(promise: nil)
        } else if report != nil {
            heads?.responseSent()
        }
    }

    /// Whether answers can be written straight to this connection's socket (Linux): the first
    /// call finds it (``ChannelSocket``); its descriptor is read again at each write, and is -1
    /// once the channel has closed it, so a write can never reach another connection that
    /// reused the number.
    private func directWrites(_ context: ChannelHandlerContext) -> Bool {
        #if os(Linux)
            if !directLooked {
                directLooked = true
                directSocket = ChannelSocket.handle(of: context.channel)
            }
            return directSocket != nil
        #else
            return false
        #endif
    }

    #if os(Linux)
        /// Adds `head` (a whole answer) to what this pass writes to the socket as it ends.
        private func keepForPass(_ head: ByteBuffer, context: ChannelHandlerContext) {
            if unsent == nil {
                unsent = head
                PassEnd.write(self, context: context)
            } else {
                unsent!.writeImmutableBuffer(head)
            }
        }

        /// Writes this pass's answers kept for it (`unsent`) to the socket in one `send`; what
        /// the socket has no room for goes through NIO, counted in `inFlight`. Called as the
        /// pass ends (`PassEnd`), and before anything else is written through NIO.
        ///
        /// Why not through NIO: on small ranges the server is bound by CPU per request, and a
        /// write through the channel (the outbound pipeline, the pending-writes manager, the
        /// flush, each with their retains, and a task per connection to flush after the pass)
        /// cost more user time than the rest of answering (docs/performance.md, twenty-ninth stop).
        fileprivate func writeUnsent(context: ChannelHandlerContext) {
            guard var bytes = unsent else { return }
            unsent = nil
            guard let socket = directSocket?.descriptor, socket >= 0 else { return }
            switch Self.sendBuffer(&bytes, more: false, socket: socket) {
            case .sent:
                return
            case .failed:
                // Reset or gone: as NIO would, on its next write or read.
                context.close(promise: nil)
                return
            case .unfinished:
                break
            }
            inFlight += 1
            let left = context.eventLoop.makePromise(of: Void.self)
            context.writeAndFlush(wrapOutboundOut(.byteBuffer(bytes)), promise: left)
            left.futureResult.assumeIsolated().whenComplete { [self] result in
                responseLeft(result, report: nil, context: context)
            }
        }
    #endif

    #if os(Linux)
        /// An answer whose body (one range, or the parts of a multipart answer) is at most this
        /// many bytes is first sent from the event loop, straight to the socket (see `sendInline`).
        static let inlineMaximum = 2 << 20

        enum InlineSend {
            /// All of it has left.
            case sent
            /// The socket filled: the head and pieces passed in hold what is left.
            case unfinished
            /// The connection is gone, or the file ended before a range did.
            case failed(any Error)
        }

        /// Sends `head` then `pieces` (buffers and file regions, in order) straight to the socket,
        /// as nginx sends an answer of up to its `sendfile_max_chunk` (2m) from its event loop:
        /// each buffer with `send`, each region with one `sendfile` of all of it. One range: the
        /// head goes with `MSG_MORE`, held back to leave with the body, as under `TCP_CORK`, and
        /// the `sendfile` pushes all at its end. Several pieces (a multipart answer): corked
        /// throughout, so that each part's end does not leave in a short segment of its own.
        ///
        /// Why: an answer of 64 KiB to 2 MiB nearly always fits in the socket's buffer at once,
        /// and through NIO (its pending writes, a promise and a flush) or the sending threads (two
        /// descriptors duplicated and closed, two epoll changes, a hop to the sending thread and
        /// one back, cork and uncork) each answer took more than the sending itself: 1 MiB ranges
        /// at 64 connections ran at 0.97-0.98x nginx's rate with 1.16-1.39x its p99; sent here,
        /// 1.28-1.36x the rate with 1.00-1.08x the p99, and 256 KiB ranges 1.30x and 1.33x with
        /// 0.57x and 0.71x at 16 and 64 connections (docs/performance.md, thirty-eighth stop). Only
        /// what the socket has no room for goes those ways. As with NIO's file regions and nginx's
        /// `sendfile`, pages not in the page cache are read from the disk within the call.
        ///
        /// SIGPIPE: NIO ignores it process-wide on Linux once it has made a socket, as its own
        /// `sendfile` of file regions needs; a reset connection fails with `EPIPE`.
        static func sendInline(_ head: inout ByteBuffer, _ pieces: inout [IOData], socket: CInt) -> InlineSend {
            let corked = pieces.count > 1
            if corked { ChannelSocket.setCork(socket, true) }
            var outcome = sendBuffer(&head, more: true, socket: socket)
            var index = 0
            while case .sent = outcome, index < pieces.count {
                switch pieces[index] {
                case .byteBuffer(var buffer):
                    outcome = sendBuffer(&buffer, more: index < pieces.count - 1, socket: socket)
                    pieces[index] = .byteBuffer(buffer)
                case .fileRegion(var region):
                    outcome = sendRegion(&region, socket: socket)
                    pieces[index] = .fileRegion(region)
                }
                if case .sent = outcome { index += 1 }
            }
            pieces.removeFirst(index)
            // Left corked when unfinished: the rest goes the usual way, which uncorks at its end.
            if corked, case .sent = outcome { ChannelSocket.setCork(socket, false) }
            return outcome
        }

        /// Sends `buffer` straight to the socket until it has all left or the socket is full
        /// (`buffer` then holds what is left); `more` sets `MSG_MORE`. For every answer written
        /// outside NIO: ``sendInline(_:_:socket:)``, the pass's kept answers, a new connection's
        /// first answer (``ContentAcceptor``).
        static func sendBuffer(_ buffer: inout ByteBuffer, more: Bool, socket: CInt) -> InlineSend {
            let flags = CInt(MSG_DONTWAIT | MSG_NOSIGNAL) | (more ? CInt(MSG_MORE) : 0)
            while buffer.readableBytes > 0 {
                let wrote = buffer.withUnsafeReadableBytes { Glibc.send(socket, $0.baseAddress, $0.count, flags) }
                if wrote > 0 {
                    buffer.moveReaderIndex(forwardBy: wrote)
                } else if errno == EAGAIN || errno == EWOULDBLOCK {
                    return .unfinished
                } else if errno != EINTR {
                    return .failed(IOError(errnoCode: errno, reason: "send"))
                }
            }
            return .sent
        }

        private static func sendRegion(_ region: inout FileRegion, socket: CInt) -> InlineSend {
            guard let file = try? region.fileHandle.withUnsafeFileDescriptor({ $0 }) else { return .unfinished }
            while region.readableBytes > 0 {
                var offset = off_t(region.readerIndex)
                let sent = sendfile(socket, file, &offset, region.readableBytes)
                if sent > 0 {
                    // A short send: the socket is full (the next finds no room), or the file was
                    // cut short on disk since it was looked at (the next sends nothing).
                    region.moveReaderIndex(forwardBy: sent)
                } else if sent == 0 {
                    return .failed(IOError(errnoCode: EIO, reason: "sendfile: the file ended before the range"))
                } else if errno == EAGAIN || errno == EWOULDBLOCK {
                    return .unfinished
                } else if errno != EINTR {
                    return .failed(IOError(errnoCode: errno, reason: "sendfile"))
                }
            }
            return .sent
        }

        /// Writes the head through NIO, then hands the body to the sender once the head (and every
        /// response before it) has been written; parsing and reading wait until the body has left.
        /// Returns false, having written nothing, when the connection's socket cannot be had.
        private func sendElsewhere(
            head: ByteBuffer, region: FileRegion, sender: FileSender, report: ResponseReport, context: ChannelHandlerContext
        ) -> Bool {
            guard let socket = ChannelSocket.duplicate(of: context.channel) else { return false }
            guard let file = try? region.fileHandle.withUnsafeFileDescriptor({ fcntl($0, F_DUPFD_CLOEXEC, 0) }), file >= 0 else {
                Glibc.close(socket)
                return false
            }
            sendingElsewhere = true
            // Uncorked by the sender when the body has left.
            ChannelSocket.setCork(socket, true)
            let headWritten = context.eventLoop.makePromise(of: Void.self)
            context.write(wrapOutboundOut(.byteBuffer(head)), promise: headWritten)
            let (offset, count) = (Int64(region.readerIndex), Int64(region.readableBytes))
            headWritten.futureResult.assumeIsolated().whenComplete { [self] written in
                guard case .success = written else {
                    ChannelSocket.setCork(socket, false)
                    Glibc.close(socket)
                    Glibc.close(file)
                    bodyLeft(written, report: report, context: context)
                    return
                }
                let loop = NIOLoopBound((self, context), eventLoop: context.eventLoop)
                ticket = sender.send(socket: socket, file: file, offset: offset, count: count) { result in
                    loop.eventLoop.execute {
                        let (handler, context) = loop.value
                        handler.bodyLeft(result.mapError { $0 }, report: report, context: context)
                    }
                }
            }
            return true
        }

        private func bodyLeft(_ result: Result<Void, any Error>, report: ResponseReport, context: ChannelHandlerContext) {
            ticket = nil
            sendingElsewhere = false
            responseLeft(result, report: report, context: context)
            guard context.channel.isActive, !closing else { return }
            resumeAnswering(context: context)
        }
    #endif
}

extension ContentResponse {
    /// Takes the response's bytes for the wire: its head (status line and fields, rendered into
    /// `scratch`, which is kept between responses) and the body pieces left to send after it. A
    /// body that is one buffer goes out with its head in one write, one TCP segment: the head is
    /// written into the room left in front of it when there is enough, else the body is copied
    /// behind the head; no pieces are left then.
    mutating func serialize(http10: Bool, scratch: inout ByteBuffer) -> (head: ByteBuffer, pieces: [IOData]) {
        scratch.clear()
        scratch.writeWithUnsafeMutableBytes(minimumWritableBytes: fields.renderedSizeBound + status.reasonPhrase.utf8.count + 32) { memory in
            var head = RawHeadWriter(memory)
            head.append(http10 ? "HTTP/1.0 " : "HTTP/1.1 ")
            // The two statuses of nearly every response, as literals (no number formatted).
            switch status {
            case .partialContent: head.append("206 Partial Content\r\n")
            case .ok: head.append("200 OK\r\n")
            default:
                head.append(UInt64(status.code))
                head.append(" ")
                head.append(status.reasonPhrase)
                head.append("\r\n")
            }
            fields.render(into: &head)
            head.append("\r\n")
            return head.written
        }
        // Taken out of the response so that a small body's buffer is uniquely referenced and the
        // head is written into it in place.
        var pieces = body
        body = []
        if pieces.count == 1, case .byteBuffer = pieces[0], case .byteBuffer(var small) = pieces.removeLast() {
            if small.readerIndex >= scratch.readableBytes {
                let start = small.readerIndex - scratch.readableBytes
                small.setBuffer(scratch, at: start)
                small.moveReaderIndex(to: start)
                return (small, [])
            }
            var head = scratch
            head.writeBuffer(&small)
            return (head, [])
        }
        return (scratch, pieces)
    }
}

/// Once per pass of an event loop that flushed responses or wrote them straight to sockets (one
/// task for the pass does those writes first: `ContentFastPath.writeUnsent`), the loop offers
/// its core to whatever else is ready to run there (`sched_yield`), then goes on; with nothing
/// else ready, the call returns at once.
///
/// Why: under steady load the loop always finds more requests ready, so it never waits in
/// `epoll_wait`, and a client woken by its responses on the same core (on a machine the server
/// shares with its clients or a proxy) waited for the loop's time slice to run out: that wait was
/// the small-range p99. 4 KiB ranges, 7 rotated rounds: p99 0.44 ms (0.39-0.50) against 1.17
/// (0.40-2.78) at 16 connections, 1.33 against 2.25 at 64, for 0.97-1.00x the rate; yielding after
/// every response instead cost 16-19% of the rate (docs/performance.md).
enum PassEnd {
    /// Touched only by its own loop's thread.
    private final class State: @unchecked Sendable {
        var scheduled = false
        /// Connections with answers to write directly when the pass ends, in the order they
        /// were answered.
        var writes: [(ContentFastPath, ChannelHandlerContext)] = []
    }
    private static let state = ThreadSpecificVariable<State>()

    private static var current: State {
        if let existing = state.currentValue { return existing }
        let created = State()
        state.currentValue = created
        return created
    }

    /// Called by each flush of a pass; the yield runs after the pass's other flushes, which were
    /// queued before it.
    static func afterFlushes(on loop: any EventLoop) {
        schedule(current, on: loop)
    }

    #if os(Linux)
        /// `handler` has answers for `writeUnsent` as the pass ends: one task for the whole pass
        /// writes every connection's, then yields, where a task per connection flushed each.
        static func write(_ handler: ContentFastPath, context: ChannelHandlerContext) {
            let state = current
            state.writes.append((handler, context))
            schedule(state, on: context.eventLoop)
        }
    #endif

    private static func schedule(_ current: State, on loop: any EventLoop) {
        guard !current.scheduled else { return }
        current.scheduled = true
        loop.assumeIsolated().execute {
            current.scheduled = false
            #if os(Linux)
                // By index: a write that falls back to NIO may answer more and add to the list.
                var index = 0
                while index < current.writes.count {
                    let (handler, context) = current.writes[index]
                    handler.writeUnsent(context: context)
                    index += 1
                }
                current.writes.removeAll(keepingCapacity: true)
                sched_yield()
            #endif
        }
    }
}

extension ChannelHandlerContext {
    /// Sets `TCP_CORK` (Linux; elsewhere nothing): while it is on, the kernel sends only full
    /// segments. A response head written before a file region (sendfile) otherwise leaves in a
    /// segment of its own, and the client wakes up, reads and parses it alone: 1 MiB ranges ran
    /// at 0.80x nginx's rate, which corks the same way (`tcp_nopush`), and at 0.92-0.95x corked
    /// (docs/performance.md). Every response that carries a file stays corked until all of it has
    /// left, as nginx's does; otherwise each `sendfile` that fills the socket ends in a short
    /// segment, one more to send and acknowledge. A whole archive corked through took 0.5-13%
    /// less server CPU per GiB than one uncorked after its head (six runs of 18-42 alternated 1 GiB
    /// downloads; 5-20% slower on loopback, at 0.96-1.11x nginx's speed). Ranges of 64 KiB to
    /// 1 MiB corked through had a lower p99 than uncorked after their head in all eight rotated
    /// comparisons (1-29% lower), at the same rate within the noise (docs/performance.md, ninth
    /// stop). Two system calls per response that carries a file; small ranges leave with their
    /// head in one write and are not corked.
    func setCork(_ on: Bool) {
        #if os(Linux)
            try? channel.syncOptions?.setOption(ChannelOptions.tcpOption(.init(rawValue: ChannelSocket.tcpCork)), value: on ? 1 : 0)
        #endif
    }
}

import NIOCore
import NIOHTTP1

/// Told of the requests `ContentFastPath` answers, so that a request-head deadline behind it
/// (which sees only what NIO's decoder parses) covers them too. Called on the channel's event loop.
/// A direct call rather than a user event: an event crosses four handlers per request, which
/// showed in the profile of small range requests.
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
/// (llhttp, `HTTPHeaders`, the pipelining handler, the encoder, three more handlers) was about
/// 40% of the server's CPU on 4 KiB ranges, against nginx's 15%. The answer itself is decided by
/// the same `ContentResponse` as for requests that come through the decoder.
///
/// Responses leave in request order: they are written as the requests are parsed, and after a
/// hand-off the decoder's responses queue behind them. While the channel is not writable (a big
/// file on its way, or a client that pipelines without reading) it stops parsing and reading.
public final class ContentFastPath: ChannelDuplexHandler {
    public typealias InboundIn = ByteBuffer
    public typealias InboundOut = ByteBuffer
    public typealias OutboundIn = IOData
    public typealias OutboundOut = IOData

    /// Heads larger than this, or with more lines, are left to the decoder and its limits.
    static let maxHead = 16 << 10
    static let maxHeaderLines = 100

    private let prefix: String
    private let resolver: any ContentResolver
    private let observer: (any ContentObserver)?
    private let heads: (any RequestHeadObserver)?
    private let maxRanges: Int
    private let getLine: [UInt8]
    private let headLine: [UInt8]

    // The state is touched only on the channel's event loop, one call at a time; unchecked
    // exclusivity drops the runtime access checks, which showed in the profile of small ranges.

    /// Bytes read and not yet answered (a head split over reads, or pipelined requests).
    @exclusivity(unchecked) private var pending: ByteBuffer?
    @exclusivity(unchecked) private var handedOff = false
    /// Responses written and not yet sent completely.
    @exclusivity(unchecked) private var inFlight = 0
    /// A response said `Connection: close`, or the client closed its side: no more requests.
    @exclusivity(unchecked) private var closing = false
    @exclusivity(unchecked) private var readHeld = false
    /// The response head is built here, then copied in front of a small body (or sent as is).
    @exclusivity(unchecked) private var headScratch = ByteBuffer()

    public init(prefix: String, resolver: any ContentResolver, observer: (any ContentObserver)? = nil,
                heads: (any RequestHeadObserver)? = nil, maxRanges: Int = RangeEvaluator.defaultMaxRanges) {
        self.prefix = prefix
        self.resolver = resolver
        self.observer = observer
        self.heads = heads
        self.maxRanges = maxRanges
        getLine = Array("GET \(prefix)".utf8)
        headLine = Array("HEAD \(prefix)".utf8)
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
        if context.channel.isWritable, !handedOff {
            answerPending(context: context)
            if readHeld, !handedOff {
                readHeld = false
                context.read()
            }
        }
        context.fireChannelWritabilityChanged()
    }

    public func read(context: ChannelHandlerContext) {
        // Pipelined requests wait in the socket while responses cannot be written.
        if !handedOff, !context.channel.isWritable {
            readHeld = true
            return
        }
        context.read()
    }

    public func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let idle = event as? IdleStateHandler.IdleStateEvent, idle == .read, inFlight > 0 {
            return  // a client downloading sends nothing for minutes
        }
        // The client will send nothing more (half-close), or the server is shutting down: finish
        // the responses in flight (a download may take the whole drain period), take no new
        // request, then close. Passed on, a shutdown would reach Hummingbird's connection
        // handler, which sees no request of ours and would close at once, cutting downloads.
        if !handedOff, event is ChannelShouldQuiesceEvent || (event as? ChannelEvent) == .inputClosed {
            pending = nil
            closing = true
            if inFlight == 0 { context.close(promise: nil) }
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    public func channelInactive(context: ChannelHandlerContext) {
        pending = nil
        context.fireChannelInactive()
    }

    // MARK: Answering

    private func answerPending(context: ChannelHandlerContext) {
        var wrote = false
        defer { if wrote { context.flush() } }
        while !closing, context.channel.isWritable, let buffer = pending, buffer.readableBytes > 0 {
            switch parse(buffer) {
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
                answer(request, context: context)
                wrote = true
            }
        }
        if let buffer = pending, buffer.readableBytes == 0 { pending = nil }
    }

    private func handOff(context: ChannelHandlerContext) {
        handedOff = true
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

    private func answer(_ request: Request, context: ChannelHandlerContext) {
        var response = ContentResponse.make(request.content, prefix: prefix, maxRanges: maxRanges, resolver: resolver,
                                            eventLoop: context.eventLoop, allocator: context.channel.allocator)
        if !response.keepAlive { closing = true }

        headScratch.clear()
        headScratch.writeString(request.http10 ? "HTTP/1.0 " : "HTTP/1.1 ")
        headScratch.writeString(String(response.status.code))
        headScratch.writeInteger(UInt8(ascii: " "))
        headScratch.writeString(response.status.reasonPhrase)
        headScratch.writeStaticString("\r\n")
        for (name, value) in response.headers {
            headScratch.writeString(name)
            headScratch.writeStaticString(": ")
            headScratch.writeString(value)
            headScratch.writeStaticString("\r\n")
        }
        headScratch.writeStaticString("\r\n")
        // Taken out of the response so that a small body's buffer is uniquely referenced and the
        // head is written into it in place.
        var pieces = response.body
        response.body = []
        var head: ByteBuffer
        // A small body goes out with its head in one write, one TCP segment: into the room left
        // in front of it when there is enough, else copied behind the head.
        if pieces.count == 1, case .byteBuffer = pieces[0], case .byteBuffer(var small) = pieces.removeLast() {
            if small.readerIndex >= headScratch.readableBytes {
                let start = small.readerIndex - headScratch.readableBytes
                small.setBuffer(headScratch, at: start)
                small.moveReaderIndex(to: start)
                head = small
            } else {
                head = headScratch
                head.writeBuffer(&small)
            }
            pieces = []
        } else {
            head = headScratch
        }

        observer?.responseStarted(status: response.status, bytes: response.servedBytes)
        inFlight += 1
        let started = ContinuousClock.now
        let sent = context.eventLoop.makePromise(of: Void.self)
        if pieces.isEmpty {
            context.write(wrapOutboundOut(.byteBuffer(head)), promise: sent)
        } else {
            context.write(wrapOutboundOut(.byteBuffer(head)), promise: nil)
            for piece in pieces.dropLast() { context.write(wrapOutboundOut(piece), promise: nil) }
            context.write(wrapOutboundOut(pieces.last!), promise: sent)
        }
        let (observer, status, bytes) = (self.observer, response.status, response.servedBytes)
        sent.futureResult.assumeIsolated().whenComplete { [self] result in
            inFlight -= 1
            let succeeded = (try? result.get()) != nil
            observer?.responseFinished(status: status, bytes: bytes, duration: ContinuousClock.now - started, succeeded: succeeded)
            if !succeeded {
                context.close(promise: nil)
            } else if closing, inFlight == 0 {
                context.close(promise: nil)
            } else if context.channel.isActive {
                heads?.responseSent()
            }
        }
    }

    // MARK: Parsing

    struct Request {
        var content: ContentRequest
        var http10: Bool
    }

    enum Parsed {
        case incomplete
        case handOff
        /// A request whose head is the first `length` bytes.
        case request(Request, length: Int)
    }

    /// Parses one request head at the start of `buffer` (RFC 9112 §2-§5), strictly: whatever
    /// it is not sure of is handed off, so it never answers a request NIO's parser would read
    /// differently.
    func parse(_ buffer: ByteBuffer) -> Parsed {
        buffer.withUnsafeReadableBytes { raw -> Parsed in
            let bytes = raw.bindMemory(to: UInt8.self)
            let method: HTTPMethod
            let lead: [UInt8]
            if bytes.starts(with: getLine) {
                (method, lead) = (.GET, getLine)
            } else if bytes.starts(with: headLine) {
                (method, lead) = (.HEAD, headLine)
            } else {
                // Wait for more only while the bytes could still become one of the two.
                let isStart = getLine.starts(with: bytes) || headLine.starts(with: bytes)
                return isStart ? .incomplete : .handOff
            }
            // The end of the head: an empty line.
            let limit = min(bytes.count, Self.maxHead)
            var end = -1
            var i = 3
            while i < limit {
                if bytes[i] == 0x0A, bytes[i - 1] == 0x0D, bytes[i - 2] == 0x0A, bytes[i - 3] == 0x0D {
                    end = i + 1
                    break
                }
                i += 1
            }
            guard end > 0 else { return bytes.count >= Self.maxHead ? .handOff : .incomplete }

            // Request line: METHOD SP target SP HTTP-version CRLF.
            // The target: visible ASCII after "GET " or "HEAD ", up to the space before the version.
            var p = lead.count
            while p < end, bytes[p] > 0x20, bytes[p] < 0x7F { p += 1 }
            guard p < end, bytes[p] == 0x20 else { return .handOff }
            let uri = String(decoding: UnsafeBufferPointer(rebasing: bytes[(method == .GET ? 4 : 5)..<p]), as: UTF8.self)
            let version = UnsafeBufferPointer(rebasing: bytes[(p + 1)..<min(p + 11, end)])
            let http10: Bool
            if version.elementsEqual("HTTP/1.1\r\n".utf8) {
                http10 = false
            } else if version.elementsEqual("HTTP/1.0\r\n".utf8) {
                http10 = true
            } else {
                return .handOff
            }
            var request = ContentRequest(method: method, uri: uri, keepAlive: !http10)
            var connectionClose = false
            var connectionKeepAlive = false

            // Header fields: name ":" OWS value OWS CRLF, until the empty line.
            var line = p + 11
            var lines = 0
            while line < end - 2 {
                lines += 1
                guard lines <= Self.maxHeaderLines else { return .handOff }
                var colon = line
                while colon < end, Self.isTokenByte(bytes[colon]) { colon += 1 }
                // No name, or a character that may not be in one (obs-fold starts with a space).
                guard colon > line, colon < end, bytes[colon] == UInt8(ascii: ":") else { return .handOff }
                var valueEnd = colon + 1
                while valueEnd < end, bytes[valueEnd] != 0x0D {
                    let byte = bytes[valueEnd]
                    // Field values: visible characters, spaces, tabs and obs-text; no other controls.
                    guard byte >= 0x20 || byte == 0x09, byte != 0x7F else { return .handOff }
                    valueEnd += 1
                }
                guard valueEnd + 1 < end, bytes[valueEnd + 1] == 0x0A else { return .handOff }
                var valueStart = colon + 1
                while valueStart < valueEnd, bytes[valueStart] == 0x20 || bytes[valueStart] == 0x09 { valueStart += 1 }
                var trimmed = valueEnd
                while trimmed > valueStart, bytes[trimmed - 1] == 0x20 || bytes[trimmed - 1] == 0x09 { trimmed -= 1 }
                let name = UnsafeBufferPointer(rebasing: bytes[line..<colon])
                let value = UnsafeBufferPointer(rebasing: bytes[valueStart..<trimmed])
                // A repeated field is combined by some parsers and not by others: leave it to NIO.
                switch Self.field(name) {
                case .range:
                    guard request.range == nil else { return .handOff }
                    request.range = String(decoding: value, as: UTF8.self)
                case .ifRange:
                    guard request.ifRange == nil else { return .handOff }
                    request.ifRange = String(decoding: value, as: UTF8.self)
                case .ifNoneMatch:
                    guard request.ifNoneMatch == nil else { return .handOff }
                    request.ifNoneMatch = String(decoding: value, as: UTF8.self)
                case .connection:
                    for token in value.split(separator: UInt8(ascii: ",")) {
                        let option = token.drop { $0 == 0x20 || $0 == 0x09 }.reversed().drop { $0 == 0x20 || $0 == 0x09 }.reversed()
                        if Self.equalsIgnoringCase(option, "close") { connectionClose = true }
                        if Self.equalsIgnoringCase(option, "keep-alive") { connectionKeepAlive = true }
                        if Self.equalsIgnoringCase(option, "upgrade") { return .handOff }
                    }
                case .contentLength:
                    // A body on GET or HEAD: the decoder knows how to read and drop it.
                    guard value.elementsEqual("0".utf8) else { return .handOff }
                case .handOff:
                    return .handOff
                case .other:
                    break
                }
                line = valueEnd + 2
            }
            if connectionClose {
                request.keepAlive = false
            } else if http10 {
                request.keepAlive = connectionKeepAlive
            }
            return .request(Request(content: request, http10: http10), length: end)
        }
    }

    private enum Field {
        case range, ifRange, ifNoneMatch, connection, contentLength, handOff, other
    }

    private static func field(_ name: UnsafeBufferPointer<UInt8>) -> Field {
        switch name.count {
        case 5 where equalsIgnoringCase(name, "range"): .range
        case 8 where equalsIgnoringCase(name, "if-range"): .ifRange
        case 13 where equalsIgnoringCase(name, "if-none-match"): .ifNoneMatch
        case 10 where equalsIgnoringCase(name, "connection"): .connection
        case 14 where equalsIgnoringCase(name, "content-length"): .contentLength
        case 17 where equalsIgnoringCase(name, "transfer-encoding"): .handOff
        case 7 where equalsIgnoringCase(name, "upgrade"): .handOff
        case 6 where equalsIgnoringCase(name, "expect"): .handOff
        default: .other
        }
    }

    private static func equalsIgnoringCase<Bytes: Collection<UInt8>>(_ bytes: Bytes, _ lowercase: StaticString) -> Bool {
        guard bytes.count == lowercase.utf8CodeUnitCount else { return false }
        return lowercase.withUTF8Buffer { expected in
            zip(bytes, expected).allSatisfy { byte, lower in
                (byte >= UInt8(ascii: "A") && byte <= UInt8(ascii: "Z") ? byte | 0x20 : byte) == lower
            }
        }
    }

    /// RFC 9110 §5.6.2 tchar.
    private static func isTokenByte(_ byte: UInt8) -> Bool {
        switch byte {
        case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "0")...UInt8(ascii: "9"):
            true
        case UInt8(ascii: "!"), UInt8(ascii: "#"), UInt8(ascii: "$"), UInt8(ascii: "%"), UInt8(ascii: "&"), UInt8(ascii: "'"),
             UInt8(ascii: "*"), UInt8(ascii: "+"), UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "^"), UInt8(ascii: "_"),
             UInt8(ascii: "`"), UInt8(ascii: "|"), UInt8(ascii: "~"):
            true
        default:
            false
        }
    }
}

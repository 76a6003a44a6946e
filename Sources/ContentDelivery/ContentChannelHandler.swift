import Foundation
import NIOCore
import Synchronization
import NIOHTTP1

/// A file to serve: an open handle kept for the process's lifetime (archives are immutable) and
/// its validators.
public struct ServedFile: Sendable {
    public let handle: NIOFileHandle
    public let size: UInt64
    /// Strong entity tag, quotes included.
    public let etag: String
    public let lastModified: String
    public let contentType: String

    public init(handle: NIOFileHandle, size: UInt64, etag: String, lastModified: String, contentType: String = "application/zip") {
        self.handle = handle
        self.size = size
        self.etag = etag
        self.lastModified = lastModified
        self.contentType = contentType
    }
}

/// What a content path resolves to.
public enum ContentResolution: Sendable {
    /// Serve this file; `fileName` goes into `Content-Disposition`.
    case file(ServedFile, fileName: String)
    /// Answer with this status and a JSON error body.
    case refuse(HTTPResponseStatus, code: String, message: String)
}

/// Maps a content path (what follows the prefix) to a file or a refusal.
public protocol ContentResolver: Sendable {
    /// Called on `eventLoop` (the channel's) for every request: it must not block. A file's
    /// handle must belong to that event loop alone: NIO refuses (EBUSY) a handle that two loops
    /// use at once, so handles are kept per event loop.
    func resolve(path: Substring, on eventLoop: any EventLoop) -> ContentResolution
}

/// Told of every content response, for metrics.
public protocol ContentObserver: Sendable {
    func responseStarted(status: HTTPResponseStatus, bytes: UInt64)
    func responseFinished(status: HTTPResponseStatus, bytes: UInt64, duration: Duration, succeeded: Bool)
}

/// Serves `GET` and `HEAD` of paths under a prefix straight from files with `sendfile`
/// (`FileRegion`), with RFC 9110 ranges and conditionals; passes every other request on.
///
/// It sits right after NIO's HTTP/1 codec and pipelining handler, ahead of any framework's codec,
/// because a framework's body type (a `ByteBuffer`) cannot carry a `FileRegion`: copying archive
/// bytes through user-space buffers costs about ten times the CPU of sendfile. Pipelined requests
/// stay in order because NIO's pipelining handler releases the next request only after this
/// handler (or the framework behind it) has written the previous response's end.
public final class ContentChannelHandler: ChannelDuplexHandler, RemovableChannelHandler {
    public typealias InboundIn = HTTPServerRequestPart
    public typealias InboundOut = HTTPServerRequestPart
    public typealias OutboundIn = HTTPServerResponsePart
    public typealias OutboundOut = HTTPServerResponsePart

    private enum State {
        case idle
        case intercepting(HTTPRequestHead)
        case forwarding
        case sending
    }

    private let prefix: String
    private let resolver: any ContentResolver
    private let observer: (any ContentObserver)?
    private let maxRanges: Int
    private var state = State.idle
    /// A forwarded request whose response has not ended yet.
    private var forwardedResponsePending = false

    public init(prefix: String, resolver: any ContentResolver, observer: (any ContentObserver)? = nil,
                maxRanges: Int = RangeEvaluator.defaultMaxRanges) {
        self.prefix = prefix
        self.resolver = resolver
        self.observer = observer
        self.maxRanges = maxRanges
    }

    public func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let part = unwrapInboundIn(data)
        switch (part, state) {
        case (.head(let head), _):
            if head.uri.utf8.starts(with: prefix.utf8) {
                state = .intercepting(head)
            } else {
                state = .forwarding
                forwardedResponsePending = true
                context.fireChannelRead(data)
            }
        case (.body, .intercepting):
            break  // a body on GET or HEAD means nothing here; it is read and dropped
        case (.end, .intercepting(let head)):
            state = .sending
            respond(context: context, head: head)
        case (.end, .forwarding):
            state = .idle
            context.fireChannelRead(data)
        default:
            context.fireChannelRead(data)
        }
    }

    public func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        if case .end = unwrapOutboundIn(data) { forwardedResponsePending = false }
        context.write(data, promise: promise)
    }

    public func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        // Read-idle (from an IdleStateHandler in front) closes only a connection that is between
        // requests: a client downloading a large archive sends nothing for minutes.
        if let idle = event as? IdleStateHandler.IdleStateEvent, idle == .read {
            if case .idle = state, !forwardedResponsePending { context.close(promise: nil) }
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    public func errorCaught(context: ChannelHandlerContext, error: any Error) {
        switch state {
        case .intercepting, .sending:
            // The framework behind must not answer a request this handler owns: close instead.
            context.close(promise: nil)
        case .idle, .forwarding:
            context.fireErrorCaught(error)
        }
    }

    private func respond(context: ChannelHandlerContext, head: HTTPRequestHead) {
        let keepAlive = head.isKeepAlive
        var headers = HTTPHeaders()
        headers.add(name: "Date", value: HTTPDate.now)
        if !keepAlive { headers.add(name: "Connection", value: "close") }
        guard head.method == .GET || head.method == .HEAD else {
            headers.add(name: "Allow", value: "GET, HEAD")
            return sendError(context: context, status: .methodNotAllowed, code: "method-not-allowed",
                             message: "content URLs answer GET and HEAD only", headers: headers, keepAlive: keepAlive, head: head)
        }
        // Byte-level slicing: Character iteration over the URI showed in the profile.
        let uri = head.uri.utf8
        let start = uri.index(uri.startIndex, offsetBy: prefix.utf8.count)
        let end = uri[start...].firstIndex(of: UInt8(ascii: "?")) ?? uri.endIndex
        let path = Substring(uri[start..<end])
        switch resolver.resolve(path: path, on: context.eventLoop) {
        case .refuse(let status, let code, let message):
            sendError(context: context, status: status, code: code, message: message, headers: headers, keepAlive: keepAlive, head: head)
        case .file(let file, let fileName):
            sendFile(context: context, head: head, file: file, fileName: fileName, headers: headers, keepAlive: keepAlive)
        }
    }

    private func sendFile(context: ChannelHandlerContext, head: HTTPRequestHead, file: ServedFile, fileName: String,
                          headers baseHeaders: HTTPHeaders, keepAlive: Bool) {
        var headers = baseHeaders
        headers.add(name: "Accept-Ranges", value: "bytes")
        headers.add(name: "ETag", value: file.etag)
        headers.add(name: "Last-Modified", value: file.lastModified)
        headers.add(name: "Cache-Control", value: "private, no-transform")
        let decision = RangeEvaluator.evaluate(
            size: file.size, etag: file.etag, lastModified: file.lastModified,
            range: head.headers.first(name: "range"), ifRange: head.headers.first(name: "if-range"),
            ifNoneMatch: head.headers.first(name: "if-none-match"), maxRanges: maxRanges)

        var status = HTTPResponseStatus.ok
        var pieces: [IOData] = []
        switch decision {
        case .notModified:
            status = .notModified
        case .unsatisfiable:
            status = .rangeNotSatisfiable
            headers.add(name: "Content-Range", value: "bytes */\(file.size)")
            headers.add(name: "Content-Length", value: "0")
        case .full:
            headers.add(name: "Content-Type", value: file.contentType)
            headers.add(name: "Content-Disposition", value: "attachment; filename=\"\(fileName)\"")
            headers.add(name: "Content-Length", value: String(file.size))
            pieces = [.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: 0, endIndex: Int(file.size)))]
        case .partial(let ranges) where ranges.count == 1:
            status = .partialContent
            let range = ranges[0]
            headers.add(name: "Content-Type", value: file.contentType)
            headers.add(name: "Content-Range", value: "bytes \(range.first)-\(range.last)/\(file.size)")
            headers.add(name: "Content-Length", value: String(range.count))
            pieces = [body(file, from: range.first, count: range.count, context: context)]
        case .partial(let ranges):
            status = .partialContent
            let boundary = String(UInt64.random(in: 0...UInt64.max), radix: 16)
            headers.add(name: "Content-Type", value: "multipart/byteranges; boundary=\(boundary)")
            var length: UInt64 = 0
            for range in ranges {
                let partHead = "\r\n--\(boundary)\r\nContent-Type: \(file.contentType)\r\nContent-Range: bytes \(range.first)-\(range.last)/\(file.size)\r\n\r\n"
                pieces.append(.byteBuffer(context.channel.allocator.buffer(string: partHead)))
                pieces.append(.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: Int(range.first), endIndex: Int(range.last) + 1)))
                length += UInt64(partHead.utf8.count) + range.count
            }
            let tail = "\r\n--\(boundary)--\r\n"
            pieces.append(.byteBuffer(context.channel.allocator.buffer(string: tail)))
            length += UInt64(tail.utf8.count)
            headers.add(name: "Content-Length", value: String(length))
        }
        if head.method == .HEAD { pieces = [] }
        let bytes = pieces.reduce(UInt64(0)) { $0 + UInt64($1.readableBytes) }
        context.write(wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: status, headers: headers))), promise: nil)
        for piece in pieces { context.write(wrapOutboundOut(.body(piece)), promise: nil) }
        finish(context: context, status: status, bytes: bytes, keepAlive: keepAlive)
    }

    /// Ranges up to this size are read into the response buffer instead of sent with sendfile.
    public static let smallRange: UInt64 = 64 << 10

    /// The bytes of one range. A small range is read into a buffer so that the response head and
    /// body leave in one `writev`, one TCP segment: with sendfile the head goes out in a segment of
    /// its own, which doubled the kernel's work per request for 4 KiB ranges (nginx avoids that
    /// with TCP_CORK). Large ranges and whole files go through sendfile.
    private func body(_ file: ServedFile, from first: UInt64, count: UInt64, context: ChannelHandlerContext) -> IOData {
        if count <= Self.smallRange {
            var buffer = context.channel.allocator.buffer(capacity: Int(count))
            let read = try? file.handle.withUnsafeFileDescriptor { fd in
                buffer.writeWithUnsafeMutableBytes(minimumWritableBytes: Int(count)) { raw in
                    max(0, pread(fd, raw.baseAddress, Int(count), off_t(first)))
                }
            }
            if read == Int(count) { return .byteBuffer(buffer) }
        }
        return .fileRegion(FileRegion(fileHandle: file.handle, readerIndex: Int(first), endIndex: Int(first + count)))
    }

    private func sendError(context: ChannelHandlerContext, status: HTTPResponseStatus, code: String, message: String,
                           headers baseHeaders: HTTPHeaders, keepAlive: Bool, head: HTTPRequestHead) {
        var headers = baseHeaders
        let body = #"{"error":{"code":"\#(jsonEscaped(code))","message":"\#(jsonEscaped(message))"}}"# + "\n"
        headers.add(name: "Content-Type", value: "application/json")
        headers.add(name: "Content-Length", value: String(body.utf8.count))
        headers.add(name: "Cache-Control", value: "no-store")
        context.write(wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: status, headers: headers))), promise: nil)
        if head.method != .HEAD {
            context.write(wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(string: body)))), promise: nil)
        }
        finish(context: context, status: status, bytes: 0, keepAlive: keepAlive)
    }

    private func finish(context: ChannelHandlerContext, status: HTTPResponseStatus, bytes: UInt64, keepAlive: Bool) {
        observer?.responseStarted(status: status, bytes: bytes)
        let started = ContinuousClock.now
        let promise = context.eventLoop.makePromise(of: Void.self)
        context.writeAndFlush(wrapOutboundOut(.end(nil)), promise: promise)
        let observer = self.observer
        promise.futureResult.assumeIsolated().whenComplete { [self] result in
            observer?.responseFinished(status: status, bytes: bytes, duration: ContinuousClock.now - started, succeeded: (try? result.get()) != nil)
            state = .idle
            if !keepAlive || (try? result.get()) == nil { context.close(promise: nil) }
        }
    }
}

func jsonEscaped(_ text: String) -> String {
    var out = ""
    for scalar in text.unicodeScalars {
        switch scalar {
        case "\"": out += "\\\""
        case "\\": out += "\\\\"
        case "\n": out += "\\n"
        case "\r": out += "\\r"
        case "\t": out += "\\t"
        default:
            if scalar.value < 0x20 { out += String(format: "\\u%04x", scalar.value) } else { out.unicodeScalars.append(scalar) }
        }
    }
    return out
}

/// IMF-fixdate strings (RFC 9110 §5.6.7), cached per second.
public enum HTTPDate {
    private static let cache = Mutex<(Int, String)>((0, ""))

    public static var now: String { format(Date()) }

    public static func format(_ date: Date) -> String {
        let second = Int(date.timeIntervalSince1970)
        if let cached = cache.withLock({ $0.0 == second ? $0.1 : nil }) { return cached }
        var time = time_t(second)
        var parts = tm()
        gmtime_r(&time, &parts)
        let days = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"]
        let months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
        func two(_ n: Int32) -> String { n < 10 ? "0\(n)" : "\(n)" }
        let text = "\(days[Int(parts.tm_wday)]), \(two(parts.tm_mday)) \(months[Int(parts.tm_mon)]) \(parts.tm_year + 1900) "
            + "\(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec)) GMT"
        cache.withLock { $0 = (second, text) }
        return text
    }
}

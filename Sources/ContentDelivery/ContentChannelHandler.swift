import Foundation
import IAPProtocol
import NIOCore
import NIOHTTP1

/// A file to serve: an open handle kept for the process's lifetime (archives are immutable) and
/// its validators. A class: every response carries one, and a reference is one retain where the
/// struct's strings were six.
public final class ServedFile: Sendable {
    public let handle: NIOFileHandle
    public let size: UInt64
    /// Strong entity tag, quotes included.
    public let etag: String
    /// `Last-Modified`, as HTTP writes dates.
    public let lastModified: String
    /// The same date in seconds since 1970, for `If-Unmodified-Since`.
    public let modifiedAt: Int64
    public let contentType: String
    /// `Repr-Digest` (RFC 9530), `sha-256=:<base64>:`, when the ETag is a quoted SHA-256 in hex:
    /// caches and clients can check what they hold without a byte of the body.
    public let reprDigest: String?
    /// The validator fields as the fast path writes them (`ResponseFields`), rendered once.
    let validatorFields: [UInt8]

    /// Whether the file is now shorter than `size`: cut short on disk behind the server's back
    /// (a copy over it stopped part-way). A closed handle is not (its write fails on its own).
    public var isCutShort: Bool {
        var info = stat()
        guard (try? handle.withUnsafeFileDescriptor({ fstat($0, &info) })) == 0 else { return false }
        return UInt64(info.st_size) < size
    }

    public init(handle: NIOFileHandle, size: UInt64, etag: String, modified: Date, contentType: String = "application/zip") {
        self.handle = handle
        self.size = size
        self.etag = etag
        let lastModified = HTTPDate.format(modified)
        self.lastModified = lastModified
        modifiedAt = Int64(modified.timeIntervalSince1970.rounded(.down))
        self.contentType = contentType
        let hex = Array(etag.utf8.dropFirst().dropLast())
        var bytes: [UInt8] = []
        if etag.hasPrefix("\""), etag.hasSuffix("\""), hex.count == 64 {
            for i in stride(from: 0, to: 64, by: 2) {
                guard let byte = UInt8(String(decoding: hex[i..<i + 2], as: UTF8.self), radix: 16) else { break }
                bytes.append(byte)
            }
        }
        let digest = bytes.count == 32 ? "sha-256=:\(Data(bytes).base64EncodedString()):" : nil
        reprDigest = digest
        // The three names and their separators come to under 64 bytes.
        validatorFields = RawHeadWriter.bytes(within: 64 + etag.utf8.count + lastModified.utf8.count + (digest?.utf8.count ?? 0)) {
            $0.validatorFields(etag: etag, lastModified: lastModified, reprDigest: digest)
        }
    }
}

/// What a content path resolves to.
public enum ContentResolution: Sendable {
    /// Serve this file; `fileName` goes into `Content-Disposition`; `freshFor` is how long (in
    /// seconds) the URL stays valid, the `max-age` a private cache may keep the bytes.
    case file(ServedFile, fileName: String, freshFor: Int64)
    /// Answer with this status and a JSON error body.
    case refuse(HTTPResponseStatus, APIError)
    /// Answer 307 Temporary Redirect to this URL: another server has the bytes (for now).
    case redirect(String)
}

/// Maps a content key (the first path segment after the prefix: a grant token, say) to a file or
/// a refusal.
public protocol ContentResolver: Sendable {
    /// Called on `eventLoop` (the channel's) for every request: it must not block. A file's
    /// handle must belong to that event loop alone: NIO refuses (EBUSY) a handle that two loops
    /// use at once, so handles are kept per event loop.
    /// `name` is what follows the key in the path (without the query): `<id>-<version>.zip`, say.
    func resolve(key: Substring, name: Substring, on eventLoop: any EventLoop) -> ContentResolution

    /// A value that changes whenever a `.file` resolution given earlier may no longer hold (a
    /// transaction revoked, the files closed). A connection answers its later requests for the
    /// same path from the resolution it got, without calling `resolve`, while this is unchanged
    /// and the resolution is fresh (`freshFor`). Read on the event loop for every request: it
    /// must be cheap (an atomic load). `nil`, the default, means resolutions are never reused.
    var reuseStamp: UInt64? { get }

    /// Told, on the event loop, that `file` is now shorter on disk than when it was resolved (cut
    /// short behind the server's back), before `resolve` is asked once more for the request: a
    /// resolver that keeps handles lets go of this one, so the path is looked at afresh. The
    /// default does nothing, and a file that is still short then is answered 503 `archive-damaged`.
    func fileCutShort(_ file: ServedFile)
}

extension ContentResolver {
    public var reuseStamp: UInt64? { nil }
    public func fileCutShort(_ file: ServedFile) {}
}

/// Told of every content response, for metrics.
public protocol ContentObserver: Sendable {
    func responseStarted(status: HTTPResponseStatus, bytes: UInt64)
    /// `duration` is measured only for responses of more than `ContentObserverLimits.untimedBytes`
    /// (64 KiB); it is zero for smaller ones, which leave with their head in one write: two
    /// clock reads per small range were wasted on them.
    func responseFinished(status: HTTPResponseStatus, bytes: UInt64, duration: Duration, succeeded: Bool)
}

/// The size below which content responses are not timed, for observers that treat those
/// differently (the server's metrics do not count them as transfers).
public enum ContentObserverLimits {
    public static let untimedBytes: UInt64 = ContentResponse.smallRange
}

/// Serves `GET` and `HEAD` of paths under a prefix straight from files with `sendfile`
/// (`FileRegion`), with RFC 9110 ranges and conditionals; passes every other request on.
///
/// It sits right after NIO's HTTP/1 codec and pipelining handler, ahead of any framework's codec,
/// because a framework's body type (a `ByteBuffer`) cannot carry a `FileRegion`: copying archive
/// bytes through user-space buffers costs many times the CPU of sendfile. Pipelined requests
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
    private var memory = ResponseMemory()
    private var stalls = StalledReader()

    public init(
        prefix: String, resolver: any ContentResolver, observer: (any ContentObserver)? = nil,
        maxRanges: Int = RangeEvaluator.defaultMaxRanges
    ) {
        self.prefix = prefix
        self.resolver = resolver
        self.observer = observer
        self.maxRanges = maxRanges
    }

    public func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let part = unwrapInboundIn(data)
        switch (part, state) {
        case (.head(var head), _):
            if let path = Self.originForm(head.uri), path.utf8.starts(with: prefix.utf8) {
                head.uri = path
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

    /// The path and query of a request target: itself in origin form (`/v1/...`), or what follows
    /// the authority in absolute form (`http://host/v1/...`), which a server must accept too
    /// (RFC 9112 §3.2.2); nil for the other forms.
    static func originForm(_ target: String) -> String? {
        if target.hasPrefix("/") { return target }
        for scheme in ["http://", "https://"] where target.count > scheme.count && target.prefix(scheme.count).lowercased() == scheme {
            let rest = target.dropFirst(scheme.count)
            guard let slash = rest.firstIndex(of: "/") else { return "/" }
            return String(rest[slash...])
        }
        return nil
    }

    public func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        if case .end = unwrapOutboundIn(data) { forwardedResponsePending = false }
        context.write(data, promise: promise)
    }

    public func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        // Read-idle (from an IdleStateHandler in front) closes a connection that is between
        // requests, and one whose client has taken nothing of its content response since the
        // last event: a client downloading a large archive sends nothing for minutes.
        if let idle = event as? IdleStateHandler.IdleStateEvent, idle == .read {
            switch state {
            case .idle where !forwardedResponsePending:
                context.close(promise: nil)
            case .sending where stalls.hasStopped(context.channel):
                context.close(promise: nil)
            default:
                break
            }
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

    /// A list-valued field (entity tags) sent on several lines is one list (RFC 9110 §5.3).
    private static func list(_ headers: HTTPHeaders, _ name: String) -> String? {
        let values = headers[name]
        return values.isEmpty ? nil : values.joined(separator: ", ")
    }

    private func respond(context: ChannelHandlerContext, head: HTTPRequestHead) {
        let request = ContentRequest(
            method: head.method, uri: head.uri, keepAlive: head.isKeepAlive,
            range: head.headers.first(name: "range"), ifRange: head.headers.first(name: "if-range"),
            ifNoneMatch: Self.list(head.headers, "if-none-match"), ifModifiedSince: head.headers.first(name: "if-modified-since"),
            ifMatch: Self.list(head.headers, "if-match"), ifUnmodifiedSince: head.headers.first(name: "if-unmodified-since"))
        let response = ContentResponse.make(
            request, prefix: prefix, maxRanges: maxRanges, resolver: resolver, memory: &memory,
            eventLoop: context.eventLoop, allocator: context.channel.allocator)
        let headers = response.fields.httpHeaders
        // Corked until all of it has left (see `setCork`).
        let corked = !response.body.isEmpty
        if corked { context.setCork(true) }
        context.write(wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: response.status, headers: headers))), promise: nil)
        for piece in response.body { context.write(wrapOutboundOut(.body(piece)), promise: nil) }
        let report = ResponseReport(response, observer: observer)
        let keepAlive = response.keepAlive
        let promise = context.eventLoop.makePromise(of: Void.self)
        context.writeAndFlush(wrapOutboundOut(.end(nil)), promise: promise)
        promise.futureResult.assumeIsolated().whenComplete { [self] result in
            if corked { context.setCork(false) }
            let succeeded = report.finished(result, observer: observer)
            state = .idle
            stalls.reset()
            if !keepAlive || !succeeded { context.close(promise: nil) }
        }
    }
}

import Foundation
import IAPProtocol
import NIOCore
import NIOHTTP1

/// What a content request asks, however it was parsed.
struct ContentRequest: Sendable, Equatable {
    var method: HTTPMethod
    var uri: String
    var keepAlive: Bool
    var range: String?
    var ifRange: String?
    var ifNoneMatch: String?
    var ifModifiedSince: String? = nil
    var ifMatch: String? = nil
    var ifUnmodifiedSince: String? = nil
}

/// What a connection remembers from one response to the next: its last resolution, and the
/// `Date` field of the current second (formatted once per second per connection: a cache shared
/// by every event loop cost a lock and a contended retain per response).
struct ResponseMemory {
    var resolved: ResolvedContent?
    private var dateSecond: Int64 = .min
    private var dateText = ""

    mutating func date(_ now: Date) -> String {
        let second = Int64(now.timeIntervalSince1970)
        if second != dateSecond {
            dateSecond = second
            dateText = HTTPDate.format(now)
        }
        return dateText
    }
}

/// What a connection's last `.file` resolution was, kept so that its next request for the same
/// path (a download sends one request per range, all with the same URL) is answered without
/// asking the resolver again: checking a grant token (hashing it, a lock, the revocation set) was
/// a tenth of the server's CPU for 4 KiB ranges. Reused only while the resolver's `reuseStamp`
/// is unchanged (a revocation changes it) and the resolution is fresh.
struct ResolvedContent {
    let uri: String
    let stamp: UInt64
    let file: ServedFile
    let fileName: String
    /// Unix seconds from which the resolution no longer holds (the grant's expiry).
    let expiresAt: Int64
}

/// The answer to one content request, decided once for both ways a request can arrive (through
/// NIO's HTTP/1 decoder, or parsed by `ContentFastPath`): status, header fields, and body
/// pieces (file regions for sendfile, or buffers).
struct ContentResponse {
    var status: HTTPResponseStatus
    var fields: ResponseFields
    var body: [IOData]
    var keepAlive: Bool
    /// Archive bytes this response sends, for the metrics (an error's JSON body is not counted).
    var servedBytes: UInt64 = 0

    /// Ranges up to this size are read into the response buffer instead of sent with sendfile.
    static let smallRange: UInt64 = 64 << 10

    /// Free bytes left in front of a small range's buffer, for the response head: the fast path
    /// writes the head there, so head and body leave in one buffer without a copy of the body.
    static let headroom = 1024

    /// Decides the answer to `request`. `memory.resolved` is the connection's last resolution:
    /// used when it still holds for this request, replaced when the resolver is asked.
    static func make(
        _ request: ContentRequest, prefix: String, maxRanges: Int, resolver: any ContentResolver,
        memory: inout ResponseMemory, eventLoop: any EventLoop, allocator: ByteBufferAllocator
    ) -> ContentResponse {
        let (method, uri, keepAlive) = (request.method, request.uri, request.keepAlive)
        let now = Date()
        let seconds = Int64(now.timeIntervalSince1970)
        var fields = ResponseFields(date: memory.date(now), close: !keepAlive)
        guard method == .GET || method == .HEAD else {
            fields.allow = true
            return error(
                .methodNotAllowed, APIError(.methodNotAllowed, "content URLs answer GET and HEAD only"),
                fields: fields, method: method, keepAlive: keepAlive, allocator: allocator)
        }
        let stamp = resolver.reuseStamp
        if let known = memory.resolved, let stamp, known.stamp == stamp, seconds < known.expiresAt, known.uri == uri {
            var reused = fields
            reused.caching = .privateImmutable(maxAge: known.expiresAt - seconds)
            if let response = serve(known.file, fileName: known.fileName, request: request, maxRanges: maxRanges, fields: reused, allocator: allocator) {
                return response
            }
            resolver.fileCutShort(known.file)
        }
        memory.resolved = nil
        let utf8 = uri.utf8
        let start = utf8.index(utf8.startIndex, offsetBy: prefix.utf8.count)
        // The key is the first path segment after the prefix; what follows it (a file name for
        // people and caches) and the query do not matter.
        let rest = uri[start...]
        let slash = rest.utf8Offset(of: UInt8(ascii: "/")) ?? rest.utf8.count
        let query = rest.utf8Offset(of: UInt8(ascii: "?")) ?? rest.utf8.count
        let keyEnd = utf8.index(start, offsetBy: min(slash, query))
        let key = Substring(utf8[start..<keyEnd])
        let name = slash < query ? Substring(utf8[utf8.index(after: keyEnd)..<utf8.index(start, offsetBy: query)]) : ""
        // A second time only when the file resolved the first time was found cut short.
        for _ in 0..<2 {
            switch resolver.resolve(key: key, name: name, on: eventLoop) {
            case .refuse(let status, let refusal):
                return error(status, refusal, fields: fields, method: method, keepAlive: keepAlive, allocator: allocator)
            case .redirect(let location):
                fields.location = location
                return error(
                    .temporaryRedirect, APIError(.noContent, "this server is still fetching the archive: get it from \(location)"),
                    fields: fields, method: method, keepAlive: keepAlive, allocator: allocator)
            case .file(let file, let fileName, let freshFor):
                // Bytes behind a grant: only the buyer's own cache keeps them (an edge caches them
                // by explicit configuration, after asking the server about the grant), never
                // revalidated while the URL is valid (the archive under a URL never changes).
                var served = fields
                served.caching = .privateImmutable(maxAge: freshFor)
                if let response = serve(file, fileName: fileName, request: request, maxRanges: maxRanges, fields: served, allocator: allocator) {
                    if let stamp {
                        memory.resolved = ResolvedContent(uri: uri, stamp: stamp, file: file, fileName: fileName, expiresAt: seconds + freshFor)
                    }
                    return response
                }
                resolver.fileCutShort(file)
            }
        }
        return error(
            .serviceUnavailable, APIError(.archiveDamaged, "the file at this URL is shorter on the server than it was published (damaged on disk): try again later"),
            fields: fields, method: method, keepAlive: keepAlive, allocator: allocator)
    }

    /// The response from `file`; nil when the file is cut short (see below).
    private static func serve(
        _ file: ServedFile, fileName: String, request: ContentRequest, maxRanges: Int,
        fields base: ResponseFields, allocator: ByteBufferAllocator
    ) -> ContentResponse? {
        let method = request.method
        var fields = base
        fields.validators = file
        let decision = RangeEvaluator.evaluate(
            size: file.size, etag: file.etag, lastModified: file.lastModified, modifiedAt: file.modifiedAt,
            range: request.range, ifRange: request.ifRange, ifNoneMatch: request.ifNoneMatch, ifModifiedSince: request.ifModifiedSince,
            ifMatch: request.ifMatch, ifUnmodifiedSince: request.ifUnmodifiedSince, maxRanges: maxRanges)
        var status = HTTPResponseStatus.ok
        var pieces: [IOData] = []
        switch decision {
        case .preconditionFailed:
            return error(
                .preconditionFailed,
                APIError(
                    .preconditionFailed,
                    "the file at this URL does not match the request's If-Match or If-Unmodified-Since: drop the condition, or ask POST /v1/downloads for the current version"),
                fields: base, method: method, keepAlive: request.keepAlive, allocator: allocator)
        case .notModified:
            status = .notModified
        case .unsatisfiable:
            status = .rangeNotSatisfiable
            fields.contentRange = .unsatisfied(size: file.size)
            fields.contentLength = 0
        case .full:
            fields.contentType = .text(file.contentType)
            fields.attachment = fileName
            fields.contentLength = file.size
            pieces = [.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: 0, endIndex: Int(file.size)))]
        case .partial(let ranges) where ranges.count == 1:
            status = .partialContent
            let range = ranges[0]
            fields.contentType = .text(file.contentType)
            fields.contentRange = .bytes(range, size: file.size)
            fields.contentLength = range.count
            if method != .HEAD { pieces = [body(file, from: range.first, count: range.count, allocator: allocator)] }
        case .partial(let ranges):
            status = .partialContent
            let boundary = String(UInt64.random(in: 0...UInt64.max), radix: 16)
            fields.contentType = .multipart(boundary: boundary)
            var length: UInt64 = 0
            for range in ranges {
                let partHead = "\r\n--\(boundary)\r\nContent-Type: \(file.contentType)\r\nContent-Range: bytes \(range.first)-\(range.last)/\(file.size)\r\n\r\n"
                pieces.append(.byteBuffer(allocator.buffer(string: partHead)))
                pieces.append(.fileRegion(FileRegion(fileHandle: file.handle, readerIndex: Int(range.first), endIndex: Int(range.last) + 1)))
                length += UInt64(partHead.utf8.count) + range.count
            }
            let tail = "\r\n--\(boundary)--\r\n"
            pieces.append(.byteBuffer(allocator.buffer(string: tail)))
            length += UInt64(tail.utf8.count)
            fields.contentLength = length
        }
        if method == .HEAD { pieces = [] }
        // sendfile past a file's end sends nothing, and NIO tries again at once: a file cut short
        // behind the server's back spun its event loop for as long as the client waited (one core
        // at 100%, every other connection on that loop stalled). One fstat per response that
        // sends from the file; the caller has the resolver look again.
        if pieces.contains(where: { if case .fileRegion = $0 { true } else { false } }), file.isCutShort { return nil }
        let served = pieces.reduce(UInt64(0)) { $0 + UInt64($1.readableBytes) }
        return ContentResponse(status: status, fields: fields, body: pieces, keepAlive: request.keepAlive, servedBytes: served)
    }

    /// The bytes of one range. A small range is read into a buffer so that the response head and
    /// body leave in one `writev`, one TCP segment: with sendfile the head goes out in a segment of
    /// its own, which doubled the kernel's work per request for 4 KiB ranges (nginx avoids that
    /// with TCP_CORK). Large ranges and whole files go through sendfile.
    private static func body(_ file: ServedFile, from first: UInt64, count: UInt64, allocator: ByteBufferAllocator) -> IOData {
        if count <= smallRange {
            var buffer = allocator.buffer(capacity: headroom + Int(count))
            buffer.moveWriterIndex(to: headroom)
            buffer.moveReaderIndex(to: headroom)
            let read = try? file.handle.withUnsafeFileDescriptor { fd in
                buffer.writeWithUnsafeMutableBytes(minimumWritableBytes: Int(count)) { raw in
                    max(0, pread(fd, raw.baseAddress, Int(count), off_t(first)))
                }
            }
            if read == Int(count) { return .byteBuffer(buffer) }
        }
        return .fileRegion(FileRegion(fileHandle: file.handle, readerIndex: Int(first), endIndex: Int(first + count)))
    }

    private static func error(
        _ status: HTTPResponseStatus, _ refusal: APIError, fields base: ResponseFields,
        method: HTTPMethod, keepAlive: Bool, allocator: ByteBufferAllocator
    ) -> ContentResponse {
        var fields = base
        let body = WireJSON.line(refusal.envelope)
        fields.contentType = .text("application/json")
        fields.contentLength = UInt64(body.count)
        fields.caching = .noStore
        if status == .unauthorized { fields.challenge = Challenge.grant }
        let pieces: [IOData] = method == .HEAD ? [] : [.byteBuffer(allocator.buffer(bytes: body))]
        return ContentResponse(status: status, fields: fields, body: pieces, keepAlive: keepAlive)
    }
}

extension Substring {
    /// Where `byte` first occurs, in UTF-8 code units from the start. Searches the contiguous
    /// bytes: `utf8.firstIndex(of:)` goes through String's index machinery byte by byte, on a path
    /// every small range request takes.
    func utf8Offset(of byte: UInt8) -> Int? {
        if let offset = utf8.withContiguousStorageIfAvailable({ $0.firstIndex(of: byte) }) { return offset }
        return utf8.firstIndex(of: byte).map { utf8.distance(from: utf8.startIndex, to: $0) }
    }
}

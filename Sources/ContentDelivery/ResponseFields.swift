import NIOCore
import NIOHTTP1

/// The header fields of a content response as values, rendered in one order into either the
/// bytes the fast path writes or the `HTTPHeaders` NIO's encoder takes.
///
/// Why values rather than a list of strings: small range requests are bound by per-request CPU,
/// and building a dozen strings per response (numbers formatted, values interpolated, then copied
/// into the buffer) was about a third of the server's user time for 4 KiB ranges. Rendered
/// straight into the outgoing buffer they cost a few copies of bytes that already exist.
struct ResponseFields {
    enum Caching {
        case unset
        /// `private, max-age=N, immutable, no-transform`: bytes behind a grant.
        case privateImmutable(maxAge: Int64)
        /// `no-store`: errors.
        case noStore
    }

    enum ContentType {
        case unset
        case text(String)
        case multipart(boundary: String)
    }

    enum ContentRange {
        case unset
        case bytes(ByteRange, size: UInt64)
        /// `bytes */size`, for 416.
        case unsatisfied(size: UInt64)
    }

    var date: String
    var close: Bool
    /// `Allow: GET, HEAD`, for 405.
    var allow = false
    var location: String? = nil
    /// `WWW-Authenticate`, for 401.
    var challenge: String? = nil
    var caching = Caching.unset
    /// The file whose validators the response carries: `Accept-Ranges`, `ETag`, `Last-Modified`
    /// and `Repr-Digest` when it has one.
    var validators: ServedFile? = nil
    var contentType = ContentType.unset
    /// `Content-Disposition: attachment` with this file name.
    var attachment: String? = nil
    var contentRange = ContentRange.unset
    var contentLength: UInt64? = nil

    init(date: String, close: Bool) {
        self.date = date
        self.close = close
    }

    func render<Sink: HeadFieldSink>(into sink: inout Sink) {
        sink.field("Date", date)
        if close { sink.field("Connection", "close" as StaticString) }
        if allow { sink.field("Allow", "GET, HEAD" as StaticString) }
        if let location { sink.field("Location", location) }
        if let challenge { sink.field("WWW-Authenticate", challenge) }
        switch caching {
        case .unset: break
        case .privateImmutable(let maxAge):
            sink.beginField("Cache-Control")
            sink.append("private, max-age=")
            sink.append(UInt64(max(0, maxAge)))
            sink.append(", immutable, no-transform")
            sink.endField()
        case .noStore: sink.field("Cache-Control", "no-store" as StaticString)
        }
        if let file = validators { sink.validatorFields(of: file) }
        switch contentType {
        case .unset: break
        case .text(let type): sink.field("Content-Type", type)
        case .multipart(let boundary):
            sink.beginField("Content-Type")
            sink.append("multipart/byteranges; boundary=")
            sink.append(boundary)
            sink.endField()
        }
        if let attachment {
            sink.beginField("Content-Disposition")
            sink.append("attachment; filename=\"")
            sink.append(attachment)
            sink.append("\"")
            sink.endField()
        }
        switch contentRange {
        case .unset: break
        case .bytes(let range, let size):
            sink.beginField("Content-Range")
            sink.append("bytes ")
            sink.append(range.first)
            sink.append("-")
            sink.append(range.last)
            sink.append("/")
            sink.append(size)
            sink.endField()
        case .unsatisfied(let size):
            sink.beginField("Content-Range")
            sink.append("bytes */")
            sink.append(size)
            sink.endField()
        }
        if let contentLength {
            sink.beginField("Content-Length")
            sink.append(contentLength)
            sink.endField()
        }
    }

    /// At least as many bytes as `render` writes: every field name, literal value and separator
    /// comes to under 400 bytes, each number to at most 20 digits (counted in that 512), and the
    /// strings are counted as they are.
    var renderedSizeBound: Int {
        var bound = 512 + date.utf8.count + (location?.utf8.count ?? 0) + (challenge?.utf8.count ?? 0) + (attachment?.utf8.count ?? 0)
        bound += validators?.validatorFields.count ?? 0
        switch contentType {
        case .unset: break
        case .text(let type): bound += type.utf8.count
        case .multipart(let boundary): bound += boundary.utf8.count
        }
        return bound
    }

    /// The fields for NIO's HTTP/1 encoder.
    var httpHeaders: HTTPHeaders {
        var sink = HTTPHeadersSink()
        render(into: &sink)
        return sink.headers
    }
}

/// Where `ResponseFields` renders to: one field at a time, its value in pieces.
protocol HeadFieldSink {
    mutating func beginField(_ name: StaticString)
    mutating func append(_ text: String)
    mutating func append(_ text: StaticString)
    mutating func append(_ number: UInt64)
    mutating func endField()
    /// `Accept-Ranges`, `ETag`, `Last-Modified` and, when the file has one, `Repr-Digest`.
    mutating func validatorFields(of file: ServedFile)
}

extension HeadFieldSink {
    mutating func validatorFields(of file: ServedFile) {
        validatorFields(etag: file.etag, lastModified: file.lastModified, reprDigest: file.reprDigest)
    }

    /// The validator fields one by one: how every sink writes them, and how `ServedFile` renders
    /// the block the fast path copies.
    mutating func validatorFields(etag: String, lastModified: String, reprDigest: String?) {
        field("Accept-Ranges", "bytes" as StaticString)
        field("ETag", etag)
        field("Last-Modified", lastModified)
        if let reprDigest { field("Repr-Digest", reprDigest) }
    }

    mutating func field(_ name: StaticString, _ value: String) {
        beginField(name)
        append(value)
        endField()
    }

    mutating func field(_ name: StaticString, _ value: StaticString) {
        beginField(name)
        append(value)
        endField()
    }
}

/// The fast path's rendering: `Name: value\r\n` into memory reserved for the whole head
/// (`ResponseFields.renderedSizeBound`), checked against its end at every piece. Written by hand
/// because `ByteBuffer`'s writes each check capacity, uniqueness and exclusive access: rendered
/// piece by piece into one, a 4 KiB range's head took a tenth of the server's own CPU per request.
struct RawHeadWriter: HeadFieldSink {
    private let memory: UnsafeMutableRawBufferPointer
    private(set) var written = 0

    init(_ memory: UnsafeMutableRawBufferPointer) {
        self.memory = memory
    }

    /// What `render` writes, as bytes, in at most `bound` of them.
    static func bytes(within bound: Int, _ render: (inout RawHeadWriter) -> Void) -> [UInt8] {
        [UInt8](unsafeUninitializedCapacity: bound) { memory, count in
            var writer = RawHeadWriter(UnsafeMutableRawBufferPointer(memory))
            render(&writer)
            count = writer.written
        }
    }

    private mutating func put(_ bytes: UnsafeRawBufferPointer) {
        precondition(bytes.count <= memory.count - written, "a response head over its reserved size")
        guard let source = bytes.baseAddress, let target = memory.baseAddress else { return }
        (target + written).copyMemory(from: source, byteCount: bytes.count)
        written += bytes.count
    }

    mutating func beginField(_ name: StaticString) {
        append(name)
        append(": ")
    }

    mutating func append(_ text: StaticString) {
        put(UnsafeRawBufferPointer(start: text.utf8Start, count: text.utf8CodeUnitCount))
    }

    mutating func append(_ text: String) {
        var text = text
        text.withUTF8 { put(UnsafeRawBufferPointer($0)) }
    }

    /// Decimal digits, written backwards into a stack buffer: `String(n)` allocates.
    mutating func append(_ number: UInt64) {
        withUnsafeTemporaryAllocation(of: UInt8.self, capacity: 20) { digits in
            var value = number
            var index = 20
            repeat {
                index -= 1
                digits[index] = UInt8(ascii: "0") + UInt8(truncatingIfNeeded: value % 10)
                value /= 10
            } while value > 0
            put(UnsafeRawBufferPointer(UnsafeBufferPointer(rebasing: digits[index..<20])))
        }
    }

    mutating func endField() { append("\r\n") }

    /// One copy of the bytes rendered when the file was opened: they never change.
    mutating func validatorFields(of file: ServedFile) {
        file.validatorFields.withUnsafeBytes { put($0) }
    }
}

/// The rendering for requests that came through NIO's decoder.
struct HTTPHeadersSink: HeadFieldSink {
    var headers = HTTPHeaders()
    private var name = ""
    private var value = ""

    mutating func beginField(_ name: StaticString) {
        self.name = name.description
        value = ""
    }

    mutating func append(_ text: String) { value += text }
    mutating func append(_ text: StaticString) { value += text.description }
    mutating func append(_ number: UInt64) { value += String(number) }
    mutating func endField() { headers.add(name: name, value: value) }
}

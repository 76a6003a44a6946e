import NIOCore
import NIOHTTP1

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// The fast path's reader of request heads: a pure value over bytes, so it is tested with byte
/// fixtures and no channel. It takes only `GET` or `HEAD` under one prefix, HTTP/1.1 or 1.0, no
/// body, well-formed fields within limits, and answers `.handOff` for anything else, including
/// everything that parsers are known to read differently (repeated fields, obs-fold, bare LF,
/// `Transfer-Encoding`, `Expect`, `Upgrade`), so those meet NIO's parser instead.
struct RequestHeadParser: Sendable {
    /// A head the fast path answers.
    struct Head: Sendable, Equatable {
        var content: ContentRequest
        var http10: Bool
    }

    enum Parsed: Sendable, Equatable {
        /// Not a whole head yet, and it could still become one the fast path takes.
        case incomplete
        /// Not for the fast path: NIO's decoder reads this connection from here on.
        case handOff
        /// A request whose head is the first `length` bytes.
        case request(Head, length: Int)
    }

    /// Heads larger than this, or with more lines, are left to the decoder and its limits.
    static let maxHead = 16 << 10
    static let maxHeaderLines = 100

    private let getLine: [UInt8]
    private let headLine: [UInt8]

    /// A parser for requests under `prefix` (for example `/v1/content/`).
    init(prefix: String) {
        getLine = Array("GET \(prefix)".utf8)
        headLine = Array("HEAD \(prefix)".utf8)
    }

    /// Parses one request head at the start of `buffer`. `knownURI`, the connection's last
    /// target, is used as the request's when the bytes spell it: a download asks for the same
    /// URL range after range, and building the string again was 1.5% of the CPU per 4 KiB range.
    func parse(_ buffer: ByteBuffer, knownURI: String? = nil) -> Parsed {
        buffer.withUnsafeReadableBytes { raw in parse(raw.bindMemory(to: UInt8.self), knownURI: knownURI) }
    }

    /// Parses one request head at the start of `bytes` (RFC 9112 §2-§5), strictly: whatever
    /// it is not sure of is handed off, so it never answers a request NIO's parser would read
    /// differently.
    func parse(_ bytes: UnsafeBufferPointer<UInt8>, knownURI: String? = nil) -> Parsed {
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
        // memchr from line feed to line feed, not a loop over subscripts: with the target's
        // comparison below, the byte loops were 4% of the CPU per 4 KiB range (`perf`).
        let limit = min(bytes.count, Self.maxHead)
        var end = -1
        if let base = bytes.baseAddress {
            var i = 3
            while i < limit, let found = memchr(base + i, 0x0A, limit - i) {
                i = UnsafeRawPointer(base).distance(to: found)
                if bytes[i - 1] == 0x0D, bytes[i - 2] == 0x0A, bytes[i - 3] == 0x0D {
                    end = i + 1
                    break
                }
                i += 1
            }
        }
        guard end > 0 else { return bytes.count >= Self.maxHead ? .handOff : .incomplete }

        // Request line: METHOD SP target SP HTTP-version CRLF.
        // The target: visible ASCII after "GET " or "HEAD ", up to the space before the version.
        var p = lead.count
        while p < end, bytes[p] > 0x20, bytes[p] < 0x7F { p += 1 }
        guard p < end, bytes[p] == 0x20 else { return .handOff }
        let target = UnsafeBufferPointer(rebasing: bytes[(method == .GET ? 4 : 5)..<p])
        let uri: String
        if var known = knownURI,
            known.withUTF8({ $0.count == target.count && (target.isEmpty || memcmp($0.baseAddress!, target.baseAddress!, target.count) == 0) })
        {
            uri = known
        } else {
            uri = String(decoding: target, as: UTF8.self)
        }
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
            case .range: guard Self.store(value, in: &request.range) else { return .handOff }
            case .ifRange: guard Self.store(value, in: &request.ifRange) else { return .handOff }
            case .ifNoneMatch: guard Self.store(value, in: &request.ifNoneMatch) else { return .handOff }
            case .ifModifiedSince: guard Self.store(value, in: &request.ifModifiedSince) else { return .handOff }
            case .ifMatch: guard Self.store(value, in: &request.ifMatch) else { return .handOff }
            case .ifUnmodifiedSince: guard Self.store(value, in: &request.ifUnmodifiedSince) else { return .handOff }
            case .connection:
                for token in value.split(separator: UInt8(ascii: ",")) {
                    let option = token.drop { $0 == 0x20 || $0 == 0x09 }.reversed().drop { $0 == 0x20 || $0 == 0x09 }.reversed()
                    if equalsIgnoringCase(option, "close") { connectionClose = true }
                    if equalsIgnoringCase(option, "keep-alive") { connectionKeepAlive = true }
                    if equalsIgnoringCase(option, "upgrade") { return .handOff }
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
        return .request(Head(content: request, http10: http10), length: end)
    }

    /// Keeps a field's value; false when the field came before (a repeated field is left to NIO).
    @inline(__always)
    private static func store(_ value: UnsafeBufferPointer<UInt8>, in slot: inout String?) -> Bool {
        guard slot == nil else { return false }
        slot = String(decoding: value, as: UTF8.self)
        return true
    }

    private enum Field {
        case range, ifRange, ifNoneMatch, ifModifiedSince, ifMatch, ifUnmodifiedSince, connection, contentLength, handOff, other
    }

    private static func field(_ name: UnsafeBufferPointer<UInt8>) -> Field {
        switch name.count {
        case 5 where equalsIgnoringCase(name, "range"): .range
        case 8 where equalsIgnoringCase(name, "if-range"): .ifRange
        case 13 where equalsIgnoringCase(name, "if-none-match"): .ifNoneMatch
        case 17 where equalsIgnoringCase(name, "if-modified-since"): .ifModifiedSince
        case 8 where equalsIgnoringCase(name, "if-match"): .ifMatch
        case 19 where equalsIgnoringCase(name, "if-unmodified-since"): .ifUnmodifiedSince
        case 10 where equalsIgnoringCase(name, "connection"): .connection
        case 14 where equalsIgnoringCase(name, "content-length"): .contentLength
        case 17 where equalsIgnoringCase(name, "transfer-encoding"): .handOff
        case 7 where equalsIgnoringCase(name, "upgrade"): .handOff
        case 6 where equalsIgnoringCase(name, "expect"): .handOff
        default: .other
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

/// Whether `bytes` spell `lowercase` with ASCII letters in either case (header names, tokens,
/// range units). Generic over the bytes so that each caller's collection is specialized.
func equalsIgnoringCase<Bytes: Collection<UInt8>>(_ bytes: Bytes, _ lowercase: StaticString) -> Bool {
    guard bytes.count == lowercase.utf8CodeUnitCount else { return false }
    return lowercase.withUTF8Buffer { expected in
        zip(bytes, expected).allSatisfy { byte, lower in
            (byte >= UInt8(ascii: "A") && byte <= UInt8(ascii: "Z") ? byte | 0x20 : byte) == lower
        }
    }
}

import IAPProtocol

/// A satisfiable byte range, both ends inclusive (as `Content-Range` writes them).
public struct ByteRange: Sendable, Equatable, CustomStringConvertible {
    public let first: UInt64
    public let last: UInt64

    public init(first: UInt64, last: UInt64) {
        precondition(first <= last)
        self.first = first
        self.last = last
    }

    public var count: UInt64 { last - first + 1 }
    public var description: String { "\(first)-\(last)" }
}

/// What a GET or HEAD of a representation should answer, given its size and validators.
public enum RangeDecision: Sendable, Equatable {
    /// 200 with the whole representation.
    case full
    /// 206 with one range (`Content-Range`) or several (`multipart/byteranges`), sorted and coalesced.
    case partial([ByteRange])
    /// 416 with `Content-Range: bytes */size`.
    case unsatisfiable
    /// 304: the client's `If-None-Match` matches.
    case notModified
    /// 412: the client's `If-Match` or `If-Unmodified-Since` does not hold.
    case preconditionFailed
}

/// RFC 9110 §13–14 for a static representation with a strong ETag: conditional requests and
/// byte ranges.
///
/// Written here rather than taken from a framework because the common file middlewares get
/// suffix ranges, ranges past the end and `If-Range` wrong.
public enum RangeEvaluator {
    /// Ranges beyond this many make the request answer with the whole representation, as nginx's
    /// `max_ranges` does: thousands of tiny ranges cost far more than the bytes they ask for.
    public static let defaultMaxRanges = 16

    /// Decides the response.
    /// - Parameters:
    ///   - size: the representation's length in bytes.
    ///   - etag: the strong entity tag, quotes included (`"abc"`).
    ///   - lastModified: the `Last-Modified` value as sent.
    ///   - modifiedAt: the same date in seconds since 1970, for `If-Unmodified-Since`.
    ///   - range, ifRange, ifNoneMatch, ifModifiedSince, ifMatch, ifUnmodifiedSince: the
    ///     request's header values, if present.
    public static func evaluate(
        size: UInt64, etag: String, lastModified: String?, modifiedAt: Int64? = nil,
        range: String?, ifRange: String?, ifNoneMatch: String?, ifModifiedSince: String? = nil,
        ifMatch: String? = nil, ifUnmodifiedSince: String? = nil,
        maxRanges: Int = defaultMaxRanges
    ) -> RangeDecision {
        // RFC 9110 §13.2.2's order: the preconditions that can fail a request come first.
        if let ifMatch {
            if !matchMatches(ifMatch, etag: etag) { return .preconditionFailed }
        } else if let ifUnmodifiedSince, let modifiedAt, let since = HTTPDate.parse(ifUnmodifiedSince.trimmingWhitespace), modifiedAt > since {
            // Only without If-Match; a value that is no HTTP date is ignored (§13.1.4), where
            // nginx answers 412.
            return .preconditionFailed
        }
        if let ifNoneMatch {
            if noneMatchMatches(ifNoneMatch, etag: etag) { return .notModified }
        } else if let ifModifiedSince, let lastModified, ifModifiedSince.trimmingWhitespace == lastModified {
            // RFC 9110 §13.1.3, only without If-None-Match; the date must be the Last-Modified
            // sent, as nginx's default `if_modified_since exact` wants: a client echoes it.
            return .notModified
        }
        guard let range else { return .full }
        if let ifRange {
            let value = ifRange.trimmingWhitespace
            // Strong comparison: a weak tag (W/"...") never matches; a date must equal Last-Modified exactly.
            let matches = value.hasPrefix("\"") ? value == etag : (lastModified.map { value == $0 } ?? false)
            if !matches { return .full }
        }
        guard let specs = parse(range) else { return .full }
        if specs.count > maxRanges { return .full }
        var satisfiable: [ByteRange] = []
        satisfiable.reserveCapacity(specs.count)
        for spec in specs {
            switch spec {
            case .from(let first, let last):
                guard first < size else { continue }
                satisfiable.append(ByteRange(first: first, last: min(last ?? UInt64.max, size - 1)))
            case .suffix(let length):
                guard length > 0, size > 0 else { continue }
                satisfiable.append(ByteRange(first: size - min(length, size), last: size - 1))
            }
        }
        guard !satisfiable.isEmpty else { return .unsatisfiable }
        return .partial(coalesce(satisfiable))
    }

    enum Spec: Equatable {
        case from(UInt64, UInt64?)
        case suffix(UInt64)
    }

    /// Parses `bytes=...`; nil when the header is syntactically invalid or not in bytes, in which
    /// case it is ignored. Works on the string's UTF-8 bytes in place: it runs on every range
    /// request, and copying and splitting them cost more than the rest of the decision.
    static func parse(_ header: String) -> [Spec]? {
        var header = header
        return header.withUTF8 { parse(bytes: $0) }
    }

    private static func parse(bytes: UnsafeBufferPointer<UInt8>) -> [Spec]? {
        guard let equals = bytes.firstIndex(of: UInt8(ascii: "=")) else { return nil }
        let unit = trim(bytes[..<equals])
        guard equalsIgnoringCase(unit, "bytes") else { return nil }
        var specs: [Spec] = []
        var start = equals + 1
        while start <= bytes.count {
            let end = bytes[start...].firstIndex(of: UInt8(ascii: ",")) ?? bytes.count
            defer { start = end + 1 }
            let item = trim(bytes[start..<end])
            // RFC 9110 allows empty list elements ("bytes=0-1, ,5-6").
            if item.isEmpty { continue }
            guard let dash = item.firstIndex(of: UInt8(ascii: "-")) else { return nil }
            let left = item[..<dash], right = item[(dash + 1)...]
            if left.isEmpty {
                guard let length = number(right) else { return nil }
                specs.append(.suffix(length))
            } else {
                guard let first = number(left) else { return nil }
                if right.isEmpty {
                    specs.append(.from(first, nil))
                } else {
                    guard let last = number(right), last >= first else { return nil }
                    specs.append(.from(first, last))
                }
            }
        }
        return specs.isEmpty ? nil : specs
    }

    private typealias Bytes = Slice<UnsafeBufferPointer<UInt8>>

    private static func trim(_ bytes: Bytes) -> Bytes {
        var slice = bytes
        while let first = slice.first, first == 0x20 || first == 0x09 { slice = slice.dropFirst() }
        while let last = slice.last, last == 0x20 || last == 0x09 { slice = slice.dropLast() }
        return slice
    }

    /// Digits only; values too large for 64 bits saturate (a position past any file).
    private static func number(_ digits: Bytes) -> UInt64? {
        guard !digits.isEmpty, digits.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) else { return nil }
        var value: UInt64 = 0
        for digit in digits {
            let (times, overflow1) = value.multipliedReportingOverflow(by: 10)
            let (plus, overflow2) = times.addingReportingOverflow(UInt64(digit - 0x30))
            if overflow1 || overflow2 { return .max }
            value = plus
        }
        return value
    }

    /// Sorts ranges and merges those that overlap or touch.
    static func coalesce(_ ranges: [ByteRange]) -> [ByteRange] {
        if ranges.count < 2 { return ranges }
        let sorted = ranges.sorted { $0.first < $1.first }
        var merged: [ByteRange] = []
        for range in sorted {
            if let last = merged.last, range.first <= last.last &+ 1 {
                merged[merged.count - 1] = ByteRange(first: last.first, last: max(last.last, range.last))
            } else {
                merged.append(range)
            }
        }
        return merged
    }

    /// `If-Match` uses strong comparison: `W/"x"` never matches; `*` matches the representation,
    /// which exists (§13.1.1).
    private static func matchMatches(_ header: String, etag: String) -> Bool {
        for candidate in header.split(separator: ",") {
            let tag = candidate.trimmingWhitespace
            if tag == "*" || tag == etag { return true }
        }
        return false
    }

    /// `If-None-Match` uses weak comparison: `W/"x"` matches `"x"`; `*` matches anything.
    private static func noneMatchMatches(_ header: String, etag: String) -> Bool {
        for candidate in header.split(separator: ",") {
            var tag = candidate.trimmingWhitespace
            if tag == "*" { return true }
            if tag.hasPrefix("W/") { tag = tag.dropFirst(2) }
            if tag == etag { return true }
        }
        return false
    }
}

extension StringProtocol {
    var trimmingWhitespace: Substring {
        var s = self[...]
        while let f = s.first, f == " " || f == "\t" { s = s.dropFirst() }
        while let l = s.last, l == " " || l == "\t" { s = s.dropLast() }
        return Substring(s)
    }
}

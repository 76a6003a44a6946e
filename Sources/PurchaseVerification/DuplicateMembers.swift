/// Finds a member name that appears twice in one JSON object, at any depth.
///
/// RFC 8259 leaves duplicate names undefined and readers disagree: Foundation keeps the last,
/// others the first or refuse. A signed payload whose `bundleId` appears twice could then be read
/// one way by this server and another by the app or Apple's library, so it is refused (RFC 7515
/// §5.2 lets a JWS recipient refuse duplicate names, and asks it to for the header). No parser
/// the project can use reports duplicates (Foundation's `JSONSerialization` and `JSONDecoder`
/// both drop them silently), hence this scanner. It compares names after unescaping, so
/// `"bundleId"` and `"bundle\u0049d"` are the same name, and it stops at `maxDepth` nesting.
struct DuplicateMembers {
    enum Failure: Error, Equatable {
        /// The name that appears twice in one object.
        case duplicate(String)
        /// Not JSON, or nested deeper than `maxDepth`.
        case malformed
    }

    static let maxDepth = 64

    /// Throws `.duplicate` for the first repeated name, `.malformed` for input that is not JSON.
    static func check(_ bytes: some Collection<UInt8>) throws(Failure) {
        var scanner = DuplicateMembers(bytes: Array(bytes))
        scanner.skipSpace()
        try scanner.value(depth: 0)
        scanner.skipSpace()
        guard scanner.index == scanner.bytes.count else { throw .malformed }
    }

    private let bytes: [UInt8]
    private var index = 0

    private init(bytes: [UInt8]) {
        self.bytes = bytes
    }

    private var current: UInt8? { index < bytes.count ? bytes[index] : nil }

    private mutating func skipSpace() {
        while let byte = current, byte == 0x20 || byte == 0x09 || byte == 0x0A || byte == 0x0D { index += 1 }
    }

    private mutating func expect(_ byte: UInt8) throws(Failure) {
        guard current == byte else { throw .malformed }
        index += 1
    }

    private mutating func value(depth: Int) throws(Failure) {
        guard depth < Self.maxDepth, let byte = current else { throw .malformed }
        switch byte {
        case UInt8(ascii: "{"): try object(depth: depth + 1)
        case UInt8(ascii: "["): try array(depth: depth + 1)
        case UInt8(ascii: "\""): try skipString()
        case UInt8(ascii: "t"): try literal("true")
        case UInt8(ascii: "f"): try literal("false")
        case UInt8(ascii: "n"): try literal("null")
        default: try number()
        }
    }

    private mutating func object(depth: Int) throws(Failure) {
        try expect(UInt8(ascii: "{"))
        var names = Set<String>()
        try list(until: UInt8(ascii: "}")) { (scanner: inout DuplicateMembers) throws(Failure) in
            let name = try scanner.string()
            guard names.insert(name).inserted else { throw .duplicate(name) }
            scanner.skipSpace()
            try scanner.expect(UInt8(ascii: ":"))
            scanner.skipSpace()
            try scanner.value(depth: depth)
        }
    }

    private mutating func array(depth: Int) throws(Failure) {
        try expect(UInt8(ascii: "["))
        try list(until: UInt8(ascii: "]")) { (scanner: inout DuplicateMembers) throws(Failure) in try scanner.value(depth: depth) }
    }

    /// Elements separated by commas up to `close`, which ends the list; the opening bracket is read.
    private mutating func list(until close: UInt8, _ element: (inout DuplicateMembers) throws(Failure) -> Void) throws(Failure) {
        skipSpace()
        if current == close {
            index += 1
            return
        }
        while true {
            skipSpace()
            try element(&self)
            skipSpace()
            if current == UInt8(ascii: ",") {
                index += 1
                continue
            }
            try expect(close)
            return
        }
    }

    /// Passes over a string value: only names need decoding, and values (the `x5c` certificates
    /// are most of a header) are skipped without building anything.
    private mutating func skipString() throws(Failure) {
        try expect(UInt8(ascii: "\""))
        while index < bytes.count {
            let byte = bytes[index]
            index += 1
            if byte == UInt8(ascii: "\"") { return }
            if byte < 0x20 { throw .malformed }
            if byte == UInt8(ascii: "\\") {
                guard index < bytes.count else { throw .malformed }
                let escaped = bytes[index]
                index += 1
                if escaped == UInt8(ascii: "u") {
                    _ = try unicodeEscape()
                } else if !Self.simpleEscapes.contains(escaped) {
                    throw .malformed
                }
            }
        }
        throw .malformed
    }

    private static let simpleEscapes: Set<UInt8> = Set("\"\\/bfnrt".utf8)

    /// A name, unescaped (names are compared as text, not as their spelling).
    private mutating func string() throws(Failure) -> String {
        // Most names have no escapes: one validated copy of their bytes.
        if current == UInt8(ascii: "\"") {
            var end = index + 1
            while end < bytes.count, bytes[end] != UInt8(ascii: "\""), bytes[end] != UInt8(ascii: "\\"), bytes[end] >= 0x20 { end += 1 }
            if end < bytes.count, bytes[end] == UInt8(ascii: "\"") {
                guard let name = String(validating: bytes[(index + 1)..<end], as: UTF8.self) else { throw .malformed }
                index = end + 1
                return name
            }
        }
        try expect(UInt8(ascii: "\""))
        var scalars = String.UnicodeScalarView()
        var raw: [UInt8] = []
        func flush() throws(Failure) {
            guard !raw.isEmpty else { return }
            guard let text = String(validating: raw, as: UTF8.self) else { throw .malformed }
            scalars.append(contentsOf: text.unicodeScalars)
            raw.removeAll(keepingCapacity: true)
        }
        while let byte = current {
            index += 1
            switch byte {
            case UInt8(ascii: "\""):
                try flush()
                return String(scalars)
            case UInt8(ascii: "\\"):
                try flush()
                guard let escaped = current else { throw .malformed }
                index += 1
                switch escaped {
                case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): scalars.append(Unicode.Scalar(escaped))
                case UInt8(ascii: "b"): scalars.append("\u{8}")
                case UInt8(ascii: "f"): scalars.append("\u{C}")
                case UInt8(ascii: "n"): scalars.append("\n")
                case UInt8(ascii: "r"): scalars.append("\r")
                case UInt8(ascii: "t"): scalars.append("\t")
                case UInt8(ascii: "u"): scalars.append(try unicodeEscape())
                default: throw .malformed
                }
            case 0x00..<0x20:
                throw .malformed
            default:
                raw.append(byte)
            }
        }
        throw .malformed
    }

    /// The scalar of `\uXXXX`, or of a surrogate pair `\uD83D\uDE00`; the `\u` is already read.
    private mutating func unicodeEscape() throws(Failure) -> Unicode.Scalar {
        let first = try hex4()
        if (0xD800..<0xDC00).contains(first) {
            guard current == UInt8(ascii: "\\"), index + 1 < bytes.count, bytes[index + 1] == UInt8(ascii: "u") else { throw .malformed }
            index += 2
            let second = try hex4()
            guard (0xDC00..<0xE000).contains(second),
                let scalar = Unicode.Scalar(0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00))
            else { throw .malformed }
            return scalar
        }
        guard let scalar = Unicode.Scalar(first) else { throw .malformed }
        return scalar
    }

    private mutating func hex4() throws(Failure) -> UInt32 {
        guard index + 4 <= bytes.count else { throw .malformed }
        var value: UInt32 = 0
        for _ in 0..<4 {
            let byte = bytes[index]
            let digit: UInt8
            switch byte {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): digit = byte - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): digit = byte - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): digit = byte - UInt8(ascii: "A") + 10
            default: throw .malformed
            }
            value = value << 4 | UInt32(digit)
            index += 1
        }
        return value
    }

    private mutating func literal(_ word: StaticString) throws(Failure) {
        let count = word.utf8CodeUnitCount
        guard index + count <= bytes.count else { throw .malformed }
        let matches = word.withUTF8Buffer { expected in bytes[index..<(index + count)].elementsEqual(expected) }
        guard matches else { throw .malformed }
        index += count
    }

    /// RFC 8259 §6: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
    private mutating func number() throws(Failure) {
        func digits() throws(Failure) {
            let start = index
            while let byte = current, byte >= UInt8(ascii: "0"), byte <= UInt8(ascii: "9") { index += 1 }
            guard index > start else { throw .malformed }
        }
        if current == UInt8(ascii: "-") { index += 1 }
        if current == UInt8(ascii: "0") {
            index += 1
        } else {
            try digits()
        }
        if current == UInt8(ascii: ".") {
            index += 1
            try digits()
        }
        if current == UInt8(ascii: "e") || current == UInt8(ascii: "E") {
            index += 1
            if current == UInt8(ascii: "+") || current == UInt8(ascii: "-") { index += 1 }
            try digits()
        }
    }
}

/// Reads a manifest's JSON straight into ``ArchiveManifest``, without `JSONDecoder`.
///
/// Why by hand: `JSONDecoder` took about 0.1 s (and as much CPU again in allocations) for a
/// manifest of 5,000 entries, a seventh of an incremental build of a 1 GiB product and most of a
/// small delta update's planning. This reader accepts any valid JSON (keys in any order,
/// whitespace, unknown keys skipped), but stops at anything it does not expect instead of
/// explaining it: ``ArchiveManifest/decode(_:source:)`` then asks `JSONDecoder`, whose error names
/// the problem. Tests and the fuzzer (`tools/fuzz.sh manifest`) hold the two to the same result
/// wherever this reader accepts.
///
/// Stricter than `JSONDecoder` in two ways that matter for hostile manifests: a key given twice
/// in one object is refused (readers that keep the first and readers that keep the last would
/// see different entries), and values nest at most ``maximumDepth`` deep (each level is a frame
/// of recursion, and a manifest may be 64 MiB).
struct ManifestReader {
    enum Outcome: Equatable {
        case manifest(ArchiveManifest)
        /// The key given twice in one object.
        case duplicateKey(String)
        /// Not a manifest in a form this reader takes.
        case unexpected
    }

    static let maximumDepth = 32

    private let bytes: UnsafeRawBufferPointer
    private var at = 0
    private var depth = 0
    private var duplicate: String?

    static func parse(_ data: UnsafeRawBufferPointer) -> Outcome {
        var reader = ManifestReader(bytes: data)
        let manifest = reader.manifest()
        if let duplicate = reader.duplicate { return .duplicateKey(duplicate) }
        guard let manifest else { return .unexpected }
        reader.skipSpace()
        return reader.at == data.count ? .manifest(manifest) : .unexpected
    }

    static func read(_ data: UnsafeRawBufferPointer) -> ArchiveManifest? {
        guard case .manifest(let manifest) = parse(data) else { return nil }
        return manifest
    }

    private init(bytes: UnsafeRawBufferPointer) { self.bytes = bytes }

    private mutating func manifest() -> ArchiveManifest? {
        var formatVersion: Int?
        var productId: ProductIdentifier?
        var contentVersion: ContentVersion?
        var archiveName: String?
        var archiveSize: UInt64?
        var archiveSHA256: String?
        var contentLength: UInt64?
        var createdAt: String?
        var entries: [ArchiveManifest.Entry]?
        var chunkSize: UInt64?
        var encoder: String?
        let complete = object { reader, key in
            switch key {
            case "formatVersion": return store(&formatVersion, reader.integer().flatMap { Int(exactly: $0) })
            case "productId": return store(&productId, reader.string().flatMap { try? ProductIdentifier($0) })
            case "contentVersion": return store(&contentVersion, reader.string().flatMap { try? ContentVersion($0) })
            case "archiveName": return store(&archiveName, reader.string())
            case "archiveSize": return store(&archiveSize, reader.unsigned())
            case "archiveSHA256": return store(&archiveSHA256, reader.string())
            case "contentLength": return store(&contentLength, reader.unsigned())
            case "createdAt": return store(&createdAt, reader.string())
            case "chunkSize":
                return reader.optional {
                    chunkSize = $0.unsigned(); return chunkSize != nil
                }
            case "encoder":
                return reader.optional {
                    encoder = $0.string(); return encoder != nil
                }
            case "entries":
                var list: [ArchiveManifest.Entry] = []
                let ok = reader.array { reader in
                    guard let entry = reader.entry() else { return false }
                    list.append(entry)
                    return true
                }
                entries = list
                return ok
            default: return reader.skipValue()
            }
        }
        guard complete, let formatVersion, let productId, let contentVersion, let archiveName, let archiveSize, let archiveSHA256,
            let contentLength, let createdAt, let entries
        else { return nil }
        return ArchiveManifest(
            formatVersion: formatVersion, productId: productId, contentVersion: contentVersion, archiveName: archiveName,
            archiveSize: archiveSize, archiveSHA256: archiveSHA256, contentLength: contentLength, createdAt: createdAt,
            entries: entries, chunkSize: chunkSize, encoder: encoder)
    }

    private mutating func entry() -> ArchiveManifest.Entry? {
        var path: String?
        var kind: ArchiveManifest.Entry.Kind?
        var method: ArchiveManifest.Entry.Method?
        var uncompressedSize: UInt64?
        var compressedSize: UInt64?
        var crc32: UInt32?
        var sha256: String?
        var localHeaderOffset: UInt64?
        var dataOffset: UInt64?
        var chunks: [String]?
        var level: Int?
        var storedCRC32: UInt32?
        let complete = object { reader, key in
            switch key {
            case "path": return store(&path, reader.string())
            case "kind": return store(&kind, reader.string().flatMap(ArchiveManifest.Entry.Kind.init(rawValue:)))
            case "method": return store(&method, reader.string().flatMap(ArchiveManifest.Entry.Method.init(rawValue:)))
            case "uncompressedSize": return store(&uncompressedSize, reader.unsigned())
            case "compressedSize": return store(&compressedSize, reader.unsigned())
            case "crc32": return store(&crc32, reader.unsigned().flatMap { UInt32(exactly: $0) })
            case "sha256": return store(&sha256, reader.string())
            case "localHeaderOffset": return store(&localHeaderOffset, reader.unsigned())
            case "dataOffset": return store(&dataOffset, reader.unsigned())
            case "level":
                return reader.optional {
                    level = $0.integer().flatMap { Int(exactly: $0) }; return level != nil
                }
            case "storedCRC32":
                return reader.optional {
                    storedCRC32 = $0.unsigned().flatMap { UInt32(exactly: $0) }; return storedCRC32 != nil
                }
            case "chunks":
                return reader.optional { reader in
                    var list: [String] = []
                    let ok = reader.array { reader in
                        guard let chunk = reader.string() else { return false }
                        list.append(chunk)
                        return true
                    }
                    chunks = list
                    return ok
                }
            default: return reader.skipValue()
            }
        }
        guard complete, let path, let kind, let method, let uncompressedSize, let compressedSize, let crc32, let sha256,
            let localHeaderOffset, let dataOffset
        else { return nil }
        return ArchiveManifest.Entry(
            path: path, kind: kind, method: method, uncompressedSize: uncompressedSize, compressedSize: compressedSize,
            crc32: crc32, sha256: sha256, localHeaderOffset: localHeaderOffset, dataOffset: dataOffset, chunks: chunks,
            level: level, storedCRC32: storedCRC32)
    }

    // MARK: JSON

    private mutating func skipSpace() {
        while at < bytes.count, bytes[at] == 0x20 || bytes[at] == 0x0A || bytes[at] == 0x0D || bytes[at] == 0x09 { at += 1 }
    }

    /// Consumes `byte` after any whitespace.
    private mutating func take(_ byte: UInt8) -> Bool {
        skipSpace()
        guard at < bytes.count, bytes[at] == byte else { return false }
        at += 1
        return true
    }

    private mutating func literal(_ word: StaticString) -> Bool {
        skipSpace()
        let count = word.utf8CodeUnitCount
        guard at + count <= bytes.count else { return false }
        for index in 0..<count where bytes[at + index] != word.utf8Start[index] { return false }
        at += count
        return true
    }

    /// `null` (leaving the field absent, as `decodeIfPresent` does) or what `value` reads.
    private mutating func optional(_ value: (inout ManifestReader) -> Bool) -> Bool {
        literal("null") || value(&self)
    }

    /// An object: `member` reads the value of each key and says whether it could.
    private mutating func object(_ member: (inout ManifestReader, String) -> Bool) -> Bool {
        guard depth < Self.maximumDepth, take(UInt8(ascii: "{")) else { return false }
        if take(UInt8(ascii: "}")) { return true }
        depth += 1
        defer { depth -= 1 }
        // A manifest's objects have a dozen keys: a linear search costs less than hashing them.
        var keys: [String] = []
        keys.reserveCapacity(16)
        repeat {
            guard let key = string(), take(UInt8(ascii: ":")) else { return false }
            guard !keys.contains(key) else {
                duplicate = key
                return false
            }
            keys.append(key)
            guard member(&self, key) else { return false }
        } while take(UInt8(ascii: ","))
        return take(UInt8(ascii: "}"))
    }

    private mutating func array(_ element: (inout ManifestReader) -> Bool) -> Bool {
        guard depth < Self.maximumDepth, take(UInt8(ascii: "[")) else { return false }
        if take(UInt8(ascii: "]")) { return true }
        depth += 1
        defer { depth -= 1 }
        repeat {
            guard element(&self) else { return false }
        } while take(UInt8(ascii: ","))
        return take(UInt8(ascii: "]"))
    }

    private mutating func string() -> String? {
        guard take(UInt8(ascii: "\"")) else { return nil }
        let start = at
        // Without escapes (every string iap-pack writes but odd file names), a slice of the input.
        var high: UInt8 = 0
        while at < bytes.count, bytes[at] != UInt8(ascii: "\""), bytes[at] != UInt8(ascii: "\\"), bytes[at] >= 0x20 {
            high |= bytes[at]
            at += 1
        }
        guard at < bytes.count else { return nil }
        if bytes[at] == UInt8(ascii: "\"") {
            at += 1
            let slice = UnsafeRawBufferPointer(rebasing: bytes[start..<at - 1])
            // ASCII (every digest, and most paths) is valid UTF-8 as it is: the generic validating
            // initializer was more than half of reading a 5,000-entry manifest (perf).
            if high < 0x80 { return String(decoding: slice.assumingMemoryBound(to: UInt8.self), as: UTF8.self) }
            return String(validating: slice, as: UTF8.self)
        }
        var utf8 = Array(bytes[start..<at])
        while at < bytes.count {
            let byte = bytes[at]
            at += 1
            switch byte {
            case UInt8(ascii: "\""): return String(validating: utf8, as: UTF8.self)
            case 0..<0x20: return nil
            case UInt8(ascii: "\\"):
                guard at < bytes.count else { return nil }
                let escape = bytes[at]
                at += 1
                switch escape {
                case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): utf8.append(escape)
                case UInt8(ascii: "b"): utf8.append(0x08)
                case UInt8(ascii: "f"): utf8.append(0x0C)
                case UInt8(ascii: "n"): utf8.append(0x0A)
                case UInt8(ascii: "r"): utf8.append(0x0D)
                case UInt8(ascii: "t"): utf8.append(0x09)
                case UInt8(ascii: "u"):
                    guard var scalar = hex4() else { return nil }
                    if (0xD800..<0xDC00).contains(scalar) {
                        guard literal("\\u"), let low = hex4(), (0xDC00..<0xE000).contains(low) else { return nil }
                        scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
                    }
                    guard let character = Unicode.Scalar(scalar) else { return nil }
                    utf8.append(contentsOf: String(character).utf8)
                default: return nil
                }
            default: utf8.append(byte)
            }
        }
        return nil
    }

    private mutating func hex4() -> UInt32? {
        guard at + 4 <= bytes.count else { return nil }
        var value: UInt32 = 0
        for _ in 0..<4 {
            let byte = bytes[at]
            at += 1
            let digit: UInt8
            switch byte {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): digit = byte - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): digit = byte - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): digit = byte - UInt8(ascii: "A") + 10
            default: return nil
            }
            value = value << 4 | UInt32(digit)
        }
        return value
    }

    /// A non-negative integer written as digits only (JSON's other number forms give nil, and
    /// `JSONDecoder` then decides).
    private mutating func unsigned() -> UInt64? {
        skipSpace()
        let start = at
        var value: UInt64 = 0
        while at < bytes.count, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(bytes[at]) {
            let (times10, overflow) = value.multipliedReportingOverflow(by: 10)
            let (sum, carry) = times10.addingReportingOverflow(UInt64(bytes[at] - UInt8(ascii: "0")))
            guard !overflow, !carry else { return nil }
            value = sum
            at += 1
        }
        guard at > start, at - start == 1 || bytes[start] != UInt8(ascii: "0") else { return nil }
        if at < bytes.count, [UInt8(ascii: "."), UInt8(ascii: "e"), UInt8(ascii: "E")].contains(bytes[at]) { return nil }
        return value
    }

    private mutating func integer() -> Int64? {
        let negative = take(UInt8(ascii: "-"))
        guard let magnitude = unsigned() else { return nil }
        return negative ? (magnitude <= UInt64(Int64.max) + 1 ? Int64(truncatingIfNeeded: 0 &- magnitude) : nil) : Int64(exactly: magnitude)
    }

    /// Skips any JSON value (an unknown key's).
    private mutating func skipValue() -> Bool {
        skipSpace()
        guard at < bytes.count else { return false }
        switch bytes[at] {
        case UInt8(ascii: "{"): return object { reader, _ in reader.skipValue() }
        case UInt8(ascii: "["): return array { $0.skipValue() }
        case UInt8(ascii: "\""): return string() != nil
        case UInt8(ascii: "t"): return literal("true")
        case UInt8(ascii: "f"): return literal("false")
        case UInt8(ascii: "n"): return literal("null")
        default:
            // A number, by JSON's grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
            func digits(_ reader: inout ManifestReader) -> Int {
                let start = reader.at
                while reader.at < reader.bytes.count, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(reader.bytes[reader.at]) {
                    reader.at += 1
                }
                return reader.at - start
            }
            if bytes[at] == UInt8(ascii: "-") { at += 1 }
            let start = at
            let integer = digits(&self)
            guard integer > 0, integer == 1 || bytes[start] != UInt8(ascii: "0") else { return false }
            if at < bytes.count, bytes[at] == UInt8(ascii: ".") {
                at += 1
                guard digits(&self) > 0 else { return false }
            }
            if at < bytes.count, bytes[at] == UInt8(ascii: "e") || bytes[at] == UInt8(ascii: "E") {
                at += 1
                if at < bytes.count, bytes[at] == UInt8(ascii: "+") || bytes[at] == UInt8(ascii: "-") { at += 1 }
                guard digits(&self) > 0 else { return false }
            }
            return true
        }
    }
}

/// Keeps a field's value; whether there was one to keep.
private func store<T>(_ field: inout T?, _ value: T?) -> Bool {
    field = value
    return value != nil
}

import DurableFiles
import Foundation
import IAPProtocol

/// The JSON manifest written beside every archive (`<id>-<version>.manifest.json`).
///
/// Per-entry offsets and hashes let a client fetch only the entries that changed between two
/// versions with range requests: an entry's bytes are `dataOffset ..< dataOffset + compressedSize`,
/// and `chunks` verifies each `chunkSize` piece of them as it arrives (format 2).
///
/// Format 2 adds `chunkSize`, each entry's `chunks`, and what the packer used (`encoder`, each
/// entry's `level`), which `iap-pack build --previous` needs to reuse compressed bytes. Readers
/// accept format 1, which lacks them.
public struct ArchiveManifest: Codable, Sendable, Equatable {
    /// Raised when the meaning of a field changes.
    public static let currentFormatVersion = 2
    /// The piece of an entry's stored bytes that one hash in `chunks` covers: 1 MiB, small
    /// enough that a damaged range costs little to fetch again, large enough that a 2 GiB
    /// archive's manifest stays near 130 KiB of hashes.
    public static let standardChunkSize: UInt64 = 1 << 20

    public struct Entry: Codable, Sendable, Equatable {
        public enum Kind: String, Codable, Sendable { case file, directory }
        public enum Method: String, Codable, Sendable { case stored, deflate }

        /// The path inside the archive; folders end in `/`.
        public var path: String
        public var kind: Kind
        public var method: Method
        public var uncompressedSize: UInt64
        public var compressedSize: UInt64
        /// CRC-32 of the uncompressed bytes, as the ZIP headers hold it.
        public var crc32: UInt32
        /// SHA-256 of the uncompressed bytes, lowercase hex.
        public var sha256: String
        /// Offset of the entry's local header in the archive.
        public var localHeaderOffset: UInt64
        /// Offset of the entry's (compressed) data in the archive.
        public var dataOffset: UInt64
        /// SHA-256 of each `chunkSize` piece of the entry's stored (compressed) bytes, the last
        /// piece shorter; empty for an empty entry. Absent in format 1.
        public var chunks: [String]?
        /// The compression level the packer planned for this file (0 when storing); absent when
        /// the manifest was computed from an archive, which does not record it.
        public var level: Int?
        /// CRC-32 of the entry's stored (compressed) bytes, the same as `crc32` for a stored entry.
        /// `iap-pack build --previous` checks the bytes it copies from the previous archive by it,
        /// many times faster than by `chunks`. Absent in manifests written before it was added.
        public var storedCRC32: UInt32?

        public init(
            path: String, kind: Kind, method: Method, uncompressedSize: UInt64, compressedSize: UInt64, crc32: UInt32,
            sha256: String, localHeaderOffset: UInt64, dataOffset: UInt64, chunks: [String]? = nil, level: Int? = nil,
            storedCRC32: UInt32? = nil
        ) {
            self.path = path
            self.kind = kind
            self.method = method
            self.uncompressedSize = uncompressedSize
            self.compressedSize = compressedSize
            self.crc32 = crc32
            self.sha256 = sha256
            self.localHeaderOffset = localHeaderOffset
            self.dataOffset = dataOffset
            self.chunks = chunks
            self.level = level
            self.storedCRC32 = storedCRC32
        }

        /// The entry as the archive alone shows it: without what only the packer knew.
        public var derivable: Entry {
            var copy = self
            copy.level = nil
            return copy
        }
    }

    public var formatVersion: Int
    public var productId: ProductIdentifier
    public var contentVersion: ContentVersion
    /// The archive's file name, without a folder.
    public var archiveName: String
    public var archiveSize: UInt64
    /// SHA-256 of the whole archive, lowercase hex. Servers use it as the strong ETag.
    public var archiveSHA256: String
    /// Sum of the uncompressed sizes: what the installed content takes on disk.
    public var contentLength: UInt64
    /// ISO 8601; `SOURCE_DATE_EPOCH` or 1980-01-01T00:00:00Z, so that manifests are reproducible.
    public var createdAt: String
    public var entries: [Entry]
    /// The size of the pieces `chunks` hashes (format 2).
    public var chunkSize: UInt64?
    /// The compressor and how files were cut for it, e.g. `libdeflate 1.14; whole<=25165824; chunk=4194304`:
    /// compressed bytes are reused from a previous archive only when this is the same.
    public var encoder: String?

    public init(
        formatVersion: Int = currentFormatVersion, productId: ProductIdentifier, contentVersion: ContentVersion, archiveName: String,
        archiveSize: UInt64, archiveSHA256: String, contentLength: UInt64, createdAt: String, entries: [Entry],
        chunkSize: UInt64? = standardChunkSize, encoder: String? = nil
    ) {
        self.formatVersion = formatVersion
        self.productId = productId
        self.contentVersion = contentVersion
        self.archiveName = archiveName
        self.archiveSize = archiveSize
        self.archiveSHA256 = archiveSHA256
        self.contentLength = contentLength
        self.createdAt = createdAt
        self.entries = entries
        self.chunkSize = chunkSize
        self.encoder = encoder
    }

    /// The manifest's canonical JSON: sorted keys, so the same archive always gives the same bytes.
    public func jsonData() -> Data { Data(canonicalJSON()) }

    /// Puts `digest` (64 hex digits) in place of the `archiveSHA256` of `json`, the canonical JSON
    /// of a manifest, so the rest can be rendered before the archive's hash is known. The value
    /// follows the first `"archiveSHA256" : "`: only the top-level key can be spelled so, since
    /// the strings before it are escaped and cannot hold an unescaped quote.
    static func replaceArchiveDigest(in json: inout [UInt8], with digest: String) {
        guard digest.utf8.count == 64, let key = json.firstRange(of: Array(#""archiveSHA256" : ""#.utf8)),
            json.count >= key.upperBound + 64
        else { return }
        json.replaceSubrange(key.upperBound..<key.upperBound + 64, with: digest.utf8)
    }

    /// The canonical JSON, byte for byte what `JSONEncoder` writes with `.prettyPrinted`,
    /// `.sortedKeys` and `.withoutEscapingSlashes` (a test holds the two together), plus a newline.
    ///
    /// Written by hand because the encoder took 85 ms for a manifest of 5,000 entries, more than a
    /// tenth of an incremental build's budget; the structure is fixed, so the writer is short.
    func canonicalJSON() -> [UInt8] {
        var out = CanonicalJSONWriter()
        out.open("{")
        out.field("archiveName", archiveName, indent: 1)
        out.field("archiveSHA256", archiveSHA256, indent: 1)
        out.field("archiveSize", archiveSize, indent: 1)
        if let chunkSize {
            out.field("chunkSize", chunkSize, indent: 1)
        }
        out.field("contentLength", contentLength, indent: 1)
        out.field("contentVersion", contentVersion.string, indent: 1)
        out.field("createdAt", createdAt, indent: 1)
        if let encoder {
            out.field("encoder", encoder, indent: 1)
        }
        out.key("entries", indent: 1)
        out.array(entries, indent: 1) { out, entry in
            out.open("{")
            if let chunks = entry.chunks {
                out.key("chunks", indent: 3)
                out.array(chunks, indent: 3) { out, chunk in out.string(chunk) }
            }
            out.field("compressedSize", entry.compressedSize, indent: 3)
            out.field("crc32", UInt64(entry.crc32), indent: 3)
            out.field("dataOffset", entry.dataOffset, indent: 3)
            out.field("kind", entry.kind.rawValue, indent: 3)
            if let level = entry.level {
                out.field("level", Int64(level), indent: 3)
            }
            out.field("localHeaderOffset", entry.localHeaderOffset, indent: 3)
            out.field("method", entry.method.rawValue, indent: 3)
            out.field("path", entry.path, indent: 3)
            out.field("sha256", entry.sha256, indent: 3)
            if let storedCRC32 = entry.storedCRC32 {
                out.field("storedCRC32", UInt64(storedCRC32), indent: 3)
            }
            out.field("uncompressedSize", entry.uncompressedSize, indent: 3)
            out.close("}", indent: 2)
        }
        out.field("formatVersion", Int64(formatVersion), indent: 1)
        out.field("productId", productId.rawValue, indent: 1)
        out.close("}", indent: 0)
        out.bytes.append(UInt8(ascii: "\n"))
        return out.bytes
    }

    /// Decodes a manifest, naming the file in the error.
    public static func decode(_ data: Data, source: String) throws(ArchiveError) -> ArchiveManifest {
        let manifest: ArchiveManifest
        switch data.withUnsafeBytes(ManifestReader.parse) {
        case .manifest(let read):
            manifest = read
        case .duplicateKey(let key):
            throw .corrupt(
                "\(source) gives \"\(key)\" twice in one object: refusing it (one reader would take the first and another the last); build the archive again with iap-pack"
            )
        case .unexpected:
            // The reader above decides; JSONDecoder only says what is wrong, in its words.
            let why: String
            do {
                _ = try JSONDecoder().decode(ArchiveManifest.self, from: data)
                why = "numbers must be plain integers, and values nest at most \(ManifestReader.maximumDepth) deep"
            } catch let error as DecodingError {
                why = error.plainDescription
            } catch {
                why = "\(error)"
            }
            throw .corrupt("\(source) is not a valid archive manifest (\(why)): build the archive again with iap-pack to get a matching manifest")
        }
        guard (1...currentFormatVersion).contains(manifest.formatVersion) else {
            throw .corrupt("\(source) is manifest format \(manifest.formatVersion); this tool reads formats 1 to \(currentFormatVersion): update it")
        }
        // A content archive is a ZIP without ZIP64, so every offset and size fits in 32 bits.
        // Checked once here, so that the sums and products readers make of these numbers
        // (an entry's end, its chunk count, the zip-bomb ratio) cannot overflow, whatever a
        // hostile manifest claims.
        let limit = UInt64(UInt32.max)
        guard manifest.archiveSize <= limit else {
            throw .corrupt("\(source) claims an archive of \(manifest.archiveSize) bytes; content archives are ZIP files under 4 GiB: it is not a manifest iap-pack wrote")
        }
        for entry in manifest.entries {
            guard entry.uncompressedSize <= limit, entry.compressedSize <= manifest.archiveSize,
                entry.localHeaderOffset <= manifest.archiveSize, entry.dataOffset <= manifest.archiveSize
            else {
                throw .corrupt(
                    "\(source) places '\(entry.path)' outside its \(manifest.archiveSize)-byte archive or gives it a size no ZIP entry has: it is damaged or forged; build the archive again with iap-pack"
                )
            }
        }
        if manifest.formatVersion >= 2 {
            guard let size = manifest.chunkSize, size >= 4096, size <= 1 << 30 else {
                throw .corrupt("\(source) gives no usable chunkSize (format 2 needs 4 KiB to 1 GiB): build the archive again with iap-pack")
            }
            for entry in manifest.entries {
                let expected = Int((entry.compressedSize + size - 1) / size)
                guard let chunks = entry.chunks, chunks.count == expected,
                    chunks.allSatisfy({ Hex.isSHA256($0.utf8) })
                else {
                    throw .corrupt("\(source) lists \(entry.chunks?.count ?? 0) chunk hashes for '\(entry.path)', which needs \(expected): build the archive again with iap-pack")
                }
            }
        }
        return manifest
    }

    /// Reads and decodes a manifest file (at most 64 MiB).
    public static func load(path: String) throws(ArchiveError) -> ArchiveManifest {
        try decode(Data(try ContentScanner.readManifest(path)), source: path)
    }

    /// The file name an archive gets: `<id>-<version>.zip`.
    public static func archiveName(productId: ProductIdentifier, version: ContentVersion) -> String {
        "\(productId.rawValue)-\(version.string).zip"
    }

    /// The file name a manifest gets: `<id>-<version>.manifest.json`.
    public static func manifestName(productId: ProductIdentifier, version: ContentVersion) -> String {
        "\(productId.rawValue)-\(version.string).manifest.json"
    }
}

/// The pieces of `JSONEncoder`'s pretty-printed output: two spaces per level, `"key" : value`,
/// members separated by `,` and a newline, an empty array as `[`, an empty line and `]`.
struct CanonicalJSONWriter {
    var bytes: [UInt8] = []
    /// Whether the next key is the first of its object.
    private var first = true

    init() { bytes.reserveCapacity(1 << 20) }

    mutating func open(_ bracket: Character) {
        bytes.append(UInt8(ascii: bracket.unicodeScalars.first!))
        first = true
    }

    mutating func close(_ bracket: Character, indent: Int) {
        newline(indent: indent)
        bytes.append(UInt8(ascii: bracket.unicodeScalars.first!))
        first = false
    }

    mutating func key(_ name: String, indent: Int) {
        if !first { bytes.append(UInt8(ascii: ",")) }
        first = false
        newline(indent: indent)
        string(name)
        bytes.append(contentsOf: " : ".utf8)
    }

    mutating func field(_ name: String, _ value: String, indent: Int) {
        key(name, indent: indent)
        string(value)
    }

    mutating func field(_ name: String, _ value: UInt64, indent: Int) {
        key(name, indent: indent)
        number(value)
    }

    mutating func field(_ name: String, _ value: Int64, indent: Int) {
        key(name, indent: indent)
        number(value)
    }

    mutating func array<T>(_ items: [T], indent: Int, _ element: (inout CanonicalJSONWriter, T) -> Void) {
        bytes.append(UInt8(ascii: "["))
        if items.isEmpty { bytes.append(UInt8(ascii: "\n")) }
        for (index, item) in items.enumerated() {
            if index > 0 { bytes.append(UInt8(ascii: ",")) }
            newline(indent: indent + 1)
            element(&self, item)
        }
        newline(indent: indent)
        bytes.append(UInt8(ascii: "]"))
        first = false
    }

    mutating func newline(indent: Int) {
        bytes.append(UInt8(ascii: "\n"))
        bytes.append(contentsOf: repeatElement(UInt8(ascii: " "), count: 2 * indent))
    }

    mutating func number(_ value: UInt64) { bytes.append(contentsOf: String(value).utf8) }
    mutating func number(_ value: Int64) { bytes.append(contentsOf: String(value).utf8) }

    /// A string as `JSONEncoder` escapes it: quote and backslash, the short escapes, other
    /// control characters as `\u00xx`; everything else (slashes included) as UTF-8.
    mutating func string(_ value: String) {
        bytes.append(UInt8(ascii: "\""))
        // Paths and digests almost never need escaping: copied whole rather than byte by byte
        // (the walk was more than half of writing a 5,000-entry manifest; perf).
        if value.utf8.allSatisfy({ $0 >= 0x20 && $0 != UInt8(ascii: "\"") && $0 != UInt8(ascii: "\\") }) {
            bytes.append(contentsOf: value.utf8)
            bytes.append(UInt8(ascii: "\""))
            return
        }
        for byte in value.utf8 {
            switch byte {
            case UInt8(ascii: "\""): bytes.append(contentsOf: #"\""#.utf8)
            case UInt8(ascii: "\\"): bytes.append(contentsOf: #"\\"#.utf8)
            case 0x08: bytes.append(contentsOf: #"\b"#.utf8)
            case 0x09: bytes.append(contentsOf: #"\t"#.utf8)
            case 0x0A: bytes.append(contentsOf: #"\n"#.utf8)
            case 0x0C: bytes.append(contentsOf: #"\f"#.utf8)
            case 0x0D: bytes.append(contentsOf: #"\r"#.utf8)
            case 0..<0x20:
                let hex = Array("0123456789abcdef".utf8)
                bytes.append(contentsOf: #"\u00"#.utf8)
                bytes.append(hex[Int(byte >> 4)])
                bytes.append(hex[Int(byte & 0xF)])
            default: bytes.append(byte)
            }
        }
        bytes.append(UInt8(ascii: "\""))
    }
}

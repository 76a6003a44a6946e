import Foundation

/// The JSON manifest written beside every archive (`<id>-<version>.manifest.json`).
///
/// Per-entry offsets and hashes let a client fetch only the entries that changed between two
/// versions with range requests: an entry's bytes are `dataOffset ..< dataOffset + compressedSize`.
public struct ArchiveManifest: Codable, Sendable, Equatable {
    /// Raised when the meaning of a field changes.
    public static let currentFormatVersion = 1

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

    /// The manifest's canonical JSON: sorted keys, so the same archive always gives the same bytes.
    public func jsonData() -> Data {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        // Encoding plain strings and integers cannot fail.
        return (try! encoder.encode(self)) + Data("\n".utf8)
    }

    /// Decodes a manifest, naming the file in the error.
    public static func decode(_ data: Data, source: String) throws(ArchiveError) -> ArchiveManifest {
        do {
            return try JSONDecoder().decode(ArchiveManifest.self, from: data)
        } catch {
            throw .corrupt("\(source) is not a valid archive manifest (\(error)): build the archive again with iap-pack to get a matching manifest")
        }
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

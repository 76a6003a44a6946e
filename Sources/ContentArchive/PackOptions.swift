import Foundation

/// Size limits of the format.
public enum ArchiveLimits {
    /// 2 GiB: the most a product's archive may weigh, as Apple's hosted content allowed
    /// (read as 2,147,483,648 bytes).
    public static let maxArchiveSize: UInt64 = 2_147_483_648
}

/// How to pack a content folder.
public struct PackOptions: Sendable {
    /// Required for a plain folder; optional (and checked) for an Xcode content folder.
    public var productId: ProductIdentifier?
    public var contentVersion: ContentVersion?
    /// Where the archive and manifest go; created if missing.
    public var outputDirectory: String
    /// 0 stores every entry. 1 to 9 aim at `zip -<level>`'s size for the whole archive at the
    /// least CPU: each kind of file (extension) gets a libdeflate level from 1 to `level`, chosen
    /// from samples so that the kinds together come out no larger than zlib at `level` would
    /// make them (``LevelBudget``). 10 to 12 are libdeflate's slow near-optimal levels.
    public var level: Int
    /// The largest archive allowed, in bytes.
    public var sizeCap: UInt64
    public var timestamp: ArchiveTimestamp
    /// Compression threads; the output does not depend on it.
    public var threads: Int
    /// A previous build of the product (its archive, or the manifest iap-pack wrote beside it):
    /// files whose bytes are unchanged take their compressed bytes from it instead of being
    /// compressed again. The output is the same as without it.
    public var previous: String?
    /// Whether the archive and manifest are synced to disk before they are renamed into place,
    /// so that a power cut leaves either nothing or both whole. Without it (`--no-sync`), a
    /// pipeline that can build again saves the wait for the disk: for an incremental build,
    /// which compresses little, that wait is most of the time.
    public var sync = true
    /// How files are cut into pieces of work (tests make the pieces small).
    var chunking = Chunking.standard
    /// When the build counts as done for the ``HashCache`` (tests move it on instead of waiting).
    var hashCacheTime: Date?

    public init(
        productId: ProductIdentifier? = nil, contentVersion: ContentVersion? = nil,
        outputDirectory: String = ".", level: Int = 6,
        sizeCap: UInt64 = ArchiveLimits.maxArchiveSize, timestamp: ArchiveTimestamp = .standard,
        threads: Int = ProcessInfo.processInfo.activeProcessorCount
    ) {
        self.productId = productId
        self.contentVersion = contentVersion
        self.outputDirectory = outputDirectory
        self.level = level
        self.sizeCap = sizeCap
        self.timestamp = timestamp
        self.threads = threads
    }
}

/// What a pack produced.
public struct PackResult: Sendable {
    public let archivePath: String
    public let manifestPath: String
    public let manifest: ArchiveManifest
    /// Entries whose compressed bytes were copied from the previous archive, and their stored bytes.
    public var reusedEntries = 0
    public var reusedBytes: UInt64 = 0
    /// Temporary files that interrupted builds had left in the output folder, removed by this one.
    public var removedLeftovers: [String] = []
    /// What the content folder held that is never packed (`.DS_Store`, `.git` and the other names
    /// Xcode's copy phases leave out of bundles), as paths in the archive would be, sorted.
    public var leftOut: [String] = []
}

/// How far a pack has got, in uncompressed bytes.
public struct PackProgress: Sendable {
    public let bytesDone: UInt64
    public let bytesTotal: UInt64
}

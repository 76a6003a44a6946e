import Crypto
import DurableFiles
import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// What `verify` found.
public struct VerificationReport: Sendable, Codable {
    public var archive: String
    public var productId: ProductIdentifier
    public var contentVersion: ContentVersion
    public var archiveSize: UInt64
    public var archiveSHA256: String
    public var entryCount: Int
    public var contentLength: UInt64
    /// The manifest that was checked too, if one sat beside the archive (or was named).
    public var manifest: String?
}

/// Checks an archive end to end: structure, every entry's CRC and size, the content layout and
/// plist, and, when a manifest is given or sits beside the archive, every hash and offset in it.
public enum ArchiveVerifier {
    /// Reads a whole archive, checking every entry's size and CRC-32 and the content layout, and
    /// returns the manifest it should have. Servers store this instead of trusting an uploaded one.
    public static func computeManifest(
        archive: String, limits: ExtractionLimits = .standard,
        createdAt: String = ArchiveTimestamp.standard.iso8601
    ) throws(ArchiveError) -> ArchiveManifest {
        let reader = try ArchiveReader(path: archive, limits: limits)
        let info = try reader.contentInfo()
        var entries: [ArchiveManifest.Entry] = []
        for entry in reader.entries {
            var hasher = SHA256()
            var chunks = ChunkHasher(chunkSize: ArchiveManifest.standardChunkSize)
            var storedCRC: UInt32 = 0
            try reader.read(
                entry,
                stored: {
                    chunks.update($0)
                    storedCRC = crc32(storedCRC, $0)
                }, into: { hasher.update(bufferPointer: $0) })
            entries.append(
                .init(
                    path: entry.path, kind: entry.isDirectory ? .directory : .file, method: entry.method,
                    uncompressedSize: entry.uncompressedSize, compressedSize: entry.compressedSize, crc32: entry.crc32,
                    sha256: Hex.encode(hasher.finalize()), localHeaderOffset: entry.localHeaderOffset,
                    dataOffset: entry.dataOffset, chunks: chunks.finalize(), storedCRC32: storedCRC))
        }
        let (size, digest) = try ArchivePacker.hashFile(archive)
        return ArchiveManifest(
            productId: info.productIdentifier,
            contentVersion: info.contentVersion, archiveName: URL(fileURLWithPath: archive).lastPathComponent,
            archiveSize: size, archiveSHA256: digest, contentLength: entries.reduce(0) { $0 + $1.uncompressedSize },
            createdAt: createdAt, entries: entries)
    }

    /// Checks `computed` (from ``computeManifest(archive:limits:createdAt:)``) against a manifest
    /// that claims to describe the same archive; throws naming the first difference.
    public static func check(_ computed: ArchiveManifest, against manifest: ArchiveManifest, archive: String, source: String) throws(ArchiveError) {
        func mismatch(_ what: String) -> ArchiveError {
            .corrupt("\(archive) does not match \(source): \(what). Download both again, or rebuild them together with iap-pack")
        }
        guard manifest.productId == computed.productId, manifest.contentVersion == computed.contentVersion else {
            throw mismatch("the manifest is for \(manifest.productId) \(manifest.contentVersion), the archive for \(computed.productId) \(computed.contentVersion)")
        }
        guard manifest.archiveSize == computed.archiveSize else { throw mismatch("size \(computed.archiveSize) instead of \(manifest.archiveSize)") }
        guard manifest.archiveSHA256 == computed.archiveSHA256 else { throw mismatch("SHA-256 \(computed.archiveSHA256) instead of \(manifest.archiveSHA256)") }
        guard manifest.entries.count == computed.entries.count else {
            throw mismatch("\(computed.entries.count) entries instead of \(manifest.entries.count)")
        }
        for (listed, entry) in zip(manifest.entries, computed.entries) {
            guard listed.path == entry.path else { throw mismatch("entry '\(entry.path)' where the manifest lists '\(listed.path)'") }
            // A format 1 manifest has no chunk hashes to compare, an older one no stored CRC-32;
            // what only the packer knew is not compared.
            var expected = listed.derivable
            if expected.chunks == nil { expected.chunks = entry.chunks }
            if expected.storedCRC32 == nil { expected.storedCRC32 = entry.storedCRC32 }
            guard expected == entry.derivable else { throw mismatch("entry '\(entry.path)' differs in its hash, size, method, offset or chunk hashes") }
        }
    }

    /// Reads the whole archive (structure, every CRC, `ContentInfo.plist`) and, when a manifest
    /// is given, checks that it describes exactly these bytes; throws on the first difference.
    public static func verify(
        archive: String, manifest manifestPath: String? = nil,
        limits: ExtractionLimits = .standard
    ) throws(ArchiveError) -> VerificationReport {
        let computed = try computeManifest(archive: archive, limits: limits)
        var report = VerificationReport(
            archive: archive, productId: computed.productId, contentVersion: computed.contentVersion,
            archiveSize: computed.archiveSize, archiveSHA256: computed.archiveSHA256, entryCount: computed.entries.count,
            contentLength: computed.contentLength, manifest: nil)
        let besidePath = manifestBeside(archive)
        let chosen = manifestPath ?? (access(besidePath, F_OK) == 0 ? besidePath : nil)
        guard let chosen else { return report }
        let manifest = try ArchiveManifest.load(path: chosen)
        try check(computed, against: manifest, archive: archive, source: chosen)
        report.manifest = chosen
        return report
    }

    /// `<dir>/<id>-<version>.zip` → `<dir>/<id>-<version>.manifest.json`.
    public static func manifestBeside(_ archive: String) -> String {
        (archive.hasSuffix(".zip") ? String(archive.dropLast(4)) : archive) + ".manifest.json"
    }
}

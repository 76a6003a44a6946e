import Crypto
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
    public static func verify(archive: String, manifest manifestPath: String? = nil,
                              limits: ExtractionLimits = .standard) throws(ArchiveError) -> VerificationReport {
        let reader = try ArchiveReader(path: archive, limits: limits)
        let info = try reader.contentInfo()
        var hashes: [String: String] = [:]
        for entry in reader.entries {
            var hasher = SHA256()
            try reader.read(entry) { hasher.update(bufferPointer: $0) }
            hashes[entry.path] = Array(hasher.finalize()).hexString
        }
        let (size, digest) = try ArchivePacker.hashFile(archive)
        var report = VerificationReport(
            archive: archive, productId: info.productIdentifier, contentVersion: info.contentVersion,
            archiveSize: size, archiveSHA256: digest, entryCount: reader.entries.count,
            contentLength: reader.entries.reduce(0) { $0 + $1.uncompressedSize }, manifest: nil)

        let besidePath = manifestBeside(archive)
        let chosen = manifestPath ?? (access(besidePath, F_OK) == 0 ? besidePath : nil)
        guard let chosen else { return report }
        let manifest = try ArchiveManifest.decode(Data(try ContentScanner.readManifest(chosen)), source: chosen)
        func mismatch(_ what: String) -> ArchiveError {
            .corrupt("\(archive) does not match \(chosen): \(what). Download both again, or rebuild them together with iap-pack")
        }
        guard manifest.productId == info.productIdentifier, manifest.contentVersion == info.contentVersion else {
            throw mismatch("the manifest is for \(manifest.productId) \(manifest.contentVersion), the archive for \(info.productIdentifier) \(info.contentVersion)")
        }
        guard manifest.archiveSize == size else { throw mismatch("size \(size) instead of \(manifest.archiveSize)") }
        guard manifest.archiveSHA256 == digest else { throw mismatch("SHA-256 \(digest) instead of \(manifest.archiveSHA256)") }
        guard manifest.entries.count == reader.entries.count else {
            throw mismatch("\(reader.entries.count) entries instead of \(manifest.entries.count)")
        }
        for (listed, entry) in zip(manifest.entries, reader.entries) {
            guard listed.path == entry.path else { throw mismatch("entry '\(entry.path)' where the manifest lists '\(listed.path)'") }
            guard listed.sha256 == hashes[entry.path], listed.crc32 == entry.crc32,
                  listed.uncompressedSize == entry.uncompressedSize, listed.compressedSize == entry.compressedSize,
                  listed.method == entry.method, listed.localHeaderOffset == entry.localHeaderOffset,
                  listed.dataOffset == entry.dataOffset else {
                throw mismatch("entry '\(entry.path)' differs in its hash, size, method or offset")
            }
        }
        report.manifest = chosen
        return report
    }

    /// `<dir>/<id>-<version>.zip` → `<dir>/<id>-<version>.manifest.json`.
    public static func manifestBeside(_ archive: String) -> String {
        (archive.hasSuffix(".zip") ? String(archive.dropLast(4)) : archive) + ".manifest.json"
    }
}

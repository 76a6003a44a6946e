import ContentArchive
import Foundation

/// What a delta update fetches and what it takes from the installed version; saved in the
/// journal with the download, so a resumed update fetches the same ranges.
public struct DeltaPlan: Codable, Sendable, Equatable {
    /// The installed version the unchanged files come from.
    public var previousVersion: String
    /// SHA-256 of the new version's manifest (kept as `<id>.manifest.json` in the journal folder).
    public var manifestSHA256: String
    /// Archive paths of the entries fetched (changed or new files, `ContentInfo.plist`).
    public var fetched: [String]
    /// Archive path in the new version → archive path in the installed version, for files
    /// whose bytes are the same there and whose installed copy is untouched.
    public var reused: [String: String]
    /// The archive byte ranges fetched: each fetched entry's stored bytes, neighbours coalesced.
    var ranges: [Segment]
    /// File entries in the new version.
    public var totalEntries: Int
    /// Bytes to download (the ranges) and bytes the install writes (the fetched entries, uncompressed).
    public var bytesToFetch: Int64
    public var bytesToWrite: Int64
    /// The whole archive's size and the new version's content size, for "X of Y bytes".
    public var archiveSize: Int64
    public var contentLength: Int64

    /// Ranges closer than this are fetched as one: a gap holds only a local header and a short
    /// entry, and one request costs more than a few KiB of bytes.
    static let coalesceGap: UInt64 = 16 << 10

    /// Plans the update from `installed` to `manifest`; nil when fetching the whole archive is as
    /// good (more than half of it changed) or nothing can be taken from the installed version.
    static func make(
        manifest: ArchiveManifest, manifestSHA256: String, installed: InstalledVersion, installedFolder: String
    ) -> DeltaPlan? {
        var byDigest: [String: [ArchiveManifest.Entry]] = [:]
        for old in installed.manifest.entries where old.kind == .file {
            byDigest[old.sha256, default: []].append(old)
        }
        var fetched: [ArchiveManifest.Entry] = []
        var reused: [String: String] = [:]
        var totalEntries = 0
        for entry in manifest.entries where entry.kind == .file {
            totalEntries += 1
            // Any installed file with the same bytes will do (a file moved in the new version too),
            // as long as it is untouched since the install.
            let source = (byDigest[entry.sha256] ?? []).first { old in
                old.uncompressedSize == entry.uncompressedSize && entry.uncompressedSize > 0
                    && installed.isUntouched(old.path, in: installedFolder)
            }
            if let source, entry.path != ContentInfo.fileName {
                reused[entry.path] = source.path
            } else {
                fetched.append(entry)
            }
        }
        guard !reused.isEmpty else { return nil }
        let ranges = coalesce(fetched.filter { $0.compressedSize > 0 }.map { ($0.dataOffset, $0.dataOffset + $0.compressedSize) })
        let bytesToFetch = ranges.reduce(Int64(0)) { $0 + ($1.end - $1.start) }
        guard bytesToFetch * 2 < Int64(manifest.archiveSize) else { return nil }
        return DeltaPlan(
            previousVersion: installed.manifest.contentVersion.string, manifestSHA256: manifestSHA256,
            fetched: fetched.map(\.path), reused: reused, ranges: ranges, totalEntries: totalEntries,
            bytesToFetch: bytesToFetch, bytesToWrite: fetched.reduce(Int64(0)) { $0 + Int64($1.uncompressedSize) },
            archiveSize: Int64(manifest.archiveSize), contentLength: Int64(manifest.contentLength))
    }

    /// Sorted, merged ranges, each a ``Segment`` with nothing done.
    static func coalesce(_ spans: [(UInt64, UInt64)]) -> [Segment] {
        var merged: [(UInt64, UInt64)] = []
        for (start, end) in spans.sorted(by: { $0.0 < $1.0 }) {
            if let last = merged.last, start <= last.1 + coalesceGap {
                merged[merged.count - 1].1 = max(last.1, end)
            } else {
                merged.append((start, end))
            }
        }
        return merged.map { Segment(start: Int64($0.0), end: Int64($0.1), done: 0) }
    }

    /// Whether `segments` are this plan's ranges, each with a sane `done`: a journal from disk
    /// is checked before it is trusted.
    func matches(_ segments: [Segment]) -> Bool {
        segments.count == ranges.count
            && zip(segments, ranges).allSatisfy { s, r in s.start == r.start && s.end == r.end && s.done >= 0 && s.done <= s.end - s.start }
    }

    /// "delta: N of M entries, X of Y bytes", as `iap-fetch status` shows it.
    public var summary: String {
        "delta: \(fetched.count) of \(totalEntries) entries, \(bytesToFetch) of \(archiveSize) bytes (from \(previousVersion))"
    }
}

/// What the journal keeps about an installed version, so a later update can take files from it:
/// its manifest, and each installed file's identity (device, inode, size, modification time) at
/// install. A file whose identity changed since (edited, replaced) is fetched again rather than
/// trusted; hashing every installed file at each update instead would cost as much as the
/// download it saves.
public struct InstalledVersion: Codable, Sendable {
    public struct Identity: Codable, Sendable, Equatable {
        var device: UInt64
        var inode: UInt64
        var size: Int64
        var modified: Int64
    }

    public var manifest: ArchiveManifest
    var files: [String: Identity]

    /// `<content>/.iap-fetch/installed/<productId>.json`: one installed version per product.
    static func path(contentDirectory: String, productId: String) -> String {
        contentDirectory + "/.iap-fetch/installed/" + productId + ".json"
    }

    static func identity(of path: String) -> Identity? {
        var info = stat()
        guard lstat(path, &info) == 0, (info.st_mode & S_IFMT) == S_IFREG else { return nil }
        return Identity(
            device: UInt64(info.st_dev), inode: UInt64(info.st_ino), size: Int64(info.st_size),
            modified: Int64(info.st_mtim.tv_sec) * 1_000_000_000 + Int64(info.st_mtim.tv_nsec))
    }

    /// Records the files of `manifest` as installed in `folder` now.
    static func record(manifest: ArchiveManifest, folder: String) -> InstalledVersion {
        var files: [String: Identity] = [:]
        for entry in manifest.entries where entry.kind == .file {
            if let identity = identity(of: folder + "/" + entry.path) { files[entry.path] = identity }
        }
        return InstalledVersion(manifest: manifest, files: files)
    }

    func isUntouched(_ archivePath: String, in folder: String) -> Bool {
        guard let recorded = files[archivePath] else { return false }
        return Self.identity(of: folder + "/" + archivePath) == recorded
    }
}

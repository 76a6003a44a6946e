import ContentArchive
import DurableFiles
import Foundation

/// What a delta update fetches and what it takes from the installed version; saved in the
/// journal with the download, so a resumed update fetches the same ranges.
public struct DeltaPlan: Codable, Sendable, Equatable {
    /// The installed version the unchanged files come from.
    public var previousVersion: String
    /// SHA-256 of the new version's manifest (kept as `<id>.manifest.json` in the journal folder).
    public var manifestSHA256: String
    /// Archive paths of the entries fetched (changed or new files, `ContentInfo.plist`); every
    /// other file comes from the installed version (``sources(for:installed:folder:looking:)``,
    /// decided again at install, so the journal, saved every MiB, stays small).
    public var fetched: [String]
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
        let reused = sources(for: manifest, installed: installed, folder: installedFolder)
        guard !reused.isEmpty else { return nil }
        let fetched = manifest.entries.filter { $0.kind == .file && reused[$0.path] == nil }
        let totalEntries = manifest.entries.count { $0.kind == .file }
        let ranges = coalesce(fetched.filter { $0.compressedSize > 0 }.map { ($0.dataOffset, $0.dataOffset + $0.compressedSize) })
        let bytesToFetch = ranges.reduce(Int64(0)) { $0 + ($1.end - $1.start) }
        guard bytesToFetch * 2 < Int64(manifest.archiveSize) else { return nil }
        return DeltaPlan(
            previousVersion: installed.contentVersion, manifestSHA256: manifestSHA256,
            fetched: fetched.map(\.path), ranges: ranges, totalEntries: totalEntries,
            bytesToFetch: bytesToFetch, bytesToWrite: fetched.reduce(Int64(0)) { $0 + Int64($1.uncompressedSize) },
            archiveSize: Int64(manifest.archiveSize), contentLength: Int64(manifest.contentLength))
    }

    /// For each file of `manifest` whose bytes an untouched installed file has (any path: a file
    /// moved in the new version counts), the path of that installed file. `ContentInfo.plist`
    /// names the version, so it is always fetched. `looking: false` trusts the record without
    /// looking at the files, for a caller that checks each one as it uses it.
    static func sources(for manifest: ArchiveManifest, installed: InstalledVersion, folder: String, looking: Bool = true) -> [String: String] {
        var byDigest: [String: [InstalledVersion.File]] = [:]
        for file in installed.files { byDigest[file.sha256, default: []].append(file) }
        var reused: [String: String] = [:]
        for entry in manifest.entries where entry.kind == .file && entry.uncompressedSize > 0 && entry.path != ContentInfo.fileName {
            let source = (byDigest[entry.sha256] ?? []).first { $0.size == Int64(entry.uncompressedSize) && (!looking || $0.isUntouched(in: folder)) }
            if let source { reused[entry.path] = source.path }
        }
        return reused
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
/// each installed file's SHA-256 (from the manifest it was installed from) and identity (device,
/// inode, size, modification time) at install. A file whose identity changed since (edited,
/// replaced) is fetched again rather than trusted; hashing every installed file at each update
/// instead would cost as much as the download it saves.
public struct InstalledVersion: Sendable {
    struct File: Sendable, Equatable {
        var path: String
        var sha256: String
        var size: Int64
        var device: UInt64
        var inode: UInt64
        var modified: Int64

        /// The change time is not compared: linking an installed file into the next version and
        /// removing the old one change it, and neither touches the bytes.
        func isUntouched(in folder: String) -> Bool {
            guard let now = FileIdentity.of(folder + "/" + path) else { return false }
            return isIdentity(now)
        }

        /// Whether `identity` is this file's, change time aside.
        func isIdentity(_ identity: FileIdentity) -> Bool {
            (identity.device, identity.inode, Int64(identity.size), identity.modified) == (device, inode, size, modified)
        }
    }

    var productId: String
    var contentVersion: String
    var files: [File]

    /// `<content>/.iap-fetch/installed/<productId>.tsv`: one installed version per product.
    static func path(contentDirectory: String, productId: String) -> String {
        contentDirectory + "/.iap-fetch/installed/" + productId + ".tsv"
    }

    /// Tab-separated lines: a header (`iap-fetch-installed 1`, product, version), then per file
    /// its SHA-256, size, device, inode, modification time (ns) and path. Not JSON: with Codable,
    /// reading the record of a 5,000-file product took a fifth of a delta update's time. Entry
    /// paths never hold tabs or newlines (``SafeExtractor`` refuses control characters).
    func encoded() -> Data {
        var text = "iap-fetch-installed 1\t\(productId)\t\(contentVersion)\n"
        text.reserveCapacity(files.count * 160)
        for f in files { text += "\(f.sha256)\t\(f.size)\t\(f.device)\t\(f.inode)\t\(f.modified)\t\(f.path)\n" }
        return Data(text.utf8)
    }

    /// nil when `data` is not such a record (damaged, or from another version of iap-fetch): the
    /// next download is then a whole one.
    ///
    /// Read as bytes: splitting the text as `String`s walks grapheme clusters, and took most of
    /// a delta's planning for 5,000 files.
    static func decode(_ data: Data) -> InstalledVersion? {
        data.withUnsafeBytes { raw -> InstalledVersion? in
            let lines = raw.split(separator: UInt8(ascii: "\n"), omittingEmptySubsequences: true)
            guard let header = lines.first?.split(separator: UInt8(ascii: "\t"), omittingEmptySubsequences: false), header.count == 3,
                header[0].elementsEqual("iap-fetch-installed 1".utf8)
            else { return nil }
            var files: [File] = []
            files.reserveCapacity(lines.count - 1)
            for line in lines.dropFirst() {
                let fields = line.split(separator: UInt8(ascii: "\t"), maxSplits: 5, omittingEmptySubsequences: false)
                guard fields.count == 6, let size = integer(Int64.self, fields[1]), let device = integer(UInt64.self, fields[2]),
                    let inode = integer(UInt64.self, fields[3]), let modified = integer(Int64.self, fields[4])
                else { return nil }
                files.append(
                    File(
                        path: String(decoding: fields[5], as: UTF8.self), sha256: String(decoding: fields[0], as: UTF8.self), size: size,
                        device: device, inode: inode, modified: modified))
            }
            return InstalledVersion(
                productId: String(decoding: header[1], as: UTF8.self), contentVersion: String(decoding: header[2], as: UTF8.self), files: files)
        }
    }

    /// The decimal number `digits` spell (a leading `-` for a signed type), nil when they spell
    /// none or one that does not fit.
    private static func integer<T: FixedWidthInteger>(_: T.Type, _ digits: Slice<UnsafeRawBufferPointer>) -> T? {
        var rest = digits[...]
        let negative = T.isSigned && rest.first == UInt8(ascii: "-")
        if negative { rest = rest.dropFirst() }
        guard !rest.isEmpty, rest.count <= 20 else { return nil }
        var value: T = 0
        for byte in rest {
            guard byte >= UInt8(ascii: "0"), byte <= UInt8(ascii: "9") else { return nil }
            let (times, o1) = value.multipliedReportingOverflow(by: 10)
            let (next, o2) = negative ? times.subtractingReportingOverflow(T(byte - UInt8(ascii: "0"))) : times.addingReportingOverflow(T(byte - UInt8(ascii: "0")))
            guard !o1, !o2 else { return nil }
            value = next
        }
        return value
    }

    /// Records the files of `manifest` as installed in `folder` now.
    /// `known`: identities already seen, by entry path; the other files are looked at now.
    static func record(manifest: ArchiveManifest, folder: String, known: [String: FileIdentity] = [:]) -> InstalledVersion {
        var files: [File] = []
        for entry in manifest.entries where entry.kind == .file {
            guard let id = known[entry.path] ?? FileIdentity.of(folder + "/" + entry.path) else { continue }
            files.append(File(path: entry.path, sha256: entry.sha256, size: Int64(id.size), device: id.device, inode: id.inode, modified: id.modified))
        }
        return InstalledVersion(productId: manifest.productId.rawValue, contentVersion: manifest.contentVersion.string, files: files)
    }
}

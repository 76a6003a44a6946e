import Foundation
import SystemPackage

/// Limits that protect a reader from hostile archives (zip bombs, entry floods).
public struct ExtractionLimits: Sendable {
    /// At most this many entries.
    public var maxEntries: Int
    /// At most this many bytes once extracted, all entries together.
    public var maxTotalUncompressedSize: UInt64
    /// An entry may claim at most this ratio of uncompressed to compressed size...
    public var maxCompressionRatio: UInt64
    /// ...unless it is this small, where a high ratio can do no harm.
    public var ratioExemptSize: UInt64

    public init(
        maxEntries: Int = 65_535, maxTotalUncompressedSize: UInt64 = 16 << 30,
        maxCompressionRatio: UInt64 = 200, ratioExemptSize: UInt64 = 1 << 20
    ) {
        self.maxEntries = maxEntries
        self.maxTotalUncompressedSize = maxTotalUncompressedSize
        self.maxCompressionRatio = maxCompressionRatio
        self.ratioExemptSize = ratioExemptSize
    }

    public static let standard = ExtractionLimits()
}

/// One entry of an archive, as its central directory and local header describe it.
public struct ArchiveEntry: Sendable, Equatable {
    public let path: String
    public let isDirectory: Bool
    public let method: ArchiveManifest.Entry.Method
    public let crc32: UInt32
    public let compressedSize: UInt64
    public let uncompressedSize: UInt64
    public let localHeaderOffset: UInt64
    /// Where the entry's data starts, after its local header.
    public let dataOffset: UInt64
}

/// Reads a ZIP archive, treating every byte as hostile: all structure is validated when it is
/// opened (paths, sizes, overlaps, ratios, types) and every entry's size and CRC when it is read.
/// Entries may be read from several threads at once: each read has its own offsets and buffers.
public final class ArchiveReader: Sendable {
    public let path: String
    public let size: UInt64
    /// The entries in central-directory order.
    public let entries: [ArchiveEntry]
    private let fd: FileDescriptor

    /// Opens `path` and reads its central directory, refusing an archive that breaks `limits`, is
    /// damaged, truncated, encrypted, ZIP64 or spanned, or holds links or special files. Nothing
    /// is extracted yet; paths are checked as entries are extracted.
    public init(path: String, limits: ExtractionLimits = .standard) throws(ArchiveError) {
        self.path = path
        // Looked at before opening: a folder opens too (and its end lies 2^63 bytes on), and
        // opening a pipe waits for a writer.
        var info = stat()
        if stat(path, &info) == 0 {
            switch info.st_mode & S_IFMT {
            case S_IFREG: break
            case S_IFDIR: throw .invalid("\(path) is a folder, not an archive: pass the .zip file in it")
            default: throw .invalid("\(path) is not a regular file (a pipe, socket or device): pass the archive's .zip file")
            }
        }
        let fd = try openFile(path)
        self.fd = fd
        do {
            let size = try systemCall("read", path) { try fd.seek(offset: 0, from: .end) }
            self.size = UInt64(size)
            entries = try Self.readDirectory(fd: fd, path: path, size: UInt64(size), limits: limits)
        } catch {
            try? fd.close()
            throw error
        }
    }

    /// Reads entries of `path` at the offsets a verified `manifest` gives, without a central
    /// directory: for a delta update's partial archive, which holds only the entries fetched
    /// (the others read as holes). The manifest's layout passes the same checks as a central
    /// directory's, and every entry read is still checked against its size and CRC-32.
    public init(path: String, manifest: ArchiveManifest, limits: ExtractionLimits = .standard) throws(ArchiveError) {
        self.path = path
        entries = try Self.layout(of: manifest, archive: path, limits: limits)
        let fd = try openFile(path)
        self.fd = fd
        size = manifest.archiveSize
    }

    /// The entries `manifest` places in its archive (`path`, for messages), in its order, once
    /// they pass the checks a central directory's do.
    static func layout(of manifest: ArchiveManifest, archive path: String, limits: ExtractionLimits) throws(ArchiveError) -> [ArchiveEntry] {
        guard manifest.entries.count <= limits.maxEntries else {
            throw .corrupt("the manifest of \(path) lists \(manifest.entries.count) entries, more than the limit of \(limits.maxEntries): refusing it")
        }
        var checks = EntryChecks(path: path, limits: limits)
        var entries: [ArchiveEntry] = []
        for entry in manifest.entries {
            try checks.check(
                name: entry.path, stored: entry.method == .stored, compressed: entry.compressedSize, uncompressed: entry.uncompressedSize)
            // Written as a difference: the sum of two hostile numbers can overflow.
            guard entry.dataOffset > entry.localHeaderOffset, entry.compressedSize <= manifest.archiveSize,
                entry.dataOffset <= manifest.archiveSize - entry.compressedSize
            else {
                throw .corrupt("the manifest of \(path) places '\(entry.path)' outside the archive: refusing it")
            }
            guard (entry.kind == .directory) == entry.path.hasSuffix("/") else {
                throw .corrupt("the manifest of \(path) calls '\(entry.path)' a \(entry.kind.rawValue): refusing it")
            }
            entries.append(
                ArchiveEntry(
                    path: entry.path, isDirectory: entry.kind == .directory, method: entry.method, crc32: entry.crc32,
                    compressedSize: entry.compressedSize, uncompressedSize: entry.uncompressedSize,
                    localHeaderOffset: entry.localHeaderOffset, dataOffset: entry.dataOffset))
        }
        try EntryChecks.refuseOverlaps(entries, path: path)
        return entries
    }

    deinit { try? fd.close() }

    private static func readDirectory(
        fd: FileDescriptor, path: String, size: UInt64,
        limits: ExtractionLimits
    ) throws(ArchiveError) -> [ArchiveEntry] {
        let notZip = "\(path) is not a ZIP archive (no end-of-central-directory record): it may be truncated or another kind of file; download or build it again"
        guard size >= UInt64(Zip.endRecordSize) else { throw .corrupt(notZip) }
        guard size < 1 << 32 else {
            throw .corrupt("\(path) is \(size) bytes; content archives are at most \(ArchiveLimits.maxArchiveSize) bytes: it is not a content archive")
        }
        let tailLength = Int(min(size, UInt64(Zip.endRecordSize + 0xFFFF)))
        let tail = try readFully(fd, at: size - UInt64(tailLength), count: tailLength, path: path)
        var endIndex: Int?
        var candidate = tail.count - Zip.endRecordSize
        while candidate >= 0 {
            if tail[candidate] == 0x50, tail[candidate + 1] == 0x4B, tail[candidate + 2] == 0x05, tail[candidate + 3] == 0x06 {
                let commentLength = Int(tail[candidate + 20]) | Int(tail[candidate + 21]) << 8
                if candidate + Zip.endRecordSize + commentLength == tail.count {
                    endIndex = candidate
                    break
                }
            }
            candidate -= 1
        }
        guard let endIndex else { throw .corrupt(notZip) }
        var end = LittleEndianReader(tail, at: endIndex + 4)
        let disk = try end.u16(), centralDisk = try end.u16()
        let diskEntries = try end.u16(), totalEntries = try end.u16()
        let centralSize = try end.u32(), centralOffset = try end.u32()
        let endOffset = size - UInt64(tailLength) + UInt64(endIndex)
        if totalEntries == 0xFFFF || centralSize == 0xFFFF_FFFF || centralOffset == 0xFFFF_FFFF {
            throw .corrupt("\(path) is a ZIP64 archive; content archives never need ZIP64: build it with iap-pack")
        }
        guard disk == 0, centralDisk == 0, diskEntries == totalEntries else {
            throw .corrupt("\(path) is a multi-part (spanned) ZIP archive, which content archives never are: build it with iap-pack")
        }
        guard Int(totalEntries) <= limits.maxEntries else {
            throw .corrupt("\(path) has \(totalEntries) entries, more than the limit of \(limits.maxEntries): refusing it")
        }
        guard UInt64(centralOffset) + UInt64(centralSize) <= endOffset else {
            throw .corrupt("\(path) has a central directory that points past its end: the archive is damaged; download or build it again")
        }
        let central = try readFully(fd, at: UInt64(centralOffset), count: Int(centralSize), path: path)
        guard central.count == Int(centralSize) else { throw .corrupt(notZip) }

        var reader = LittleEndianReader(central)
        var parsed: [(header: ZipEntryHeader, path: String)] = []
        var checks = EntryChecks(path: path, limits: limits)
        for _ in 0..<Int(totalEntries) {
            guard try reader.u32() == Zip.centralHeaderSignature else {
                throw .corrupt("\(path) has a damaged central directory: download or build it again")
            }
            let madeBy = try reader.u16()
            _ = try reader.u16()
            let flags = try reader.u16()
            let method = try reader.u16()
            let time = try reader.u16(), date = try reader.u16()
            let crc = try reader.u32(), compressed = try reader.u32(), uncompressed = try reader.u32()
            let nameLength = Int(try reader.u16()), extraLength = Int(try reader.u16()), commentLength = Int(try reader.u16())
            _ = try reader.u16()
            _ = try reader.u16()
            let external = try reader.u32()
            let offset = try reader.u32()
            let nameBytes = Array(try reader.take(nameLength))
            _ = try reader.take(extraLength + commentLength)

            guard let name = String(validating: nameBytes, as: UTF8.self) else {
                throw .corrupt("\(path) has an entry whose name is not valid UTF-8: refusing it")
            }
            guard flags & Zip.flagEncrypted == 0 else {
                throw .corrupt("entry '\(name)' in \(path) is encrypted; content archives are not: build it with iap-pack")
            }
            guard method == Zip.methodStored || method == Zip.methodDeflate else {
                throw .corrupt("entry '\(name)' in \(path) uses compression method \(method); only stored (0) and deflate (8) are accepted: build it with iap-pack")
            }
            let isDirectory = name.hasSuffix("/")
            if madeBy >> 8 == 3 {
                let type = (external >> 16) & Zip.typeMask
                if type == Zip.symlinkType {
                    throw .corrupt("entry '\(name)' in \(path) is a symbolic link; content archives hold no links: refusing it")
                }
                let expected: UInt32 = isDirectory ? 0o040000 : 0o100000
                guard type == 0 || type == expected else {
                    throw .corrupt("entry '\(name)' in \(path) is a special file (Unix type \(String(type, radix: 8))); only files and folders are accepted: refusing it")
                }
            }
            try checks.check(
                name: name, stored: method == Zip.methodStored, compressed: UInt64(compressed), uncompressed: UInt64(uncompressed))
            parsed.append(
                (
                    ZipEntryHeader(
                        name: nameBytes, method: method, crc32: crc, compressedSize: compressed,
                        uncompressedSize: uncompressed, mode: external >> 16, localHeaderOffset: offset,
                        dosTime: time, dosDate: date), name
                ))
        }

        // Local headers: they must agree with the central directory, and no two entries' bytes may
        // overlap (overlapping entries are how the densest zip bombs are built).
        var entries: [ArchiveEntry] = []
        for (header, name) in parsed {
            let offset = UInt64(header.localHeaderOffset)
            let local = try readFully(fd, at: offset, count: Zip.localHeaderSize, path: path)
            var l = LittleEndianReader(local)
            guard local.count == Zip.localHeaderSize, try l.u32() == Zip.localHeaderSignature else {
                throw .corrupt("entry '\(name)' in \(path) points to a missing local header: the archive is damaged; download or build it again")
            }
            _ = try l.u16()
            _ = try l.u16()
            let method = try l.u16()
            _ = try l.take(16)
            let nameLength = Int(try l.u16()), extraLength = Int(try l.u16())
            let localName = try readFully(fd, at: offset + UInt64(Zip.localHeaderSize), count: nameLength, path: path)
            guard method == header.method, localName == header.name else {
                throw .corrupt("entry '\(name)' in \(path) has a local header that disagrees with the central directory: the archive is damaged or forged")
            }
            let dataOffset = offset + UInt64(Zip.localHeaderSize + nameLength + extraLength)
            guard dataOffset + UInt64(header.compressedSize) <= UInt64(centralOffset) else {
                throw .corrupt("entry '\(name)' in \(path) runs past the end of the entry data: the archive is truncated or forged")
            }
            entries.append(
                ArchiveEntry(
                    path: name, isDirectory: header.isDirectory,
                    method: header.method == Zip.methodDeflate ? .deflate : .stored, crc32: header.crc32,
                    compressedSize: UInt64(header.compressedSize), uncompressedSize: UInt64(header.uncompressedSize),
                    localHeaderOffset: offset, dataOffset: dataOffset))
        }
        try EntryChecks.refuseOverlaps(entries, path: path)
        return entries
    }

    /// Streams an entry's uncompressed bytes to `body`, checking its size and CRC-32; throws if
    /// the entry inflates past its declared size (stopping at once) or does not match.
    /// `stored`, when given, sees the entry's stored (compressed) bytes as they are read.
    /// `once`: the archive is read this once and then removed (an install), so the page cache
    /// lets go of its pages as they are read; they are the next ones the extracted files are
    /// written into (see ``dropStep``).
    public func read(
        _ entry: ArchiveEntry, stored: ((UnsafeRawBufferPointer) -> Void)? = nil, once: Bool = false,
        into body: (UnsafeRawBufferPointer) throws(ArchiveError) -> Void
    ) throws(ArchiveError) {
        var crc: UInt32 = 0
        var produced: UInt64 = 0
        let declared = entry.uncompressedSize
        func deliver(_ bytes: UnsafeRawBufferPointer) throws(ArchiveError) {
            produced += UInt64(bytes.count)
            guard produced <= declared else {
                throw .corrupt("entry '\(entry.path)' in \(path) inflates to more than its declared \(declared) bytes (a zip bomb or a damaged archive): refusing it")
            }
            crc = crc32(crc, bytes)
            try body(bytes)
        }
        let chunk = 256 << 10
        var offset = entry.dataOffset
        let end = entry.dataOffset + entry.compressedSize
        let inflater = entry.method == .deflate ? try Inflater() : nil
        var output = [UInt8](repeating: 0, count: inflater == nil ? 0 : chunk)
        var drops = once ? DropBehind(from: Int64(offset), step: Self.dropStep) : nil
        defer { if var rest = drops { DropBehind.release(rest.finish(at: Int64(offset)), of: fd.rawValue) } }
        while offset < end {
            let input = try readFully(fd, at: offset, count: Int(min(UInt64(chunk), end - offset)), path: path)
            guard !input.isEmpty else { break }
            offset += UInt64(input.count)
            if let range = drops?.advance(to: Int64(offset)) { DropBehind.release(range, of: fd.rawValue) }
            if let stored { input.withUnsafeBytes { stored($0) } }
            if let inflater {
                try withBuffers(input, &output) { (raw, out) throws(ArchiveError) in
                    _ = try inflater.feed(raw, into: out, emit: deliver)
                }
                if inflater.isFinished { break }
            } else {
                try withBytes(input) { (raw) throws(ArchiveError) in try deliver(raw) }
            }
        }
        if let inflater, !inflater.isFinished, declared > 0 || entry.compressedSize > 0 {
            throw .corrupt("entry '\(entry.path)' in \(path) ends before its compressed data does: the archive is truncated or damaged; download it again")
        }
        guard produced == declared else {
            throw .corrupt("entry '\(entry.path)' in \(path) holds \(produced) bytes but declares \(declared): the archive is damaged or forged")
        }
        guard crc == entry.crc32 else {
            throw .corrupt(
                "entry '\(entry.path)' in \(path) fails its CRC-32 check (\(String(format: "%08x", crc)) instead of \(String(format: "%08x", entry.crc32))): the archive is damaged; download it again")
        }
    }

    /// Bytes read between two drops of a read-once archive's pages: an install writes as many
    /// bytes as it reads, into the pages just freed (``DropBehind``).
    static let dropStep: Int64 = 8 << 20

    /// Reads a small entry (at most 1 MiB) into memory.
    public func data(of entry: ArchiveEntry) throws(ArchiveError) -> [UInt8] {
        guard entry.uncompressedSize <= 1 << 20 else {
            throw .corrupt("entry '\(entry.path)' in \(path) is \(entry.uncompressedSize) bytes, too large to read into memory")
        }
        var bytes: [UInt8] = []
        bytes.reserveCapacity(Int(entry.uncompressedSize))
        try read(entry) { bytes.append(contentsOf: $0) }
        return bytes
    }

    /// Checks the content package layout (`ContentInfo.plist` at the root, everything else under
    /// `Contents/`) and returns what the plist says.
    public func contentInfo() throws(ArchiveError) -> ContentInfo {
        guard let plist = entries.first(where: { $0.path == ContentInfo.fileName }), !plist.isDirectory else {
            throw .corrupt("\(path) has no ContentInfo.plist at its root: it is not a content archive; build it with iap-pack")
        }
        for entry in entries where entry.path != ContentInfo.fileName && !entry.path.hasPrefix(ContentInfo.payloadFolder + "/") {
            throw .corrupt("\(path) holds '\(entry.path)' outside Contents/: a content archive holds only ContentInfo.plist and Contents/; build it with iap-pack")
        }
        do {
            return try ContentInfo(plist: Data(try data(of: plist)), source: "\(path): ContentInfo.plist")
        } catch {
            throw .corrupt(error.message)
        }
    }
}

/// The checks every entry passes, whether its layout comes from the central directory or from a
/// verified manifest: a safe path, sizes that agree, the zip-bomb limits, no duplicates.
struct EntryChecks {
    let path: String
    let limits: ExtractionLimits
    private var seen: [String: String] = [:]
    private var total: UInt64 = 0

    init(path: String, limits: ExtractionLimits) {
        self.path = path
        self.limits = limits
    }

    mutating func check(name: String, stored: Bool, compressed: UInt64, uncompressed: UInt64) throws(ArchiveError) {
        try validateEntryPath(name, archive: path)
        let isDirectory = name.hasSuffix("/")
        if stored && compressed != uncompressed {
            throw .corrupt("entry '\(name)' in \(path) is stored but claims \(compressed) bytes compressed and \(uncompressed) uncompressed: the archive is damaged or forged")
        }
        if isDirectory && uncompressed != 0 {
            throw .corrupt("folder entry '\(name)' in \(path) claims \(uncompressed) bytes of content: the archive is damaged or forged")
        }
        // Sizes from a manifest are 64-bit: products and sums here must not overflow.
        let (allowed, beyond) = max(compressed, 1).multipliedReportingOverflow(by: limits.maxCompressionRatio)
        if uncompressed > limits.ratioExemptSize && !beyond && uncompressed > allowed {
            throw .corrupt(
                "entry '\(name)' in \(path) would expand \(uncompressed / max(compressed, 1)) times (\(compressed) to \(uncompressed) bytes), beyond the limit of \(limits.maxCompressionRatio):1 that guards against zip bombs: refusing it"
            )
        }
        let (sum, overflow) = total.addingReportingOverflow(uncompressed)
        total = sum
        guard !overflow, total <= limits.maxTotalUncompressedSize else {
            throw .corrupt("\(path) would extract to more than \(limits.maxTotalUncompressedSize) bytes, the limit that guards against zip bombs: refusing it")
        }
        let key = collisionKey(name)
        if let other = seen[key] {
            throw .corrupt(
                other.utf8.elementsEqual(name.utf8)  // `==` would call canonically equivalent spellings the same name
                    ? "\(path) holds '\(name)' twice: refusing it (a duplicate can hide content from one reader and show it to another)"
                    : "\(path) holds '\(name)' and '\(other)', which differ only by case or Unicode normalisation and would overwrite each other on many devices: refusing it")
        }
        seen[key] = name
    }

    static func refuseOverlaps(_ entries: [ArchiveEntry], path: String) throws(ArchiveError) {
        let byOffset = entries.sorted { $0.localHeaderOffset < $1.localHeaderOffset }
        for (a, b) in zip(byOffset, byOffset.dropFirst()) where a.dataOffset + a.compressedSize > b.localHeaderOffset {
            throw .corrupt("entries '\(a.path)' and '\(b.path)' in \(path) overlap, as in a zip bomb: refusing it")
        }
    }
}

/// What two paths that a case-insensitive or normalising file system (APFS, NTFS) treats as one
/// have in common: their precomposed (NFC), lowercased form.
///
/// An ASCII path is its own canonical form, and Foundation's normalisation costs more than the
/// rest of a scan or of an archive's checks, so only other paths are normalised.
func collisionKey(_ path: String) -> String {
    path.utf8.allSatisfy { $0 < 0x80 } ? path.lowercased() : path.precomposedStringWithCanonicalMapping.lowercased()
}

/// Refuses any path that could escape the extraction folder or means different things to
/// different systems: absolute paths, `..`, `.`, empty components, backslashes, drive letters,
/// control characters.
func validateEntryPath(_ name: String, archive: String) throws(ArchiveError) {
    func refuse(_ why: String) -> ArchiveError {
        .corrupt("\(archive) holds an entry with an unsafe path \(name.debugDescription) (\(why)): refusing to read it; the archive is not a content archive or was tampered with")
    }
    guard !name.isEmpty, name.utf8.count <= 4096 else { throw refuse("empty or too long") }
    guard !name.hasPrefix("/") else { throw refuse("absolute path") }
    guard !name.unicodeScalars.contains(where: { $0.value < 0x20 || $0.value == 0x7F || $0 == "\\" }) else {
        throw refuse("control character or backslash")
    }
    // Components as the file system sees them: split at each '/' byte. Split as `Character`s, a
    // '/' followed by a combining mark is one grapheme and no separator, so the '..' in
    // "Contents/../\u{301}x" went unseen and the file landed outside Contents/.
    let slash = UInt8(ascii: "/"), dot = UInt8(ascii: ".")
    var components = Array(name.utf8).split(separator: slash, omittingEmptySubsequences: false)
    if name.utf8.last == slash { components.removeLast() }
    for component in components {
        guard !component.isEmpty else { throw refuse("empty path component") }
        guard component.count > 2 || component.contains(where: { $0 != dot }) else {
            throw refuse("'\(String(decoding: component, as: UTF8.self))' component")
        }
        guard component.count <= 255 else { throw refuse("component longer than 255 bytes") }
    }
    if let first = components.first, first.count == 2, first.last == UInt8(ascii: ":") { throw refuse("drive letter") }
}

/// `withUnsafeBytes` for closures with a typed throw, which the standard library's rethrows
/// signature turns into `any Error`.
func withBytes<R>(_ bytes: [UInt8], _ body: (UnsafeRawBufferPointer) throws(ArchiveError) -> R) throws(ArchiveError) -> R {
    let result: Result<R, ArchiveError> = bytes.withUnsafeBytes { raw in
        do throws(ArchiveError) { return .success(try body(raw)) } catch { return .failure(error) }
    }
    return try result.get()
}

func withBuffers<R>(
    _ input: [UInt8], _ output: inout [UInt8],
    _ body: (UnsafeRawBufferPointer, UnsafeMutableRawBufferPointer) throws(ArchiveError) -> R
) throws(ArchiveError) -> R {
    let result: Result<R, ArchiveError> = input.withUnsafeBytes { raw in
        output.withUnsafeMutableBytes { out in
            do throws(ArchiveError) { return .success(try body(raw, out)) } catch { return .failure(error) }
        }
    }
    return try result.get()
}

import Foundation
import SystemPackage

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Extracts a content archive into a folder that appears only when all of it is right.
///
/// Entries are streamed (memory stays flat) into a temporary sibling folder; every size and
/// CRC-32 is checked; the folder is renamed into place only at the end. Paths are validated by
/// ``ArchiveReader`` and files are created with `O_EXCL | O_NOFOLLOW` in folders this extractor
/// made itself, so nothing can be written outside the destination.
public enum SafeExtractor {
    /// Extracts `archive` to `destination`, which must not exist yet.
    /// - Parameters:
    ///   - expecting: when given, the archive's plist must name this product and version.
    ///   - durable: fsync every file and folder before the rename, so a crash leaves either nothing
    ///     or the complete folder.
    /// - Returns: what the archive's `ContentInfo.plist` says.
    @discardableResult
    public static func extract(
        archive: String, to destination: String, expecting: ContentInfo? = nil,
        limits: ExtractionLimits = .standard, durable: Bool = true
    ) throws(ArchiveError) -> ContentInfo {
        let reader = try ArchiveReader(path: archive, limits: limits)
        let info = try reader.contentInfo()
        if let expecting, expecting != info {
            throw .corrupt("\(archive) holds \(info.productIdentifier) \(info.contentVersion), not the expected \(expecting.productIdentifier) \(expecting.contentVersion): refusing to install it")
        }
        let destinationURL = URL(fileURLWithPath: destination)
        let parent = destinationURL.deletingLastPathComponent().path
        if access(destination, F_OK) == 0 {
            throw .io("\(destination) already exists: extract into a new folder (remove or rename the old one first)")
        }
        try makeDirectories(parent)
        let needed = reader.entries.reduce(UInt64(0)) { $0 + $1.uncompressedSize }
        var fs = statvfs()
        if statvfs(parent, &fs) == 0 {
            let free = UInt64(fs.f_bavail) * UInt64(fs.f_frsize)
            if free < needed {
                throw .io("\(parent) has \(free) bytes free but the content needs \(needed): free disk space and try again")
            }
        }
        let temp = parent + "/." + destinationURL.lastPathComponent + ".extracting-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        guard mkdir(temp, 0o755) == 0 else { throw ioError(errno, action: "create folder", path: temp) }
        do throws(ArchiveError) {
            var made: Set<String> = []
            for entry in reader.entries {
                let target = temp + "/" + entry.path
                if entry.isDirectory {
                    try makeParents(of: entry.path + "x", root: temp, made: &made)
                    continue
                }
                try makeParents(of: entry.path, root: temp, made: &made)
                let fd = try systemCall("create", target) {
                    try FileDescriptor.open(
                        target, .writeOnly, options: [.create, .exclusiveCreate, .noFollow],
                        permissions: [.ownerReadWrite, .groupRead, .otherRead])
                }
                do throws(ArchiveError) {
                    try reader.read(entry) { (bytes) throws(ArchiveError) in
                        _ = try systemCall("write", target) { try fd.writeAll(bytes) }
                    }
                    if durable && fsync(fd.rawValue) != 0 { throw ioError(errno, action: "sync", path: target) }
                    try? fd.close()
                } catch {
                    try? fd.close()
                    throw error
                }
            }
            if durable {
                for folder in made.sorted(by: >) { try syncDirectory(temp + "/" + folder) }
                try syncDirectory(temp)
            }
            guard rename(temp, destination) == 0 else { throw ioError(errno, action: "rename into", path: destination) }
            if durable { try syncDirectory(parent) }
        } catch {
            try? FileManager.default.removeItem(atPath: temp)
            throw error
        }
        return info
    }

    private static func makeParents(of path: String, root: String, made: inout Set<String>) throws(ArchiveError) {
        let components = path.split(separator: "/").dropLast()
        var current = ""
        for component in components {
            current += current.isEmpty ? String(component) : "/" + component
            if made.contains(current) { continue }
            let full = root + "/" + current
            if mkdir(full, 0o755) != 0 && errno != EEXIST { throw ioError(errno, action: "create folder", path: full) }
            made.insert(current)
        }
    }
}

import Foundation

/// The parts of the ZIP format (PKWARE APPNOTE 6.3) that content archives use: no ZIP64, no
/// encryption, methods 0 (stored) and 8 (deflate). ZIP64 is unnecessary because archives are
/// capped at 2 GiB; entries of 4 GiB or more are refused at packing time.
enum Zip {
    static let localHeaderSignature: UInt32 = 0x0403_4B50
    static let centralHeaderSignature: UInt32 = 0x0201_4B50
    static let endOfCentralDirectorySignature: UInt32 = 0x0605_4B50
    static let localHeaderSize = 30
    static let centralHeaderSize = 46
    static let endRecordSize = 22
    static let maxEntryCount = 65_535
    static let maxEntrySize: UInt64 = 0xFFFF_FFFE

    static let methodStored: UInt16 = 0
    static let methodDeflate: UInt16 = 8
    static let flagUTF8: UInt16 = 1 << 11
    static let flagEncrypted: UInt16 = 1
    /// "Made by" host 3 (Unix), spec 2.0: tells readers the high external attributes are a Unix mode.
    static let versionMadeBy: UInt16 = (3 << 8) | 20

    static let fileMode: UInt32 = 0o100644
    static let directoryMode: UInt32 = 0o040755
    static let symlinkType: UInt32 = 0o120000
    static let typeMask: UInt32 = 0o170000
}

/// The timestamp every entry carries, so that the same input always gives the same bytes.
public struct ArchiveTimestamp: Sendable, Equatable {
    /// Seconds since 1970, UTC. Stored at the two-second precision of MS-DOS time.
    public let secondsSince1970: Int64

    /// 1980-01-01T00:00:00Z, the earliest time a ZIP entry can carry; used unless
    /// `SOURCE_DATE_EPOCH` says otherwise.
    public static let standard = ArchiveTimestamp(secondsSince1970: 315_532_800)

    public init(secondsSince1970: Int64) {
        // MS-DOS time spans 1980...2107; clamp instead of wrapping.
        self.secondsSince1970 = min(max(secondsSince1970, 315_532_800), 4_354_819_198)
    }

    /// `SOURCE_DATE_EPOCH` from the environment (reproducible-builds.org), else ``standard``.
    public static func fromEnvironment(_ environment: [String: String] = ProcessInfo.processInfo.environment) throws(ArchiveError) -> ArchiveTimestamp {
        guard let raw = environment["SOURCE_DATE_EPOCH"] else { return .standard }
        guard let seconds = Int64(raw.trimmingCharacters(in: .whitespaces)) else {
            throw .invalid("SOURCE_DATE_EPOCH='\(raw)' is not a whole number of seconds since 1970: set it to, for example, the last commit's time (git log -1 --format=%ct) or unset it")
        }
        return ArchiveTimestamp(secondsSince1970: seconds)
    }

    var date: Date { Date(timeIntervalSince1970: TimeInterval(secondsSince1970)) }

    /// The MS-DOS (time, date) pair, in UTC.
    var dos: (time: UInt16, date: UInt16) {
        let c = civil
        let time = UInt16(c.hour << 11 | c.minute << 5 | c.second / 2)
        let day = UInt16((c.year - 1980) << 9 | c.month << 5 | c.day)
        return (time, day)
    }

    /// ISO 8601 in UTC (`2023-11-14T22:13:20Z`), for the manifest.
    public var iso8601: String {
        let c = civil
        func digits(_ value: Int, _ count: Int) -> String {
            let text = String(value)
            return String(repeating: "0", count: max(0, count - text.count)) + text
        }
        return "\(digits(c.year, 4))-\(digits(c.month, 2))-\(digits(c.day, 2))T\(digits(c.hour, 2)):\(digits(c.minute, 2)):\(digits(c.second, 2))Z"
    }

    /// The UTC calendar fields, computed rather than asked of `Calendar` or `ISO8601DateFormatter`:
    /// the first use of either loads ICU's calendar and zone data, 20 ms of an incremental
    /// build's 0.5 s, on its critical path (`strace` showed the manifest waiting for it). The
    /// time is within 1980...2107 (the initializer clamps it), in the proleptic Gregorian
    /// calendar; the day arithmetic is Howard Hinnant's `civil_from_days`.
    var civil: (year: Int, month: Int, day: Int, hour: Int, minute: Int, second: Int) {
        let seconds = Int(secondsSince1970)
        let days = seconds / 86_400
        let time = seconds % 86_400
        let z = days + 719_468
        let era = z / 146_097
        let dayOfEra = z - era * 146_097
        let yearOfEra = (dayOfEra - dayOfEra / 1_460 + dayOfEra / 36_524 - dayOfEra / 146_096) / 365
        let dayOfYear = dayOfEra - (365 * yearOfEra + yearOfEra / 4 - yearOfEra / 100)
        let shiftedMonth = (5 * dayOfYear + 2) / 153
        let day = dayOfYear - (153 * shiftedMonth + 2) / 5 + 1
        let month = shiftedMonth < 10 ? shiftedMonth + 3 : shiftedMonth - 9
        let year = yearOfEra + era * 400 + (month <= 2 ? 1 : 0)
        return (year, month, day, time / 3_600, time % 3_600 / 60, time % 60)
    }
}

/// Appends little-endian integers, as every ZIP field is.
struct LittleEndianWriter {
    var bytes: [UInt8] = []

    init(capacity: Int = 64) { bytes.reserveCapacity(capacity) }

    mutating func u16(_ value: UInt16) {
        bytes.append(UInt8(truncatingIfNeeded: value))
        bytes.append(UInt8(truncatingIfNeeded: value >> 8))
    }

    mutating func u32(_ value: UInt32) {
        for shift in stride(from: 0, to: 32, by: 8) { bytes.append(UInt8(truncatingIfNeeded: value >> UInt32(shift))) }
    }

    mutating func append<S: Sequence>(_ other: S) where S.Element == UInt8 { bytes.append(contentsOf: other) }
}

/// Reads little-endian integers from a byte buffer, with bounds checked.
struct LittleEndianReader {
    let bytes: [UInt8]
    var position: Int

    init(_ bytes: [UInt8], at position: Int = 0) {
        self.bytes = bytes
        self.position = position
    }

    var remaining: Int { bytes.count - position }

    mutating func u16() throws(ArchiveError) -> UInt16 {
        guard remaining >= 2 else { throw .corrupt("the archive ends inside a header: it is truncated; download or build it again") }
        defer { position += 2 }
        return UInt16(bytes[position]) | UInt16(bytes[position + 1]) << 8
    }

    mutating func u32() throws(ArchiveError) -> UInt32 {
        guard remaining >= 4 else { throw .corrupt("the archive ends inside a header: it is truncated; download or build it again") }
        defer { position += 4 }
        return UInt32(bytes[position]) | UInt32(bytes[position + 1]) << 8
            | UInt32(bytes[position + 2]) << 16 | UInt32(bytes[position + 3]) << 24
    }

    mutating func take(_ count: Int) throws(ArchiveError) -> ArraySlice<UInt8> {
        guard count >= 0, remaining >= count else { throw .corrupt("the archive ends inside a header: it is truncated; download or build it again") }
        defer { position += count }
        return bytes[position..<position + count]
    }
}

/// One entry's header fields, shared by the local and central headers.
struct ZipEntryHeader: Equatable {
    var name: [UInt8]
    var method: UInt16
    var crc32: UInt32
    var compressedSize: UInt32
    var uncompressedSize: UInt32
    var mode: UInt32
    var localHeaderOffset: UInt32
    var dosTime: UInt16
    var dosDate: UInt16

    var isDirectory: Bool { name.last == UInt8(ascii: "/") }

    private var flags: UInt16 { name.allSatisfy { $0 < 0x80 } ? 0 : Zip.flagUTF8 }
    private var versionNeeded: UInt16 { method == Zip.methodDeflate ? 20 : 10 }

    var localHeader: [UInt8] {
        var w = LittleEndianWriter(capacity: Zip.localHeaderSize + name.count)
        w.u32(Zip.localHeaderSignature)
        w.u16(versionNeeded)
        w.u16(flags)
        w.u16(method)
        w.u16(dosTime)
        w.u16(dosDate)
        w.u32(crc32)
        w.u32(compressedSize)
        w.u32(uncompressedSize)
        w.u16(UInt16(name.count))
        w.u16(0)
        w.append(name)
        return w.bytes
    }

    var centralHeader: [UInt8] {
        var w = LittleEndianWriter(capacity: Zip.centralHeaderSize + name.count)
        w.u32(Zip.centralHeaderSignature)
        w.u16(Zip.versionMadeBy)
        w.u16(versionNeeded)
        w.u16(flags)
        w.u16(method)
        w.u16(dosTime)
        w.u16(dosDate)
        w.u32(crc32)
        w.u32(compressedSize)
        w.u32(uncompressedSize)
        w.u16(UInt16(name.count))
        w.u16(0)  // extra field length
        w.u16(0)  // comment length
        w.u16(0)  // disk number start
        w.u16(0)  // internal attributes
        w.u32(mode << 16 | (isDirectory ? 0x10 : 0))  // Unix mode, plus the MS-DOS directory bit
        w.u32(localHeaderOffset)
        w.append(name)
        return w.bytes
    }

    static func endRecord(entryCount: Int, centralSize: UInt32, centralOffset: UInt32) -> [UInt8] {
        var w = LittleEndianWriter(capacity: Zip.endRecordSize)
        w.u32(Zip.endOfCentralDirectorySignature)
        w.u16(0)
        w.u16(0)
        w.u16(UInt16(entryCount))
        w.u16(UInt16(entryCount))
        w.u32(centralSize)
        w.u32(centralOffset)
        w.u16(0)
        return w.bytes
    }
}

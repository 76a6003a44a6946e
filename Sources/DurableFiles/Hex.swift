/// Lowercase hexadecimal, as digests are written in manifests, ETags and journals.
///
/// Both functions are `@inlinable`: generic across the module boundary, they ran unspecialized,
/// through value witnesses per byte, and checking the 5,097 digests of a hash cache cost an
/// incremental build tens of milliseconds (perf, docs/performance.md).
public enum Hex {
    @usableFromInline static let digits: [UInt8] = Array("0123456789abcdef".utf8)

    @inlinable
    public static func encode<Bytes: Sequence<UInt8>>(_ bytes: Bytes) -> String {
        var out: [UInt8] = []
        out.reserveCapacity(bytes.underestimatedCount * 2)
        for byte in bytes {
            out.append(digits[Int(byte >> 4)])
            out.append(digits[Int(byte & 0xF)])
        }
        return String(decoding: out, as: UTF8.self)
    }

    /// Whether `bytes` spell a SHA-256 as ``encode(_:)`` writes one: 64 lowercase hex digits.
    /// Digests read back from files and paths are checked with it before they are trusted.
    @inlinable
    public static func isSHA256<Bytes: Collection<UInt8>>(_ bytes: Bytes) -> Bool {
        bytes.count == 64 && bytes.allSatisfy { ($0 >= 0x30 && $0 <= 0x39) || ($0 >= 0x61 && $0 <= 0x66) }
    }
}

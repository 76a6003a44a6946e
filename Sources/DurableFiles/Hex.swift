/// Lowercase hexadecimal, as digests are written in manifests, ETags and journals.
public enum Hex {
    private static let digits = Array("0123456789abcdef".utf8)

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
    public static func isSHA256<Bytes: Collection<UInt8>>(_ bytes: Bytes) -> Bool {
        bytes.count == 64 && bytes.allSatisfy { ($0 >= 0x30 && $0 <= 0x39) || ($0 >= 0x61 && $0 <= 0x66) }
    }
}

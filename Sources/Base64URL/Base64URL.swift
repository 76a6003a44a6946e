/// base64url (RFC 4648 §5) without padding, as JWS and download grants use.
///
/// Hand-written because Foundation decodes only the standard alphabet, and translating the
/// alphabet with string replacement costs more than the HMAC or signature it feeds, on every
/// content request.
public enum Base64URL {
    /// Decodes strict base64url; trailing `=` padding is tolerated. Nil for any other byte, an
    /// impossible length or non-zero leftover bits.
    @inlinable
    public static func decode<Bytes: Collection>(_ input: Bytes) -> [UInt8]? where Bytes.Element == UInt8 {
        var count = input.count
        var end = input.endIndex
        while count > 0, input[input.index(end, offsetBy: -1)] == UInt8(ascii: "=") {
            end = input.index(end, offsetBy: -1)
            count -= 1
        }
        guard count > 0, count % 4 != 1 else { return nil }
        var output = [UInt8]()
        output.reserveCapacity(count * 3 / 4)
        var accumulator: UInt32 = 0
        var bits: UInt32 = 0
        for byte in input[input.startIndex..<end] {
            let value = decodingTable[Int(byte)]
            guard value < 64 else { return nil }
            accumulator = (accumulator << 6 | UInt32(value)) & 0xFFFFFF
            bits += 6
            if bits >= 8 {
                bits -= 8
                output.append(UInt8(truncatingIfNeeded: accumulator >> bits))
            }
        }
        guard accumulator & ((1 << bits) - 1) == 0 else { return nil }
        return output
    }

    /// Encodes without padding.
    @inlinable
    public static func encode<Bytes: Sequence>(_ input: Bytes) -> String where Bytes.Element == UInt8 {
        var output = [UInt8]()
        var accumulator: UInt32 = 0
        var bits: UInt32 = 0
        for byte in input {
            accumulator = (accumulator << 8 | UInt32(byte)) & 0xFFFF
            bits += 8
            while bits >= 6 {
                bits -= 6
                output.append(alphabet[Int((accumulator >> bits) & 63)])
            }
        }
        if bits > 0 { output.append(alphabet[Int((accumulator << (6 - bits)) & 63)]) }
        return String(decoding: output, as: UTF8.self)
    }

    @usableFromInline
    static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".utf8)

    @usableFromInline
    static let decodingTable: [UInt8] = {
        var table = [UInt8](repeating: 255, count: 256)
        for (i, c) in alphabet.enumerated() { table[Int(c)] = UInt8(i) }
        return table
    }()
}

import Foundation

/// A compact JWS (`header.payload.signature`) split and decoded, not yet verified.
struct CompactJWS {
    struct Header: Decodable {
        let alg: String?
        let x5c: [String]?
    }

    let header: Header
    let payload: Data
    /// `header.payload` as ASCII: the bytes the signature covers.
    let signingInput: Data
    let signature: Data

    init(_ token: String, maxSize: Int) throws(VerificationError) {
        guard token.utf8.count <= maxSize else {
            throw VerificationError(.tooLarge, "the signed data is \(token.utf8.count) bytes, more than the \(maxSize) accepted: it is not a StoreKit signed payload")
        }
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3 else {
            throw VerificationError(.malformed, "the signed data is not a compact JWS (expected three base64url parts separated by '.', found \(parts.count))")
        }
        guard let headerBytes = base64URLDecode(parts[0]) else {
            throw VerificationError(.malformed, "the JWS header is not valid base64url")
        }
        guard let payload = base64URLDecode(parts[1]) else {
            throw VerificationError(.malformed, "the JWS payload is not valid base64url")
        }
        guard let signature = base64URLDecode(parts[2]) else {
            throw VerificationError(.malformed, "the JWS signature is not valid base64url")
        }
        do {
            header = try JSONDecoder().decode(Header.self, from: headerBytes)
        } catch {
            throw VerificationError(.malformed, "the JWS header is not a JSON object with string 'alg' and an 'x5c' array of strings")
        }
        self.payload = payload
        self.signature = signature
        signingInput = Data(token.utf8.prefix(parts[0].utf8.count + 1 + parts[1].utf8.count))
    }
}

/// Strict base64url (RFC 4648 §5) without padding, as JWS uses (trailing `=` tolerated).
/// Hand-written because Foundation only decodes standard base64, and rewriting the alphabet
/// through string replacement costs more than the signature check on a cache hit.
func base64URLDecode(_ text: Substring) -> Data? {
    var input = Array(text.utf8)
    while input.last == UInt8(ascii: "=") { input.removeLast() }
    guard !input.isEmpty, input.count % 4 != 1 else { return nil }
    var output = [UInt8]()
    output.reserveCapacity(input.count * 3 / 4)
    var accumulator: UInt32 = 0
    var bits = 0
    for byte in input {
        let value = base64URLTable[Int(byte)]
        guard value < 64 else { return nil }
        accumulator = accumulator << 6 | UInt32(value)
        bits += 6
        if bits >= 8 {
            bits -= 8
            output.append(UInt8(truncatingIfNeeded: accumulator >> UInt32(bits)))
        }
    }
    // Leftover bits must be zero for a canonical encoding.
    guard accumulator & ((1 << UInt32(bits)) - 1) == 0 else { return nil }
    return Data(output)
}

private let base64URLTable: [UInt8] = {
    var table = [UInt8](repeating: 255, count: 256)
    for (i, c) in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".utf8.enumerated() { table[Int(c)] = UInt8(i) }
    return table
}()

/// base64url without padding.
public func base64URLEncode<D: DataProtocol>(_ data: D) -> String {
    Data(data).base64EncodedString()
        .replacingOccurrences(of: "+", with: "-")
        .replacingOccurrences(of: "/", with: "_")
        .replacingOccurrences(of: "=", with: "")
}

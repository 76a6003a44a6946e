import Base64URL
import Foundation

/// A compact JWS (`header.payload.signature`) split and decoded, not yet verified.
struct CompactJWS {
    struct Header: Decodable {
        let alg: String?
        let x5c: [String]?
        /// RFC 7515 §4.1.11: extensions the recipient must understand. This verifier implements
        /// none, so any `crit` refuses the token.
        let crit: [String]?
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
        try Self.refuseDuplicates(in: headerBytes, what: "JWS header")
        do {
            header = try JSONDecoder().decode(Header.self, from: headerBytes)
        } catch {
            throw VerificationError(.malformed, "the JWS header is not a JSON object with string 'alg' and an 'x5c' array of strings")
        }
        if let crit = header.crit {
            throw VerificationError(
                .unsupportedCriticalHeader,
                "the JWS header marks \(crit.isEmpty ? "an empty list" : crit.joined(separator: ", ")) as critical ('crit'); this verifier implements no JWS extensions")
        }
        try Self.refuseDuplicates(in: payload, what: "payload")
        self.payload = payload
        self.signature = signature
        signingInput = Data(token.utf8.prefix(parts[0].utf8.count + 1 + parts[1].utf8.count))
    }
}

extension CompactJWS {
    /// Refuses JSON in which one object names a member twice (see ``DuplicateMembers``).
    static func refuseDuplicates(in bytes: Data, what: String) throws(VerificationError) {
        do {
            try DuplicateMembers.check(bytes)
        } catch .duplicate(let name) {
            throw VerificationError(.malformed, "the \(what) names '\(name.prefix(64))' twice in one object; readers disagree on such JSON, so it is refused")
        } catch {
            throw VerificationError(.malformed, "the \(what) is not valid JSON (RFC 8259)")
        }
    }
}

/// Strict base64url, as JWS uses.
func base64URLDecode(_ text: Substring) -> Data? {
    Base64URL.decode(text.utf8).map { Data($0) }
}

/// base64url without padding.
public func base64URLEncode<D: DataProtocol>(_ data: D) -> String {
    Base64URL.encode(data)
}

import Base64URL
import Crypto
import Foundation
import IAPProtocol

/// An App Store Connect API key as Apple issues it: a P-256 private key (the `.p8` file, PKCS#8
/// PEM), its key id, the team's issuer id, and the app it calls for.
public struct StoreAPIKey: Sendable {
    public let keyId: String
    public let issuerId: String
    public let bundleId: String
    public let privateKey: P256.Signing.PrivateKey

    public init(keyId: String, issuerId: String, bundleId: String, privateKey: P256.Signing.PrivateKey) {
        self.keyId = keyId
        self.issuerId = issuerId
        self.bundleId = bundleId
        self.privateKey = privateKey
    }

    /// Reads a `.p8` file (PKCS#8 or SEC1 PEM).
    public init(keyId: String, issuerId: String, bundleId: String, pemFile path: String) throws(StoreAPITokenError) {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw StoreAPITokenError(.invalidKey, "cannot read the API key file \(path): check the path (App Store Connect > Users and Access > Integrations > In-App Purchase)")
        }
        guard let key = try? P256.Signing.PrivateKey(pemRepresentation: String(decoding: data, as: UTF8.self)) else {
            throw StoreAPITokenError(.invalidKey, "\(path) is not a P-256 private key in PEM: pass the .p8 file App Store Connect (or iap-sandbox api-key) gave you")
        }
        self.init(keyId: keyId, issuerId: issuerId, bundleId: bundleId, privateKey: key)
    }

    /// The bearer token Apple documents ("Generating JSON Web Tokens for API requests"): ES256,
    /// `kid`, `typ: JWT`; `iss`, `iat`, `exp`, `aud: appstoreconnect-v1`, `bid`.
    public func bearerToken(now: Date = Date(), lifetime: TimeInterval = 20 * 60) -> String {
        struct Header: Encodable { let alg = "ES256", kid: String, typ = "JWT" }
        struct Claims: Encodable { let iss: String, iat: Int64, exp: Int64, aud: String, bid: String }
        let encoder = JSONEncoder()
        encoder.outputFormatting = .sortedKeys
        let iat = Int64(now.timeIntervalSince1970)
        // Encoding these fixed shapes cannot fail.
        let header = (try? encoder.encode(Header(kid: keyId))) ?? Data()
        let claims = (try? encoder.encode(Claims(iss: issuerId, iat: iat, exp: iat + Int64(lifetime), aud: StoreAPIToken.audience, bid: bundleId))) ?? Data()
        let signingInput = Base64URL.encode(header) + "." + Base64URL.encode(claims)
        let signature = (try? privateKey.signature(for: Data(signingInput.utf8)).rawRepresentation) ?? Data()
        return signingInput + "." + Base64URL.encode(signature)
    }
}

/// Why a bearer token was refused (the API answers 401 to all of them, as Apple's does).
public enum StoreAPITokenErrorCode: String, ErrorCode, CaseIterable {
    case missing, malformed
    case unsupportedAlgorithm = "unsupported-algorithm"
    case unknownKey = "unknown-key"
    case invalidSignature = "invalid-signature"
    case wrongIssuer = "wrong-issuer"
    case wrongAudience = "wrong-audience"
    case wrongBundleId = "wrong-bundle-id"
    case expired
    case lifetimeTooLong = "lifetime-too-long"
    case invalidKey = "invalid-key"
}

/// A refused token or an unreadable key, with a sentence saying which check failed.
public typealias StoreAPITokenError = CodedError<StoreAPITokenErrorCode>

/// Checks the bearer tokens the API's clients send.
public struct StoreAPIToken: Sendable {
    public static let audience = "appstoreconnect-v1"
    /// Apple refuses tokens that live longer than an hour.
    public static let maximumLifetime: TimeInterval = 3600
    /// Clock difference tolerated between client and server.
    public static let skew: TimeInterval = 60
    /// Far above a real token (~400 bytes); refuses before any parsing.
    static let maximumLength = 4096

    public let issuerId: String
    public let bundleId: String
    /// Public keys by key id.
    public let keys: [String: P256.Signing.PublicKey]

    public init(issuerId: String, bundleId: String, keys: [String: P256.Signing.PublicKey]) {
        self.issuerId = issuerId
        self.bundleId = bundleId
        self.keys = keys
    }

    /// Verifies an `Authorization` header value. `iat` is optional because Apple's own Python
    /// library leaves it out; then `exp` alone must lie within the hour.
    public func verify(authorization: String?, now: Date = Date()) throws(StoreAPITokenError) {
        guard let authorization, authorization.hasPrefix("Bearer ") else {
            throw StoreAPITokenError(.missing, "send Authorization: Bearer <JWT signed with your API key>")
        }
        let token = authorization.dropFirst("Bearer ".count)
        guard token.utf8.count <= Self.maximumLength else { throw StoreAPITokenError(.malformed, "the bearer token is longer than \(Self.maximumLength) bytes") }
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let headerBytes = Base64URL.decode(parts[0].utf8), let claimBytes = Base64URL.decode(parts[1].utf8),
            let signature = Base64URL.decode(parts[2].utf8)
        else { throw StoreAPITokenError(.malformed, "the bearer token is not a compact JWS of three base64url parts") }
        struct Header: Decodable { let alg: String?, kid: String? }
        struct Claims: Decodable { let iss: String?, iat: Int64?, exp: Int64?, aud: String?, bid: String? }
        guard let header = try? JSONDecoder().decode(Header.self, from: Data(headerBytes)),
            let claims = try? JSONDecoder().decode(Claims.self, from: Data(claimBytes))
        else { throw StoreAPITokenError(.malformed, "the bearer token's header or claims are not the JSON objects Apple documents") }
        guard header.alg == "ES256" else { throw StoreAPITokenError(.unsupportedAlgorithm, "the bearer token must be signed with ES256, not \(header.alg ?? "none")") }
        guard let kid = header.kid, let key = keys[kid] else {
            throw StoreAPITokenError(.unknownKey, "no API key with id \(header.kid ?? "(none)"): create one with iap-sandbox api-key")
        }
        let signingInput = Data(token.utf8.prefix(parts[0].utf8.count + 1 + parts[1].utf8.count))
        guard let ecdsa = try? P256.Signing.ECDSASignature(rawRepresentation: signature), key.isValidSignature(ecdsa, for: signingInput) else {
            throw StoreAPITokenError(.invalidSignature, "the bearer token's signature does not match API key \(kid)")
        }
        guard claims.iss == issuerId else { throw StoreAPITokenError(.wrongIssuer, "the token's iss is not this team's issuer id") }
        guard claims.aud == Self.audience else { throw StoreAPITokenError(.wrongAudience, "the token's aud must be \(Self.audience)") }
        guard claims.bid == bundleId else { throw StoreAPITokenError(.wrongBundleId, "the token's bid \(claims.bid ?? "(none)") is not \(bundleId)") }
        let seconds = Int64(now.timeIntervalSince1970)
        guard let exp = claims.exp, exp > seconds - Int64(Self.skew) else { throw StoreAPITokenError(.expired, "the bearer token has expired: make a new one") }
        let issued = claims.iat ?? seconds
        guard issued <= seconds + Int64(Self.skew), exp - issued <= Int64(Self.maximumLifetime), exp - seconds <= Int64(Self.maximumLifetime + Self.skew) else {
            throw StoreAPITokenError(.lifetimeTooLong, "the bearer token lives longer than an hour or is issued in the future")
        }
    }
}

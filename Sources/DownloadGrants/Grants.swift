import Base64URL
import Crypto
import Foundation
import IAPProtocol

/// What a download grant allows: one archive (by hash) of one product version, for one
/// transaction, until a time.
public struct Grant: Sendable, Equatable {
    public let transactionId: String
    public let productId: String
    public let contentVersion: String
    /// SHA-256 of the archive, lowercase hex.
    public let sha256: String
    /// Seconds since 1970.
    public let expiresAt: Int64

    public init(transactionId: String, productId: String, contentVersion: String, sha256: String, expiresAt: Int64) {
        self.transactionId = transactionId
        self.productId = productId
        self.contentVersion = contentVersion
        self.sha256 = sha256
        self.expiresAt = expiresAt
    }
}

/// Why a grant token was refused; every case answers 401.
public enum GrantError: Error, Sendable, Equatable, CustomStringConvertible {
    case malformed
    case unknownKey(String)
    case forged
    case expired(at: Int64)

    public var code: String {
        switch self {
        case .malformed: "grant-malformed"
        case .unknownKey: "grant-unknown-key"
        case .forged: "grant-forged"
        case .expired: "grant-expired"
        }
    }

    public var description: String {
        switch self {
        case .malformed: "the download URL's grant is malformed: ask POST /v1/downloads for a new one"
        case .unknownKey(let id): "the grant was signed with key '\(id)', which this server does not have: ask POST /v1/downloads for a new one"
        case .forged: "the grant's signature does not match: ask POST /v1/downloads for a new one"
        case .expired(let at): "the grant expired at \(Date(timeIntervalSince1970: TimeInterval(at)).formatted(.iso8601)): ask POST /v1/downloads for a new one"
        }
    }
}

/// HMAC-SHA256 grant tokens with a key id, so keys can rotate and several replicas that share the
/// key file accept each other's grants.
///
/// Token: `<keyId>.<base64url payload>.<base64url HMAC>`, path-safe. The payload is
/// `transactionId|productId|contentVersion|sha256|expiresAt`, plain text rather than JSON because
/// it is checked on every content request; none of its fields can contain `|`.
public struct GrantKeyRing: Sendable {
    public let activeKeyId: String
    private let keys: [String: SymmetricKey]
    /// An HMAC already keyed for each key, copied for each check: keying hashes two blocks, on
    /// every content request.
    private let keyed: [String: HMAC<SHA256>]

    /// A ring that mints with `activeKeyId` and accepts tokens of any of `keys` (rotation: add
    /// the new key, make it active, drop the old one once its tokens have expired). The active
    /// key must be in `keys`.
    public init(activeKeyId: String, keys: [String: SymmetricKey]) {
        precondition(keys[activeKeyId] != nil, "the active key must be in the ring")
        self.activeKeyId = activeKeyId
        self.keys = keys
        keyed = keys.mapValues { HMAC<SHA256>(key: $0) }
    }

    /// A ring with one fresh 256-bit key.
    public static func generate(keyId: String = "k1") -> GrantKeyRing {
        GrantKeyRing(activeKeyId: keyId, keys: [keyId: SymmetricKey(size: .bits256)])
    }

    /// The token for `grant`, signed with the active key; it is valid until `grant.expiresAt`.
    public func mint(_ grant: Grant) -> String {
        let payload = Base64URL.encode(
            [grant.transactionId, grant.productId, grant.contentVersion, grant.sha256, String(grant.expiresAt)]
                .joined(separator: "|").utf8)
        let prefix = activeKeyId + "." + payload
        var hmac = keyed[activeKeyId]!
        hmac.update(data: Data(prefix.utf8))
        let mac = hmac.finalize()
        return prefix + "." + Base64URL.encode(mac)
    }

    /// Checks the signature (in constant time) and expiry, and returns the grant. Works on UTF-8
    /// bytes throughout: it runs on every content request.
    public func verify(_ token: Substring, now: Date = Date()) -> Result<Grant, GrantError> {
        guard token.utf8.count <= 2048 else { return .failure(.malformed) }
        // One copy into an array: generic code over Substring's UTF-8 view is slow byte by byte.
        let bytes = Array(token.utf8)
        let parts = bytes.split(separator: UInt8(ascii: "."), maxSplits: 3, omittingEmptySubsequences: false)
        guard parts.count == 3 else { return .failure(.malformed) }
        let keyId = String(decoding: parts[0], as: UTF8.self)
        guard var hmac = keyed[keyId] else { return .failure(.unknownKey(String(keyId.prefix(16)))) }
        guard let mac = Base64URL.decode(parts[2]), let payload = Base64URL.decode(parts[1]) else { return .failure(.malformed) }
        hmac.update(data: bytes[bytes.startIndex..<parts[1].endIndex])
        // HashedAuthenticationCode's == compares in constant time.
        guard hmac.finalize() == mac else {
            return .failure(.forged)
        }
        let fields = payload.split(separator: UInt8(ascii: "|"), maxSplits: 5, omittingEmptySubsequences: false)
        guard fields.count == 5, let expires = Int64(String(decoding: fields[4], as: UTF8.self)) else { return .failure(.malformed) }
        guard Int64(now.timeIntervalSince1970) < expires else { return .failure(.expired(at: expires)) }
        return .success(
            Grant(
                transactionId: String(decoding: fields[0], as: UTF8.self), productId: String(decoding: fields[1], as: UTF8.self),
                contentVersion: String(decoding: fields[2], as: UTF8.self), sha256: String(decoding: fields[3], as: UTF8.self),
                expiresAt: expires))
    }

    /// Loads the key file, creating it (mode 0600) with one fresh key when missing. Format and
    /// rotation: ``GrantKeyFile``.
    public static func loadOrCreate(path: String) throws(GrantKeyFileError) -> GrantKeyRing {
        try GrantKeyFile.loadOrCreate(path: path).ring
    }

    /// The ids of the keys it accepts, in order.
    public var keyIds: [String] { keys.keys.sorted { $0.compare($1, options: .numeric) == .orderedAscending } }
}

/// What is wrong with the grant key file.
public enum GrantKeyFileErrorCode: String, ErrorCode {
    /// The file is not a key file, or a key in it is unusable.
    case invalid
    /// The file cannot be read or created.
    case io
    /// A rotation step asked for before it is safe: a key activated before the servers can have
    /// read it, or retired while grants it signed are still valid.
    case tooSoon = "too-soon"
}

public typealias GrantKeyFileError = CodedError<GrantKeyFileErrorCode>

import Crypto
import Foundation
import PurchaseVerification
import SwiftASN1
import X509

/// What the sandbox chain looks like. The defaults make a chain that verifies like Apple's;
/// tests of verifiers change one property to build a chain that must fail exactly one check.
public struct ChainProfile: Sendable {
    public var intermediateHasMarker = true
    public var leafHasMarker = true
    public var leafNotBefore: Date
    public var leafNotAfter: Date
    public var organization = "iap-content sandbox"

    public init(now: Date = Date()) {
        leafNotBefore = now.addingTimeInterval(-86_400)
        leafNotAfter = now.addingTimeInterval(2 * 365 * 86_400)
    }
}

/// A root → intermediate → leaf chain of P-256 keys carrying Apple's marker extensions, playing
/// the role of Xcode's StoreKit testing certificate.
public struct SandboxCertificateAuthority: Sendable {
    public let rootKey: P256.Signing.PrivateKey
    public let root: Certificate
    public let intermediateKey: P256.Signing.PrivateKey
    public let intermediate: Certificate
    public let leafKey: P256.Signing.PrivateKey
    public let leaf: Certificate

    public init(
        rootKey: P256.Signing.PrivateKey, root: Certificate, intermediateKey: P256.Signing.PrivateKey,
        intermediate: Certificate, leafKey: P256.Signing.PrivateKey, leaf: Certificate
    ) {
        self.rootKey = rootKey
        self.root = root
        self.intermediateKey = intermediateKey
        self.intermediate = intermediate
        self.leafKey = leafKey
        self.leaf = leaf
    }

    /// Makes a fresh chain.
    public static func generate(profile: ChainProfile = ChainProfile()) throws -> SandboxCertificateAuthority {
        let rootKey = P256.Signing.PrivateKey()
        let intermediateKey = P256.Signing.PrivateKey()
        let leafKey = P256.Signing.PrivateKey()
        let rootName = try DistinguishedName {
            CommonName("iap-sandbox Root CA")
            OrganizationName(profile.organization)
        }
        let intermediateName = try DistinguishedName {
            CommonName("iap-sandbox Worldwide Developer Relations CA")
            OrganizationName(profile.organization)
        }
        let leafName = try DistinguishedName {
            CommonName("iap-sandbox StoreKit Signing")
            OrganizationName(profile.organization)
        }
        let chain = try ChainBuilder.build(
            keys: (.init(rootKey), .init(intermediateKey), .init(leafKey)),
            names: .init(root: rootName, intermediate: intermediateName, leaf: leafName), signatureAlgorithm: .ecdsaWithSHA256,
            intermediateMarker: profile.intermediateHasMarker ? AppleMarkerOID.intermediate : nil,
            leafMarker: profile.leafHasMarker ? AppleMarkerOID.leaf : nil, leafNotBefore: profile.leafNotBefore, leafNotAfter: profile.leafNotAfter)
        let (root, intermediate, leaf) = chain
        return SandboxCertificateAuthority(
            rootKey: rootKey, root: root, intermediateKey: intermediateKey,
            intermediate: intermediate, leafKey: leafKey, leaf: leaf)
    }

    /// The certificates as base64 DER, leaf first, as the JWS `x5c` header carries them.
    public var x5c: [String] {
        [leaf, intermediate, root].map { Data(derBytes($0)).base64EncodedString() }
    }

    /// Signs a payload as a compact JWS with `alg` ES256 and this chain in `x5c`.
    public func sign<T: Encodable>(_ payload: T) throws -> String {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        let header = try JSONSerialization.data(withJSONObject: ["alg": "ES256", "x5c": x5c], options: [.sortedKeys, .withoutEscapingSlashes])
        return try signCompact(header: header, payload: encoder.encode(payload))
    }

    /// Signs raw header and payload bytes with the leaf key: for building tokens that must fail a
    /// particular check (another `alg`, other certificates).
    public func signCompact(header: Data, payload: Data) throws -> String {
        let input = base64URLEncode(header) + "." + base64URLEncode(payload)
        let signature = try leafKey.signature(for: Data(input.utf8))
        return input + "." + base64URLEncode(signature.rawRepresentation)
    }
}

/// DER bytes of a certificate.
public func derBytes(_ certificate: Certificate) -> [UInt8] {
    var serializer = DER.Serializer()
    // Serializing a certificate that was parsed or built successfully cannot fail.
    try! serializer.serialize(certificate)
    return serializer.serializedBytes
}

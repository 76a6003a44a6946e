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
        let now = Date()
        // CA certificates start before the leaf, so a back-dated leaf (tests) still has a valid chain.
        let caNotBefore = min(now.addingTimeInterval(-2 * 86_400), profile.leafNotBefore.addingTimeInterval(-86_400))
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
        // DER NULL, the value Apple's marker extensions carry.
        let null: ArraySlice<UInt8> = [0x05, 0x00]
        // Key identifiers as in Apple's chain (and as RFC 5280 §4.2.1.1-2 and OpenSSL's strict
        // mode expect): each certificate names its own key and, below the root, its issuer's.
        let rootKeyId = SubjectKeyIdentifier(hash: Certificate.PublicKey(rootKey.publicKey))
        let intermediateKeyId = SubjectKeyIdentifier(hash: Certificate.PublicKey(intermediateKey.publicKey))
        let leafKeyId = SubjectKeyIdentifier(hash: Certificate.PublicKey(leafKey.publicKey))
        let root = try Certificate(
            version: .v3, serialNumber: .init(), publicKey: .init(rootKey.publicKey),
            notValidBefore: caNotBefore, notValidAfter: now.addingTimeInterval(20 * 365 * 86_400),
            issuer: rootName, subject: rootName, signatureAlgorithm: .ecdsaWithSHA256,
            extensions: try Certificate.Extensions {
                Critical(BasicConstraints.isCertificateAuthority(maxPathLength: nil))
                Critical(KeyUsage(keyCertSign: true, cRLSign: true))
                rootKeyId
            },
            issuerPrivateKey: .init(rootKey))
        var intermediateExtensions = try Certificate.Extensions {
            Critical(BasicConstraints.isCertificateAuthority(maxPathLength: 0))
            Critical(KeyUsage(keyCertSign: true, cRLSign: true))
            AuthorityKeyIdentifier(keyIdentifier: rootKeyId.keyIdentifier)
            intermediateKeyId
        }
        if profile.intermediateHasMarker {
            try intermediateExtensions.append(Certificate.Extension(oid: AppleMarkerOID.intermediate, critical: false, value: null))
        }
        let intermediate = try Certificate(
            version: .v3, serialNumber: .init(), publicKey: .init(intermediateKey.publicKey),
            notValidBefore: caNotBefore, notValidAfter: now.addingTimeInterval(10 * 365 * 86_400),
            issuer: rootName, subject: intermediateName, signatureAlgorithm: .ecdsaWithSHA256,
            extensions: intermediateExtensions, issuerPrivateKey: .init(rootKey))
        var leafExtensions = try Certificate.Extensions {
            Critical(BasicConstraints.notCertificateAuthority)
            Critical(KeyUsage(digitalSignature: true))
            AuthorityKeyIdentifier(keyIdentifier: intermediateKeyId.keyIdentifier)
            leafKeyId
        }
        if profile.leafHasMarker {
            try leafExtensions.append(Certificate.Extension(oid: AppleMarkerOID.leaf, critical: false, value: null))
        }
        let leaf = try Certificate(
            version: .v3, serialNumber: .init(), publicKey: .init(leafKey.publicKey),
            notValidBefore: profile.leafNotBefore, notValidAfter: profile.leafNotAfter,
            issuer: intermediateName, subject: leafName, signatureAlgorithm: .ecdsaWithSHA256,
            extensions: leafExtensions, issuerPrivateKey: .init(intermediateKey))
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

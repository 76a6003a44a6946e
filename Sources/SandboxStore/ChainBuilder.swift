import Foundation
import SwiftASN1
import X509

/// Builds root → intermediate → leaf the way Apple's chains are made, for both sandbox chains
/// (P-256 for signed transactions, RSA for receipts): key identifiers on every certificate (as
/// RFC 5280 §4.2.1.1-2 and OpenSSL's strict mode expect), critical basic constraints and key
/// usage, and Apple's marker extensions where given.
enum ChainBuilder {
    struct Names {
        let root: DistinguishedName
        let intermediate: DistinguishedName
        let leaf: DistinguishedName
    }

    /// - Parameters:
    ///   - intermediateMarker, leafMarker: Apple's marker extension for each, or nil to leave it out.
    static func build(
        keys: (root: Certificate.PrivateKey, intermediate: Certificate.PrivateKey, leaf: Certificate.PrivateKey), names: Names,
        signatureAlgorithm: Certificate.SignatureAlgorithm, intermediateMarker: ASN1ObjectIdentifier?, leafMarker: ASN1ObjectIdentifier?,
        leafNotBefore: Date, leafNotAfter: Date, now: Date = Date()
    ) throws -> (root: Certificate, intermediate: Certificate, leaf: Certificate) {
        // CA certificates start before the leaf, so a back-dated leaf (tests) still has a valid chain.
        let caNotBefore = min(now.addingTimeInterval(-2 * 86_400), leafNotBefore.addingTimeInterval(-86_400))
        // DER NULL, the value Apple's marker extensions carry.
        let null: ArraySlice<UInt8> = [0x05, 0x00]
        let rootKeyId = SubjectKeyIdentifier(hash: keys.root.publicKey)
        let intermediateKeyId = SubjectKeyIdentifier(hash: keys.intermediate.publicKey)
        let leafKeyId = SubjectKeyIdentifier(hash: keys.leaf.publicKey)
        let root = try Certificate(
            version: .v3, serialNumber: .init(), publicKey: keys.root.publicKey,
            notValidBefore: caNotBefore, notValidAfter: now.addingTimeInterval(20 * 365 * 86_400),
            issuer: names.root, subject: names.root, signatureAlgorithm: signatureAlgorithm,
            extensions: try Certificate.Extensions {
                Critical(BasicConstraints.isCertificateAuthority(maxPathLength: nil))
                Critical(KeyUsage(keyCertSign: true, cRLSign: true))
                rootKeyId
            },
            issuerPrivateKey: keys.root)
        var intermediateExtensions = try Certificate.Extensions {
            Critical(BasicConstraints.isCertificateAuthority(maxPathLength: 0))
            Critical(KeyUsage(keyCertSign: true, cRLSign: true))
            AuthorityKeyIdentifier(keyIdentifier: rootKeyId.keyIdentifier)
            intermediateKeyId
        }
        if let intermediateMarker { try intermediateExtensions.append(Certificate.Extension(oid: intermediateMarker, critical: false, value: null)) }
        let intermediate = try Certificate(
            version: .v3, serialNumber: .init(), publicKey: keys.intermediate.publicKey,
            notValidBefore: caNotBefore, notValidAfter: now.addingTimeInterval(10 * 365 * 86_400),
            issuer: names.root, subject: names.intermediate, signatureAlgorithm: signatureAlgorithm,
            extensions: intermediateExtensions, issuerPrivateKey: keys.root)
        var leafExtensions = try Certificate.Extensions {
            Critical(BasicConstraints.notCertificateAuthority)
            Critical(KeyUsage(digitalSignature: true))
            AuthorityKeyIdentifier(keyIdentifier: intermediateKeyId.keyIdentifier)
            leafKeyId
        }
        if let leafMarker { try leafExtensions.append(Certificate.Extension(oid: leafMarker, critical: false, value: null)) }
        let leaf = try Certificate(
            version: .v3, serialNumber: .init(), publicKey: keys.leaf.publicKey,
            notValidBefore: leafNotBefore, notValidAfter: leafNotAfter,
            issuer: names.intermediate, subject: names.leaf, signatureAlgorithm: signatureAlgorithm,
            extensions: leafExtensions, issuerPrivateKey: keys.intermediate)
        return (root, intermediate, leaf)
    }
}

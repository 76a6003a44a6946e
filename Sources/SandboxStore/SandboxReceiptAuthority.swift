import COpenSSL
import Crypto
import Foundation
import PurchaseVerification
import SwiftASN1
import X509
import _CryptoExtras

/// What the receipt chain looks like; tests change one property to build a chain that must fail
/// exactly one check, or one that has expired since it signed.
public struct ReceiptChainProfile: Sendable {
    public var intermediateHasMarker = true
    public var leafHasMarker = true
    public var leafNotBefore: Date
    public var leafNotAfter: Date

    public init(now: Date = Date()) {
        leafNotBefore = now.addingTimeInterval(-86_400)
        leafNotAfter = now.addingTimeInterval(2 * 365 * 86_400)
    }
}

/// An RSA root → "Worldwide Developer Relations" intermediate → receipt-signing leaf, shaped
/// like Apple's receipt chain (Apple Inc. Root → WWDR → "Mac App Store and iTunes Store Receipt
/// Signing"), with Apple's marker extensions; it signs app receipts as PKCS#7 SignedData in BER
/// with indefinite lengths, as Apple's are.
public struct SandboxReceiptAuthority: Sendable {
    public let root: Certificate
    public let intermediate: Certificate
    public let leaf: Certificate
    /// The leaf's private key, PKCS#8 PEM (what libcrypto signs with).
    let leafKeyPEM: String
    let rootKeyPEM: String
    let intermediateKeyPEM: String

    static let receiptLeafMarker: ASN1ObjectIdentifier = [1, 2, 840, 113635, 100, 6, 11, 1]
    static let wwdrMarker: ASN1ObjectIdentifier = [1, 2, 840, 113635, 100, 6, 2, 1]

    /// Makes a fresh chain (three 2048-bit RSA keys).
    public static func generate(profile: ReceiptChainProfile = ReceiptChainProfile()) throws -> SandboxReceiptAuthority {
        let rootKey = try _RSA.Signing.PrivateKey(keySize: .bits2048)
        let intermediateKey = try _RSA.Signing.PrivateKey(keySize: .bits2048)
        let leafKey = try _RSA.Signing.PrivateKey(keySize: .bits2048)
        let rootName = try DistinguishedName {
            CountryName("US")
            OrganizationName("iap-content sandbox")
            OrganizationalUnitName("Sandbox Certification Authority")
            CommonName("iap-sandbox Receipt Root CA")
        }
        let intermediateName = try DistinguishedName {
            CountryName("US")
            OrganizationName("iap-content sandbox")
            OrganizationalUnitName("Sandbox Certification Authority")
            CommonName("iap-sandbox Worldwide Developer Relations Certification Authority")
        }
        let leafName = try DistinguishedName {
            CountryName("US")
            OrganizationName("iap-content sandbox")
            CommonName("iap-sandbox Mac App Store and iTunes Store Receipt Signing")
        }
        let (root, intermediate, leaf) = try ChainBuilder.build(
            keys: (.init(rootKey), .init(intermediateKey), .init(leafKey)),
            names: .init(root: rootName, intermediate: intermediateName, leaf: leafName), signatureAlgorithm: .sha256WithRSAEncryption,
            intermediateMarker: profile.intermediateHasMarker ? wwdrMarker : nil, leafMarker: profile.leafHasMarker ? receiptLeafMarker : nil,
            leafNotBefore: profile.leafNotBefore, leafNotAfter: profile.leafNotAfter)
        return SandboxReceiptAuthority(
            root: root, intermediate: intermediate, leaf: leaf, leafKeyPEM: leafKey.pkcs8PEMRepresentation,
            rootKeyPEM: rootKey.pkcs8PEMRepresentation, intermediateKeyPEM: intermediateKey.pkcs8PEMRepresentation)
    }

    /// Signs a receipt payload: PKCS#7 SignedData (BER, indefinite lengths), the leaf, the
    /// intermediate and the root included as Apple includes them, digest SHA-256 (or SHA-1, as
    /// receipts before 2016 were).
    public func sign(payload: [UInt8], sha1: Bool = false, certificates: [Certificate]? = nil) throws -> [UInt8] {
        let leafDER = derBytes(leaf)
        let extras = (certificates ?? [intermediate, root]).map(derBytes)
        let extraBytes = extras.flatMap { $0 }
        let extraLengths = extras.map { $0.count }
        var out: UnsafeMutablePointer<UInt8>?
        var outLength = 0
        let ok = payload.withUnsafeBufferPointer { content in
            leafDER.withUnsafeBufferPointer { leaf in
                extraBytes.withUnsafeBufferPointer { extra in
                    extraLengths.withUnsafeBufferPointer { lengths in
                        iap_pkcs7_sign(
                            content.baseAddress, content.count, leafKeyPEM, leaf.baseAddress, leaf.count, extra.baseAddress, lengths.baseAddress,
                            Int32(extras.count), sha1 ? 1 : 0, &out, &outLength)
                    }
                }
            }
        }
        guard ok == 1, let out else { throw SandboxError(.io, "libcrypto could not sign the receipt") }
        defer { iap_free(out) }
        return Array(UnsafeBufferPointer(start: out, count: outLength))
    }
}

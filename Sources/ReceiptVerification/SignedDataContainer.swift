import SwiftASN1

/// The parts of a PKCS#7 SignedData the warm path of ``ReceiptVerifier`` needs, read with
/// swift-asn1 (BER, indefinite lengths, a constructed content OCTET STRING).
///
/// Why not libcrypto here too: OpenSSL 3.0's `d2i_PKCS7` parses every certificate in the
/// container, and each certificate's public key goes through the provider decoders: about
/// 0.3 ms a certificate, 1.1 ms a receipt on this machine, which alone caps verification below
/// 1,000 receipts a second. A receipt whose exact certificate set was verified before by the
/// full libcrypto path needs none of that: its signature is checked by libcrypto with the key
/// kept from that verification. Anything this reader does not take falls back to the full path.
struct SignedDataContainer {
    /// The signed payload (the `data` content's octets, joined if sent in chunks).
    let content: [UInt8]
    /// Each certificate's encoding, in order.
    let certificates: [ArraySlice<UInt8>]
    /// The signer's `issuerAndSerialNumber`, as encoded.
    let issuerAndSerial: ArraySlice<UInt8>
    let digestAlgorithm: ASN1ObjectIdentifier
    /// The SignedData's own list of digest algorithms.
    let digestAlgorithms: [ASN1ObjectIdentifier]
    let signatureAlgorithm: ASN1ObjectIdentifier
    let signature: ArraySlice<UInt8>
    let hasSignedAttributes: Bool

    static let signedData: ASN1ObjectIdentifier = [1, 2, 840, 113549, 1, 7, 2]
    static let data: ASN1ObjectIdentifier = [1, 2, 840, 113549, 1, 7, 1]
    static let sha1: ASN1ObjectIdentifier = [1, 3, 14, 3, 2, 26]
    static let sha256: ASN1ObjectIdentifier = [2, 16, 840, 1, 101, 3, 4, 2, 1]
    static let rsaEncryption: ASN1ObjectIdentifier = [1, 2, 840, 113549, 1, 1, 1]
    static let sha1WithRSA: ASN1ObjectIdentifier = [1, 2, 840, 113549, 1, 1, 5]
    static let sha256WithRSA: ASN1ObjectIdentifier = [1, 2, 840, 113549, 1, 1, 11]

    struct Unsupported: Error {}

    private static let explicit0 = ASN1Identifier(tagWithNumber: 0, tagClass: .contextSpecific)
    private static let implicit1 = ASN1Identifier(tagWithNumber: 1, tagClass: .contextSpecific)

    init(_ bytes: [UInt8]) throws {
        let root = try BER.parse(bytes)
        guard root.identifier == .sequence, case .constructed(let info) = root.content else { throw Unsupported() }
        var parts = info.makeIterator()
        guard let typeNode = parts.next(), try ASN1ObjectIdentifier(berEncoded: typeNode) == Self.signedData,
            let wrapper = parts.next(), wrapper.identifier == Self.explicit0, parts.next() == nil,
            case .constructed(let wrapped) = wrapper.content
        else { throw Unsupported() }
        var inner = wrapped.makeIterator()
        guard let signed = inner.next(), inner.next() == nil, signed.identifier == .sequence, case .constructed(let fields) = signed.content else {
            throw Unsupported()
        }
        var field = fields.makeIterator()
        guard let version = field.next(), version.identifier == .integer, let digestSet = field.next(), digestSet.identifier == .set,
            case .constructed(let digestList) = digestSet.content, let contentInfo = field.next(), contentInfo.identifier == .sequence, case .constructed(let contentParts) = contentInfo.content
        else { throw Unsupported() }
        // The content: `data`, attached.
        var contentIterator = contentParts.makeIterator()
        guard let contentType = contentIterator.next(), try ASN1ObjectIdentifier(berEncoded: contentType) == Self.data,
            let explicitContent = contentIterator.next(), explicitContent.identifier == Self.explicit0, contentIterator.next() == nil,
            case .constructed(let octetsWrapper) = explicitContent.content
        else { throw Unsupported() }
        var octetsIterator = octetsWrapper.makeIterator()
        guard let octets = octetsIterator.next(), octetsIterator.next() == nil, octets.identifier == .octetString else { throw Unsupported() }
        switch octets.content {
        case .primitive(let bytes): content = Array(bytes)
        case .constructed(let chunks):
            var joined: [UInt8] = []
            for chunk in chunks {
                guard chunk.identifier == .octetString, case .primitive(let bytes) = chunk.content else { throw Unsupported() }
                joined += bytes
            }
            content = joined
        }
        // Certificates, then optional CRLs, then exactly one SignerInfo.
        var next = field.next()
        var certificates: [ArraySlice<UInt8>] = []
        if let node = next, node.identifier == Self.explicit0 {
            guard case .constructed(let certs) = node.content else { throw Unsupported() }
            for cert in certs {
                guard cert.identifier == .sequence else { throw Unsupported() }
                certificates.append(cert.encodedBytes)
            }
            next = field.next()
        }
        if let node = next, node.identifier == Self.implicit1 { next = field.next() }
        guard let signerInfos = next, signerInfos.identifier == .set, field.next() == nil, case .constructed(let infos) = signerInfos.content else {
            throw Unsupported()
        }
        var infoIterator = infos.makeIterator()
        guard let signer = infoIterator.next(), infoIterator.next() == nil, signer.identifier == .sequence, case .constructed(let signerFields) = signer.content
        else { throw Unsupported() }
        var s = signerFields.makeIterator()
        guard let signerVersion = s.next(), signerVersion.identifier == .integer, let issuerSerial = s.next(), issuerSerial.identifier == .sequence,
            let digest = s.next()
        else { throw Unsupported() }
        var after = s.next()
        var signedAttributes = false
        if let node = after, node.identifier == Self.explicit0 {
            signedAttributes = true
            after = s.next()
        }
        guard let signatureAlgorithmNode = after, let signatureNode = s.next(), signatureNode.identifier == .octetString,
            case .primitive(let signatureBytes) = signatureNode.content
        else { throw Unsupported() }
        self.certificates = certificates
        self.issuerAndSerial = issuerSerial.encodedBytes
        self.digestAlgorithm = try Self.algorithm(digest)
        self.digestAlgorithms = try digestList.map { try Self.algorithm($0) }
        self.signatureAlgorithm = try Self.algorithm(signatureAlgorithmNode)
        self.signature = signatureBytes
        self.hasSignedAttributes = signedAttributes
    }

    private static func algorithm(_ node: ASN1Node) throws -> ASN1ObjectIdentifier {
        guard node.identifier == .sequence, case .constructed(let parts) = node.content, let first = parts.first(where: { _ in true }) else {
            throw Unsupported()
        }
        return try ASN1ObjectIdentifier(berEncoded: first)
    }
}

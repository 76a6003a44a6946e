import COpenSSL
import Crypto
import Foundation
import PurchaseVerification
import Synchronization
import X509

import enum SwiftASN1.DER

/// Verifies StoreKit 1 app receipts locally, as Apple's receipt validation guide does with
/// OpenSSL: the PKCS#7 container (BER, indefinite lengths allowed), exactly one signer whose
/// chain runs leaf → Apple Worldwide Developer Relations intermediate → a trusted root, valid at
/// the receipt's creation date (Apple's intermediates expired and rotated; a receipt signed
/// before a rotation stays valid), Apple's receipt-signing marker on the leaf and WWDR marker
/// on the intermediate, the signature (SHA-1 or SHA-256) over the payload; then the payload's
/// bundle id and environment.
///
/// libcrypto (the system's OpenSSL) does the PKCS#7 work because no Swift package here parses
/// or verifies PKCS#7; swift-asn1 reads the payload. A receipt whose exact certificate set was
/// verified before, dated inside that chain's validity, takes the warm path: libcrypto checks its
/// signature with the kept key, and the chain is not built again (see ``SignedDataContainer``).
public final class ReceiptVerifier: @unchecked Sendable {
    // @unchecked: the X509_STORE is built in init and only read afterwards; OpenSSL locks it
    // internally for concurrent verifications.
    private let store: OpaquePointer
    /// The apps whose receipts are accepted.
    public let bundles: BundlePolicy
    public let environments: EnvironmentPolicy
    /// Receipts larger than this are refused before parsing (real ones are a few KiB to ~1 MiB).
    public static let maximumSize = 4 << 20
    /// A real receipt carries three certificates; a few more are tolerated, hundreds are not.
    static let maximumCertificates: Int32 = 8
    static let leafMarker = "1.2.840.113635.100.6.11.1"
    static let intermediateMarker = "1.2.840.113635.100.6.2.1"

    /// A signer whose chain libcrypto validated: its key, and the dates the chain is valid at.
    private final class VerifiedSigner: @unchecked Sendable {
        // @unchecked: the EVP_PKEY is only read (verifications) after this is made.
        let key: OpaquePointer
        let issuerAndSerial: [UInt8]
        let from: Date
        let until: Date
        init(key: OpaquePointer, issuerAndSerial: [UInt8], from: Date, until: Date) {
            self.key = key
            self.issuerAndSerial = issuerAndSerial
            self.from = from
            self.until = until
        }
        deinit { iap_pkey_free(key) }
    }

    /// Keyed by SHA-256 over the container's certificates: only the exact set verified before.
    private let signers = Mutex<[SHA256Digest: VerifiedSigner]>([:])
    private static let signerCacheLimit = 64

    /// - Parameter trustRoots: roots besides Apple Inc. Root Certificate (always trusted), such
    ///   as the sandbox's `receipt-root.cer`.
    public convenience init(bundleId: String, trustRoots: [Certificate] = [], environments: EnvironmentPolicy = .production) throws(VerificationError) {
        try self.init(bundles: BundlePolicy(bundleId), trustRoots: trustRoots, environments: environments)
    }

    /// - Parameter trustRoots: roots besides Apple Inc. Root Certificate (always trusted), such
    ///   as the sandbox's `receipt-root.cer`.
    public init(bundles: BundlePolicy, trustRoots: [Certificate] = [], environments: EnvironmentPolicy = .production) throws(VerificationError) {
        guard let store = iap_store_new() else { throw VerificationError(.untrustedChain, "cannot create a certificate store (out of memory)") }
        self.store = store
        self.bundles = bundles
        self.environments = environments
        for root in [AppleRoots.appleIncRoot] + trustRoots {
            var serializer = DER.Serializer()
            guard (try? serializer.serialize(root)) != nil else { throw VerificationError(.untrustedChain, "a trust root cannot be encoded") }
            let der = serializer.serializedBytes
            guard der.withUnsafeBufferPointer({ iap_store_add_der(store, $0.baseAddress, $0.count) }) == 1 else {
                throw VerificationError(.untrustedChain, "a trust root is not an X.509 certificate OpenSSL reads")
            }
        }
    }

    deinit { iap_store_free(store) }

    /// Verifies a receipt given as base64 (what apps send and `verifyReceipt` takes).
    public func verify(base64 text: String, now: Date = Date()) throws(VerificationError) -> AppReceipt {
        guard text.utf8.count <= Self.maximumSize / 3 * 4 + 4 else {
            throw VerificationError(.tooLarge, "the receipt is larger than \(Self.maximumSize) bytes")
        }
        guard let data = Data(base64Encoded: text, options: .ignoreUnknownCharacters), !data.isEmpty else {
            throw VerificationError(.malformed, "the receipt is not base64: send the bytes of Bundle.main.appStoreReceiptURL, base64-encoded")
        }
        return try verify(Array(data), now: now)
    }

    /// Verifies a receipt's bytes and returns its payload; does not judge the purchases (that is
    /// `entitlement(for:configuration:)`, over ``AppReceipt/transactions``).
    public func verify(_ bytes: [UInt8], now: Date = Date()) throws(VerificationError) -> AppReceipt {
        guard bytes.count <= Self.maximumSize else { throw VerificationError(.tooLarge, "the receipt is larger than \(Self.maximumSize) bytes") }
        let container = try? SignedDataContainer(bytes)
        let certificateSet = container.map { c in
            var hasher = SHA256()
            for certificate in c.certificates { certificate.withUnsafeBytes { hasher.update(bufferPointer: $0) } }
            return hasher.finalize()
        }
        let receipt: AppReceipt
        if let container, let certificateSet, let warm = try warmVerify(container, certificateSet) {
            receipt = warm
        } else {
            receipt = try fullVerify(bytes, certificateSet: certificateSet)
        }
        return try check(receipt)
    }

    /// A receipt whose certificate set a full verification accepted before, dated inside that
    /// chain's validity: only the signature (libcrypto, with the kept key) and the payload.
    /// Nil sends it to the full path.
    private func warmVerify(_ container: SignedDataContainer, _ certificateSet: SHA256Digest) throws(VerificationError) -> AppReceipt? {
        guard let signer = signers.withLock({ $0[certificateSet] }), container.issuerAndSerial.elementsEqual(signer.issuerAndSerial),
            !container.hasSignedAttributes, container.certificates.count <= Int(Self.maximumCertificates),
            container.digestAlgorithms == [container.digestAlgorithm],
            container.signatureAlgorithm == SignedDataContainer.rsaEncryption || container.signatureAlgorithm == SignedDataContainer.sha1WithRSA
                || container.signatureAlgorithm == SignedDataContainer.sha256WithRSA
        else { return nil }
        let sha1: Bool
        switch container.digestAlgorithm {
        case SignedDataContainer.sha1: sha1 = true
        case SignedDataContainer.sha256: sha1 = false
        default: return nil
        }
        let receipt = try ReceiptPayload.decode(container.content[...])
        guard receipt.creationDate >= signer.from, receipt.creationDate <= signer.until else { return nil }
        let valid = container.content.withUnsafeBufferPointer { content in
            container.signature.withUnsafeBufferPointer { signature in
                iap_rsa_verify(signer.key, sha1 ? 1 : 0, content.baseAddress, content.count, signature.baseAddress, signature.count)
            }
        }
        guard valid == 1 else { throw VerificationError(.invalidSignature, "the receipt's signature does not match its payload: it was altered") }
        return receipt
    }

    /// Everything with libcrypto: the container, the signer's chain at the creation date, the
    /// markers, the signature. Remembers the signer for ``warmVerify(_:_:)``.
    private func fullVerify(_ bytes: [UInt8], certificateSet: SHA256Digest?) throws(VerificationError) -> AppReceipt {
        var status: Int32 = 0
        var content: UnsafePointer<UInt8>?
        var contentLength = 0
        let container = bytes.withUnsafeBufferPointer { iap_pkcs7_open($0.baseAddress, $0.count, &content, &contentLength, &status) }
        guard let container, let content else {
            throw VerificationError(
                .malformed,
                status == Int32(IAP_PKCS7_NOT_SIGNED_DATA)
                    ? "the receipt is PKCS#7 but not SignedData with the payload attached" : "the receipt is not a PKCS#7 container (BER or DER)")
        }
        defer { iap_pkcs7_free(container) }
        // The payload is read before the signature is checked only to learn the creation date
        // the chain must be valid at; nothing from it is returned unless everything verifies.
        let receipt = try ReceiptPayload.decode(Array(UnsafeBufferPointer(start: content, count: contentLength))[...])
        var from = 0, until = 0
        let result = Int(
            iap_pkcs7_verify(
                container, store, Int(receipt.creationDate.timeIntervalSince1970), Self.leafMarker, Self.intermediateMarker,
                Self.maximumCertificates, 0, &from, &until))
        switch result {
        case Int(IAP_PKCS7_OK): break
        case Int(IAP_PKCS7_SIGNERS), Int(IAP_PKCS7_CERTIFICATES):
            throw VerificationError(.invalidCertificateList, "the receipt's certificates do not form leaf → intermediate → root with one signer")
        case Int(IAP_PKCS7_CHAIN):
            throw VerificationError(
                .untrustedChain,
                "the receipt's signer does not chain to a trusted root at its creation date \(receipt.creationDate.formatted(.iso8601)): is it Apple's (or, in tests, the sandbox's receipt-root.cer given with --trust-root)?"
            )
        case Int(IAP_PKCS7_MARKER):
            throw VerificationError(.missingMarkerOID, "the receipt's signing certificate or intermediate lacks Apple's receipt-signing marker extension")
        case Int(IAP_PKCS7_SIGNATURE):
            throw VerificationError(.invalidSignature, "the receipt's signature does not match its payload: it was altered")
        default:
            throw VerificationError(.malformed, "the receipt could not be verified (libcrypto failed)")
        }
        if let certificateSet, let key = iap_pkcs7_signer_key(container) {
            var der: UnsafeMutablePointer<UInt8>?
            let length = iap_pkcs7_signer_issuer_serial(container, &der)
            if length > 0, let der {
                let signer = VerifiedSigner(
                    key: key, issuerAndSerial: Array(UnsafeBufferPointer(start: der, count: Int(length))),
                    from: Date(timeIntervalSince1970: TimeInterval(from)), until: Date(timeIntervalSince1970: TimeInterval(until)))
                iap_free(der)
                signers.withLock { cache in
                    if cache.count >= Self.signerCacheLimit { cache.removeAll() }
                    cache[certificateSet] = signer
                }
            } else {
                iap_pkey_free(key)
            }
        }
        return receipt
    }

    /// What the receipt says against this server's app and environments.
    private func check(_ receipt: AppReceipt) throws(VerificationError) -> AppReceipt {
        guard bundles.contains(receipt.bundleId) else {
            throw VerificationError(.wrongBundleId, "the receipt is for bundle id '\(receipt.bundleId)', \(bundles.notConfigured)")
        }
        guard let environment = receipt.environment, environments.accepted.contains(environment) else {
            throw VerificationError(
                .wrongEnvironment, "the receipt's environment '\(receipt.receiptType ?? "none")' is not accepted here (\(environments))")
        }
        return receipt
    }
}

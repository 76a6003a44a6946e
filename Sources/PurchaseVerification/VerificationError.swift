import IAPProtocol

/// Which check refused signed data; stable for programs (and HTTP status mapping) to branch on.
public enum VerificationErrorCode: String, ErrorCode, CaseIterable {
    /// Not a compact JWS, bad base64url, bad JSON, missing fields.
    case malformed
    /// Larger than ``SignedDataVerifier/maxTokenSize``.
    case tooLarge = "too-large"
    /// `alg` is not ES256.
    case unsupportedAlgorithm = "unsupported-algorithm"
    /// The header marks extensions as critical (`crit`); none is implemented here.
    case unsupportedCriticalHeader = "unsupported-critical-header"
    /// `x5c` is missing or does not hold exactly three certificates.
    case invalidCertificateList = "invalid-certificate-list"
    /// The chain does not lead to a configured root, or a certificate is expired or invalid at `signedDate`.
    case untrustedChain = "untrusted-chain"
    /// The intermediate or leaf lacks Apple's marker extension.
    case missingMarkerOID = "missing-marker-oid"
    /// The ES256 signature does not verify with the leaf's key.
    case invalidSignature = "invalid-signature"
    /// The payload's bundle id is not the configured one.
    case wrongBundleId = "wrong-bundle-id"
    /// The payload's environment is not accepted by this configuration.
    case wrongEnvironment = "wrong-environment"
    /// Apple's `verifyReceipt` could not be asked or answered "try later" (503: retry).
    case receiptServiceUnavailable = "receipt-service-unavailable"
    /// Local verification and Apple's `verifyReceipt` read the receipt differently (`both` mode).
    case verifiersDisagree = "verifiers-disagree"
    /// Apple's `verifyReceipt` no longer knows the receipt's account (21010).
    case unknownAccount = "unknown-account"
}

/// Why signed data was refused. Messages say which check failed and never echo the token.
public typealias VerificationError = CodedError<VerificationErrorCode>

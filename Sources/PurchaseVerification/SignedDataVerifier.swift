import Crypto
import Foundation
import SwiftASN1
import Synchronization
@_spi(FixedExpiryValidationTime) import X509

/// Which App Store environments a server accepts.
///
/// App Review buys with sandbox accounts against production servers, so a production server that
/// must pass review accepts both, deliberately: ``productionAndSandbox``.
public struct EnvironmentPolicy: Sendable, Equatable, CustomStringConvertible {
    public var accepted: Set<AppStoreEnvironment>

    public init(accepting accepted: Set<AppStoreEnvironment>) { self.accepted = accepted }

    public static let production = EnvironmentPolicy(accepting: [.production])
    public static let sandbox = EnvironmentPolicy(accepting: [.sandbox])
    /// Production first, then sandbox, like `verifyReceipt`'s 21007 fallback; needed for App Review.
    public static let productionAndSandbox = EnvironmentPolicy(accepting: [.production, .sandbox])

    /// Also accept `Xcode` and `LocalTesting` transactions (local StoreKit testing only).
    public func allowingLocalTesting() -> EnvironmentPolicy {
        EnvironmentPolicy(accepting: accepted.union([.xcode, .localTesting]))
    }

    /// Parses `production`, `sandbox` or `both`.
    public init?(name: String) {
        switch name.lowercased() {
        case "production": self = .production
        case "sandbox": self = .sandbox
        case "both": self = .productionAndSandbox
        default: return nil
        }
    }

    public var description: String { accepted.map(\.rawValue).sorted().joined(separator: ", ") }
}

/// Which apps a server serves: one bundle identifier, or several apps of one developer account.
///
/// One server can serve every app of an account because App Store Connect never gives two of an
/// account's products the same identifier, even across apps: a product identifier names one
/// product whichever app's transaction carries it.
public struct BundlePolicy: Sendable, Equatable, CustomStringConvertible {
    /// The accepted bundle identifiers, in the order they were configured.
    public let accepted: [String]

    /// - Precondition: at least one identifier; repeats are dropped.
    public init(accepting accepted: [String]) {
        precondition(!accepted.isEmpty, "a bundle policy accepts at least one bundle identifier")
        var seen = Set<String>()
        self.accepted = accepted.filter { seen.insert($0).inserted }
    }

    public init(_ bundleId: String) { self.init(accepting: [bundleId]) }

    public func contains(_ bundleId: String) -> Bool { accepted.contains(bundleId) }

    /// `'com.example.app'`, or `'com.example.a', 'com.example.b'`.
    public var description: String { accepted.map { "'\($0)'" }.joined(separator: ", ") }

    /// "not the configured 'a'" or "not one of the configured 'a', 'b'", for refusals.
    public var notConfigured: String { accepted.count == 1 ? "not the configured \(self)" : "not one of the configured \(self)" }
}

/// What signed data must satisfy beyond its signature.
public struct VerifierConfiguration: Sendable {
    /// The apps' bundle identifiers; payloads for any other are refused.
    public var bundles: BundlePolicy
    /// DER certificates trusted as roots. Apple Root CA - G3 is included by default.
    public var trustRoots: [Certificate]
    public var environments: EnvironmentPolicy

    public init(bundles: BundlePolicy, trustRoots: [Certificate] = [AppleRoots.rootCAG3], environments: EnvironmentPolicy = .production) {
        self.bundles = bundles
        self.trustRoots = trustRoots
        self.environments = environments
    }

    /// One app, as Apple's `SignedDataVerifier` is configured.
    public init(bundleId: String, trustRoots: [Certificate] = [AppleRoots.rootCAG3], environments: EnvironmentPolicy = .production) {
        self.init(bundles: BundlePolicy(bundleId), trustRoots: trustRoots, environments: environments)
    }
}

/// The trust roots built into the library.
public enum AppleRoots {
    /// Apple Root CA - G3 (valid until 2039-04-30), SHA-256 fingerprint
    /// 63:34:3A:BF:B8:9A:6A:03:EB:B5:7E:9B:3F:5F:A7:BE:7C:4F:5C:75:6F:30:17:B3:A8:C4:88:C3:65:3E:91:79.
    public static let rootCAG3 = bundled("AppleRootCA-G3")

    /// Apple Inc. Root Certificate ("Apple Root CA", valid until 2035-02-09), the app-receipt
    /// root, SHA-256 fingerprint
    /// B0:B1:73:0E:CB:C7:FF:45:05:14:2C:49:F1:29:5E:6E:DA:6B:CA:ED:7E:2C:68:C5:BE:91:B5:A1:10:01:F0:24.
    public static let appleIncRoot = bundled("AppleIncRootCertificate")

    private static func bundled(_ name: String) -> Certificate {
        // The resources ship inside this module; failing to load one is a packaging bug.
        guard let url = Bundle.module.url(forResource: name, withExtension: "cer"),
            let data = try? Data(contentsOf: url),
            let certificate = try? Certificate(derEncoded: Array(data))
        else {
            fatalError("\(name).cer is missing from the PurchaseVerification bundle")
        }
        return certificate
    }

    /// Loads a trust root from a DER (`.cer`) or PEM file.
    public static func load(path: String) throws(VerificationError) -> Certificate {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw VerificationError(.untrustedChain, "cannot read the trust root \(path): check the path and its permissions")
        }
        if let text = String(data: data, encoding: .utf8), text.contains("-----BEGIN CERTIFICATE-----"),
            let certificate = try? Certificate(pemEncoded: text)
        {
            return certificate
        }
        guard let certificate = try? Certificate(derEncoded: Array(data)) else {
            throw VerificationError(.untrustedChain, "\(path) is not a DER or PEM X.509 certificate: export the root certificate (for example root.cer from iap-sandbox init)")
        }
        return certificate
    }
}

/// Object identifiers of Apple's marker extensions.
public enum AppleMarkerOID {
    /// On the Apple Worldwide Developer Relations intermediate.
    public static let intermediate: ASN1ObjectIdentifier = [1, 2, 840, 113635, 100, 6, 2, 1]
    /// On the leaf that signs App Store payloads.
    public static let leaf: ASN1ObjectIdentifier = [1, 2, 840, 113635, 100, 6, 11, 1]
}

/// Requires exactly leaf → intermediate → root, with Apple's marker extensions on the first two.
struct AppleMarkerPolicy: VerifierPolicy {
    let verifyingCriticalExtensions: [ASN1ObjectIdentifier] = []

    func chainMeetsPolicyRequirements(chain: UnverifiedCertificateChain) async -> PolicyEvaluationResult {
        guard chain.count == 3 else { return .failsToMeetPolicy(reason: "chain-length") }
        guard chain[1].extensions.contains(where: { $0.oid == AppleMarkerOID.intermediate }) else {
            return .failsToMeetPolicy(reason: "intermediate-oid")
        }
        guard chain[0].extensions.contains(where: { $0.oid == AppleMarkerOID.leaf }) else {
            return .failsToMeetPolicy(reason: "leaf-oid")
        }
        return .meetsPolicy
    }
}

/// The kinds of signed data the App Store produces.
public enum SignedPayload: Sendable {
    case transaction(Transaction)
    case renewalInfo(RenewalInfo)
    case notification(NotificationPayload, transaction: Transaction?)
}

/// Verifies StoreKit 2 signed data the way Apple's App Store Server Library does:
/// `alg` ES256 only; exactly three `x5c` certificates of which the third is ignored and the
/// configured roots are the anchors; RFC 5280 validation at the payload's `signedDate` plus
/// Apple's marker OIDs; the ES256 signature (raw R‖S) with the leaf's key; then bundle id and
/// environment.
///
/// Verified (leaf, intermediate) pairs are cached by their bytes with the time span in which the
/// chain is valid, so verifying more tokens from the same signer skips chain building.
public final class SignedDataVerifier: Sendable {
    /// Signed payloads are a few kilobytes; anything far larger is not one.
    public static let maxTokenSize = 64 * 1024
    public let configuration: VerifierConfiguration
    private let roots: CertificateStore
    private let cache = Mutex(ChainCache())

    public init(configuration: VerifierConfiguration) {
        self.configuration = configuration
        roots = CertificateStore(configuration.trustRoots)
    }

    /// How many validated chains are cached (for tests and metrics).
    var cachedChainCount: Int { cache.withLock { $0.count } }

    /// Verifies a signed transaction (`signedTransactionInfo`, or StoreKit's `jwsRepresentation`).
    public func verifyTransaction(_ token: String) async throws(VerificationError) -> Transaction {
        let transaction: Transaction = try await verify(token, as: Transaction.self) { $0.signedDate }
        try check(bundleId: transaction.bundleId, environment: transaction.environment)
        return transaction
    }

    /// Verifies signed renewal info. Renewal info carries no bundle id; its environment is checked.
    public func verifyRenewalInfo(_ token: String) async throws(VerificationError) -> RenewalInfo {
        let info: RenewalInfo = try await verify(token, as: RenewalInfo.self) { $0.signedDate }
        try check(bundleId: nil, environment: info.environment)
        return info
    }

    /// Verifies a notification's `signedPayload` (bundle id and environment from its `data`) and the
    /// transaction inside it, if any.
    public func verifyNotification(_ signedPayload: String) async throws(VerificationError) -> (NotificationPayload, Transaction?) {
        let notification: NotificationPayload = try await verify(signedPayload, as: NotificationPayload.self) { $0.signedDate }
        guard notification.notificationUUID != nil, notification.notificationType != nil else {
            throw VerificationError(.malformed, "the notification has no notificationUUID or notificationType")
        }
        // Summary notifications (no data) are not tied to one app's environment; others are checked.
        if let data = notification.data {
            try check(bundleId: data.bundleId, environment: data.environment)
        }
        var transaction: Transaction?
        if let inner = notification.data?.signedTransactionInfo {
            transaction = try await verifyTransaction(inner)
        }
        return (notification, transaction)
    }

    /// Verifies any signed data and tells which kind it was.
    public func verifyAny(_ token: String) async throws(VerificationError) -> SignedPayload {
        let jws = try CompactJWS(token, maxSize: Self.maxTokenSize)
        let keys = (try? JSONSerialization.jsonObject(with: jws.payload) as? [String: Any]) ?? [:]
        if keys["notificationType"] != nil || keys["notificationUUID"] != nil {
            let (notification, transaction) = try await verifyNotification(token)
            return .notification(notification, transaction: transaction)
        }
        if keys["transactionId"] != nil {
            return .transaction(try await verifyTransaction(token))
        }
        if keys["autoRenewProductId"] != nil || keys["autoRenewStatus"] != nil {
            return .renewalInfo(try await verifyRenewalInfo(token))
        }
        throw VerificationError(.malformed, "the payload is neither a transaction, renewal info nor a notification")
    }

    private func check(bundleId: String?, environment: AppStoreEnvironment?) throws(VerificationError) {
        if let bundleId, !configuration.bundles.contains(bundleId) {
            throw VerificationError(.wrongBundleId, "the payload is for bundle id '\(bundleId)', \(configuration.bundles.notConfigured)")
        }
        guard let environment, configuration.environments.accepted.contains(environment) else {
            throw VerificationError(
                .wrongEnvironment,
                "the payload's environment '\(environment?.rawValue ?? "none")' is not accepted (accepted: \(configuration.environments)); a server that must accept App Review's sandbox purchases sets the environment to both"
            )
        }
    }

    private func verify<T: Decodable>(_ token: String, as type: T.Type, signedDate: (T) -> Date?) async throws(VerificationError) -> T {
        let jws = try CompactJWS(token, maxSize: Self.maxTokenSize)
        guard jws.header.alg == "ES256" else {
            throw VerificationError(.unsupportedAlgorithm, "the JWS algorithm is '\(jws.header.alg ?? "missing")'; only ES256 is accepted")
        }
        guard let x5c = jws.header.x5c, x5c.count == 3 else {
            throw VerificationError(.invalidCertificateList, "the JWS header must carry exactly 3 certificates in x5c (leaf, intermediate, root); it has \(jws.header.x5c?.count ?? 0)")
        }
        let payload: T
        do {
            payload = try JSONDecoder().decode(T.self, from: jws.payload)
        } catch {
            throw VerificationError(.malformed, "the JWS payload is not a valid \(T.self) JSON object")
        }
        guard let date = signedDate(payload) else {
            throw VerificationError(.malformed, "the payload has no signedDate, so its certificates cannot be validated")
        }
        let key = try await validatedSigningKey(x5c: x5c, at: date)
        // JWS ES256 signatures are the raw 64-byte R‖S; a DER-encoded signature is not valid JWS.
        guard jws.signature.count == 64, let signature = try? P256.Signing.ECDSASignature(rawRepresentation: jws.signature) else {
            throw VerificationError(.invalidSignature, "the ES256 signature must be 64 bytes (R‖S); it is \(jws.signature.count)")
        }
        guard key.isValidSignature(signature, for: jws.signingInput) else {
            throw VerificationError(.invalidSignature, "the ES256 signature does not match the payload: it was altered or signed with another key")
        }
        return payload
    }

    /// The leaf's key, once leaf → intermediate → configured root is validated at `date`. The
    /// cache is keyed by the certificates' base64 text, which is as unique as their DER bytes.
    private func validatedSigningKey(x5c: [String], at date: Date) async throws(VerificationError) -> P256.Signing.PublicKey {
        let cacheKey = ChainCache.Key(leaf: x5c[0], intermediate: x5c[1])
        if let cached = cache.withLock({ $0.lookup(cacheKey, at: date) }) { return cached }

        guard let leafDER = Data(base64Encoded: x5c[0]), let intermediateDER = Data(base64Encoded: x5c[1]) else {
            throw VerificationError(.invalidCertificateList, "an x5c certificate is not valid base64")
        }
        let leaf: Certificate, intermediate: Certificate
        do {
            leaf = try Certificate(derEncoded: Array(leafDER))
            intermediate = try Certificate(derEncoded: Array(intermediateDER))
        } catch {
            throw VerificationError(.invalidCertificateList, "an x5c certificate is not a valid DER X.509 certificate")
        }
        var verifier = Verifier(rootCertificates: roots) {
            RFC5280Policy(fixedExpiryValidationTime: date)
            AppleMarkerPolicy()
        }
        let result = await verifier.validate(leaf: leaf, intermediates: CertificateStore([intermediate]))
        switch result {
        case .validCertificate(let chain):
            guard let key = P256.Signing.PublicKey(leaf.publicKey) else {
                throw VerificationError(.invalidSignature, "the signing certificate's key is not a P-256 key, as ES256 requires")
            }
            let certificates = Array(chain)
            let notBefore = certificates.map(\.notValidBefore).max() ?? date
            let notAfter = certificates.map(\.notValidAfter).min() ?? date
            cache.withLock { $0.insert(cacheKey, key: key, validFrom: notBefore, until: notAfter) }
            return key
        case .couldNotValidate(let failures):
            let reasons = failures.map { $0.policyFailureReason.description }
            if reasons.contains("intermediate-oid") {
                throw VerificationError(.missingMarkerOID, "the intermediate certificate lacks Apple's marker extension \(AppleMarkerOID.intermediate): it is not an Apple WWDR intermediate")
            }
            if reasons.contains("leaf-oid") {
                throw VerificationError(.missingMarkerOID, "the signing certificate lacks Apple's marker extension \(AppleMarkerOID.leaf): it is not an App Store signing certificate")
            }
            if reasons.contains(where: { $0.contains("expired") || $0.contains("not yet valid") }) {
                throw VerificationError(.untrustedChain, "a certificate of the chain is not valid at the payload's signedDate (\(date)): expired or not yet valid")
            }
            throw VerificationError(
                .untrustedChain,
                "the certificate chain does not lead to a configured trust root (configured: \(configuration.trustRoots.count)); add the signer's root with --trust-root if it should be trusted")
        }
    }
}

/// A small cache of validated (leaf, intermediate) pairs, keyed by their DER bytes.
struct ChainCache: Sendable {
    struct Key: Hashable, Sendable {
        let leaf: String
        let intermediate: String
    }

    struct Entry: Sendable {
        let key: P256.Signing.PublicKey
        let validFrom: Date
        let until: Date
        var lastUse: UInt64
    }

    static let capacity = 64
    private var entries: [Key: Entry] = [:]
    private var clock: UInt64 = 0

    mutating func lookup(_ key: Key, at date: Date) -> P256.Signing.PublicKey? {
        guard var entry = entries[key], date >= entry.validFrom, date <= entry.until else { return nil }
        clock += 1
        entry.lastUse = clock
        entries[key] = entry
        return entry.key
    }

    mutating func insert(_ key: Key, key signingKey: P256.Signing.PublicKey, validFrom: Date, until: Date) {
        if entries.count >= Self.capacity, let oldest = entries.min(by: { $0.value.lastUse < $1.value.lastUse })?.key {
            entries.removeValue(forKey: oldest)
        }
        clock += 1
        entries[key] = Entry(key: signingKey, validFrom: validFrom, until: until, lastUse: clock)
    }

    var count: Int { entries.count }
}

import Crypto
import Foundation
import IAPTestSupport
import PurchaseVerification
import SandboxStore
import X509

/// A sandbox chain and a verifier that trusts it, plus helpers to build tokens that must fail.
struct Fixture {
    let authority: SandboxCertificateAuthority
    let bundleId = "com.example.app"

    init(profile: ChainProfile = ChainProfile()) throws {
        authority = try SandboxCertificateAuthority.generate(profile: profile)
    }

    func verifier(environments: EnvironmentPolicy = .sandbox, roots: [Certificate]? = nil) -> SignedDataVerifier {
        SignedDataVerifier(configuration: .init(bundleId: bundleId, trustRoots: roots ?? [AppleRoots.rootCAG3, authority.root], environments: environments))
    }

    func transaction(
        id: String = "2000000000000001", product: String = "com.example.levels1", environment: AppStoreEnvironment = .sandbox,
        signed: Date = Date(timeIntervalSince1970: Date().timeIntervalSince1970.rounded(.down)), bundle: String? = nil
    ) -> Transaction {
        var t = Transaction(
            transactionId: id, originalTransactionId: id, bundleId: bundle ?? bundleId, productId: product,
            purchaseDate: signed, type: .nonConsumable, environment: environment, signedDate: signed)
        t.quantity = 1
        t.inAppOwnershipType = .purchased
        return t
    }

    func payloadJSON(_ transaction: Transaction) throws -> Data {
        try JSONEncoder().encode(transaction)
    }

    /// A token with an arbitrary header, signed by the leaf.
    func token(header: [String: Any], payload: Data) throws -> String {
        try authority.signCompact(header: JSONSerialization.data(withJSONObject: header), payload: payload)
    }
}

extension VerificationErrorCode {
    static func of(_ body: () async throws -> Void) async -> VerificationErrorCode? {
        do {
            try await body()
            return nil
        } catch let error as VerificationError {
            return error.code
        } catch {
            return nil
        }
    }
}

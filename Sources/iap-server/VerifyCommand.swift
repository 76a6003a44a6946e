import ArgumentParser
import CommandLineReporting
import Foundation
import IAPProtocol
import PurchaseVerification
import ReceiptVerification

struct Verify: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Verify signed data (a transaction, renewal info, a notification's signedPayload, or a StoreKit 1 app receipt) and print it as JSON.",
        discussion: """
            Exit codes: 0 verified, 1 refused (the message says which check failed), 64 usage error. \
            Apple Root CA - G3 (signed data) and Apple Inc. Root (receipts) are always trusted; add the sandbox's \
            root.cer or receipt-root.cer with --trust-root.
            """)

    @Argument(help: "A file holding the JWS, {\"signedPayload\": \"...\"}, or an app receipt (its bytes or base64); - for standard input.")
    var file: String

    @Option(name: .customLong("bundle-id"), help: "The app's bundle identifier (or IAP_BUNDLE_ID); repeat it or separate with commas to accept any of several apps.")
    var bundleIds: [String] = []

    @Option(name: .customLong("trust-root"), help: "Another trusted root certificate (DER or PEM); repeatable.")
    var trustRoots: [String] = []

    @Option(help: "production, sandbox or both (App Review uses sandbox against production servers).")
    var environment: EnvironmentChoice = .production

    @Flag(name: .customLong("allow-local-testing"), help: "Also accept Xcode and LocalTesting environments.")
    var allowLocalTesting = false

    func validate() throws {
        guard try bundlePolicy(bundleIds) != nil else { throw ValidationError("--bundle-id (or IAP_BUNDLE_ID) is required: the app's bundle identifier") }
    }

    func run() async throws {
        guard let bundles = try bundlePolicy(bundleIds) else { throw ValidationError("--bundle-id (or IAP_BUNDLE_ID) is required") }
        var policy = environment.policy
        if allowLocalTesting { policy = policy.allowingLocalTesting() }
        do {
            var roots = [AppleRoots.rootCAG3]
            for path in trustRoots { roots.append(try AppleRoots.load(path: path)) }
            let verifier = SignedDataVerifier(configuration: .init(bundles: bundles, trustRoots: roots, environments: policy))
            let input = try readInput()
            if let receipt = Self.receipt(in: input) {
                let receiptVerifier = try ReceiptVerifier(bundles: bundles, trustRoots: Array(roots.dropFirst()), environments: policy)
                let decoded = try receiptVerifier.verify(receipt)
                let purchases: [Any] = try decoded.transactions.map { transaction in
                    var object = try jsonObject(transaction) as? [String: Any] ?? [:]
                    object["entitlement"] = describe(entitlement(for: transaction, configuration: verifier.configuration))
                    return object
                }
                let output: [String: Any] = ["kind": "receipt", "payload": try jsonObject(decoded), "purchases": purchases]
                let data = try JSONSerialization.data(withJSONObject: output, options: [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes])
                print(String(decoding: data, as: UTF8.self))
                return
            }
            let token = Self.token(in: input)
            let output: [String: Any]
            switch try await verifier.verifyAny(token) {
            case .transaction(let transaction):
                output = [
                    "kind": "transaction", "payload": try jsonObject(transaction),
                    "entitlement": describe(entitlement(for: transaction, configuration: verifier.configuration)),
                ]
            case .renewalInfo(let info):
                output = ["kind": "renewalInfo", "payload": try jsonObject(info)]
            case .notification(let notification, let transaction):
                var object: [String: Any] = ["kind": "notification", "payload": try jsonObject(notification)]
                if let transaction { object["transaction"] = try jsonObject(transaction) }
                output = object
            }
            let data = try JSONSerialization.data(withJSONObject: output, options: [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes])
            print(String(decoding: data, as: UTF8.self))
        } catch let error as VerificationError {
            throw reporter.failure(VerificationError(error.code, "refused (\(error.code.rawValue)): \(error.message)"))
        }
    }

    private func readInput() throws -> Data {
        if file == "-" { return FileHandle.standardInput.readDataToEndOfFile() }
        guard let data = FileManager.default.contents(atPath: file) else { throw ValidationError("cannot read \(file): check the path") }
        return data
    }

    /// The input's bytes when it is an app receipt (PKCS#7, raw or base64), else nil.
    static func receipt(in data: Data) -> [UInt8]? {
        if data.first == 0x30 { return Array(data) }
        let text = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        guard !text.contains("."), !text.hasPrefix("{"), let decoded = Data(base64Encoded: text, options: .ignoreUnknownCharacters), decoded.first == 0x30 else {
            return nil
        }
        return Array(decoded)
    }

    /// The JWS in the input, bare or as `{"signedPayload": ...}`.
    static func token(in data: Data) -> String {
        let text = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        if text.hasPrefix("{"), let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
            let payload = object["signedPayload"] as? String
        {
            return payload
        }
        return text
    }

    private func jsonObject<T: Encodable>(_ value: T) throws -> Any {
        let encoder = JSONEncoder()
        encoder.dateEncodingStrategy = .millisecondsSince1970
        return try JSONSerialization.jsonObject(with: encoder.encode(value))
    }

    private func describe(_ decision: EntitlementDecision) -> [String: Any] {
        switch decision {
        case .granted: ["granted": true]
        case .denied(let reason): ["granted": false, "reason": reason.code, "message": reason.description]
        }
    }
}

import ArgumentParser
import Foundation
import PurchaseVerification

@main
struct IAPServer: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap-server",
        abstract: "The In-App Purchase content server.",
        subcommands: [Verify.self])
}

struct Verify: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Verify signed data (a transaction, renewal info, or a notification's signedPayload) and print it as JSON.",
        discussion: """
            Exit codes: 0 verified, 1 refused (the message says which check failed), 64 usage error. \
            Apple Root CA - G3 is always trusted; add the sandbox root (iap-sandbox's root.cer) with --trust-root.
            """)

    @Argument(help: "A file holding the JWS, or {\"signedPayload\": \"...\"}; - for standard input.")
    var file: String

    @Option(name: .customLong("bundle-id"), help: "The app's bundle identifier.")
    var bundleId: String

    @Option(name: .customLong("trust-root"), help: "Another trusted root certificate (DER or PEM); repeatable.")
    var trustRoots: [String] = []

    @Option(help: "production, sandbox or both (App Review uses sandbox against production servers).")
    var environment: String = "production"

    @Flag(name: .customLong("allow-local-testing"), help: "Also accept Xcode and LocalTesting environments.")
    var allowLocalTesting = false

    func run() async throws {
        guard var policy = EnvironmentPolicy(name: environment) else {
            throw ValidationError("--environment must be production, sandbox or both, not '\(environment)'")
        }
        if allowLocalTesting { policy = policy.allowingLocalTesting() }
        do {
            var roots = [AppleRoots.rootCAG3]
            for path in trustRoots { roots.append(try AppleRoots.load(path: path)) }
            let verifier = SignedDataVerifier(configuration: .init(bundleId: bundleId, trustRoots: roots, environments: policy))
            let token = try readToken()
            let output: [String: Any]
            switch try await verifier.verifyAny(token) {
            case .transaction(let transaction):
                output = ["kind": "transaction", "payload": try jsonObject(transaction),
                          "entitlement": describe(entitlement(for: transaction, configuration: verifier.configuration))]
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
            FileHandle.standardError.write(Data("iap-server: refused (\(error.code.rawValue)): \(error.message)\n".utf8))
            throw ExitCode(1)
        }
    }

    private func readToken() throws -> String {
        let data: Data?
        if file == "-" {
            data = FileHandle.standardInput.readDataToEndOfFile()
        } else {
            data = FileManager.default.contents(atPath: file)
        }
        guard let data else { throw ValidationError("cannot read \(file): check the path") }
        let text = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        if text.hasPrefix("{"), let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
           let payload = object["signedPayload"] as? String {
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

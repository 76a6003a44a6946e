import Crypto
import Foundation
import PurchaseVerification
import SandboxStore
import X509

/// A fresh temporary folder, removed when released.
final class TemporaryFolder: @unchecked Sendable {
    let path: String
    init() throws {
        path = FileManager.default.temporaryDirectory.path + "/iap-verify-tests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
    }
    deinit { try? FileManager.default.removeItem(atPath: path) }
    func sub(_ name: String) -> String { path + "/" + name }
}

struct ProcessResult {
    let status: Int32
    let stdout: String
    let stderr: String
}

@discardableResult
func run(_ executable: String, _ arguments: [String], stdin: String? = nil) throws -> ProcessResult {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: executable.hasPrefix("/") ? executable : "/usr/bin/env")
    process.arguments = executable.hasPrefix("/") ? arguments : [executable] + arguments
    let base = FileManager.default.temporaryDirectory.path + "/iap-run-" + UUID().uuidString
    FileManager.default.createFile(atPath: base + ".out", contents: nil)
    FileManager.default.createFile(atPath: base + ".err", contents: nil)
    FileManager.default.createFile(atPath: base + ".in", contents: Data((stdin ?? "").utf8))
    defer { for ext in [".out", ".err", ".in"] { try? FileManager.default.removeItem(atPath: base + ext) } }
    let out = FileHandle(forWritingAtPath: base + ".out")!, err = FileHandle(forWritingAtPath: base + ".err")!
    process.standardOutput = out
    process.standardError = err
    process.standardInput = FileHandle(forReadingAtPath: base + ".in")
    try process.run()
    process.waitUntilExit()
    try? out.close()
    try? err.close()
    return ProcessResult(status: process.terminationStatus,
                         stdout: (try? String(contentsOfFile: base + ".out", encoding: .utf8)) ?? "",
                         stderr: (try? String(contentsOfFile: base + ".err", encoding: .utf8)) ?? "")
}

func productsDirectory() -> String {
    var url = URL(fileURLWithPath: CommandLine.arguments[0]).resolvingSymlinksInPath()
    for _ in 0..<4 {
        url.deleteLastPathComponent()
        if FileManager.default.isExecutableFile(atPath: url.path + "/iap-sandbox") { return url.path }
    }
    return FileManager.default.currentDirectoryPath + "/.build/debug"
}

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

    func transaction(id: String = "2000000000000001", product: String = "com.example.levels1", environment: AppStoreEnvironment = .sandbox,
                     signed: Date = Date(timeIntervalSince1970: Date().timeIntervalSince1970.rounded(.down)), bundle: String? = nil) -> Transaction {
        var t = Transaction(transactionId: id, originalTransactionId: id, bundleId: bundle ?? bundleId, productId: product,
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

extension VerificationError.Code {
    static func of(_ body: () async throws -> Void) async -> VerificationError.Code? {
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

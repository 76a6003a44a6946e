// Verification throughput: signed transactions verified per second with a cold chain cache (a new
// verifier per token, so every chain is built and validated) and a warm one (one verifier).
// Run: swift run -c release verify-bench [tokens]
import Foundation
import PurchaseVerification
import SandboxStore

let count = CommandLine.arguments.count > 1 ? Int(CommandLine.arguments[1]) ?? 20_000 : 20_000
let authority = try SandboxCertificateAuthority.generate()
let configuration = VerifierConfiguration(bundleId: "com.example.app", trustRoots: [AppleRoots.rootCAG3, authority.root], environments: .sandbox)
let now = Date()
var tokens: [String] = []
for i in 0..<count {
    var t = Transaction(
        transactionId: String(2_000_000_000_000_001 + i), originalTransactionId: nil, bundleId: "com.example.app",
        productId: "com.example.levels\(i % 10)", purchaseDate: now, type: .nonConsumable, environment: .sandbox, signedDate: now)
    t.quantity = 1
    tokens.append(try authority.sign(t))
}

func measure(_ label: String, _ n: Int, _ body: (Int) async throws -> Void) async throws {
    let start = ContinuousClock.now
    for i in 0..<n { try await body(i) }
    let seconds = (ContinuousClock.now - start) / .seconds(1)
    print(String(format: "%-34@ %8d in %6.2f s = %9.0f verifications/s", label as NSString, n, seconds, Double(n) / seconds))
}

let coldCount = max(200, count / 20)
try await measure("cold (new verifier, chain validated)", coldCount) { i in
    _ = try await SignedDataVerifier(configuration: configuration).verifyTransaction(tokens[i])
}
let warm = SignedDataVerifier(configuration: configuration)
_ = try await warm.verifyTransaction(tokens[0])
try await measure("warm (cached chain), 1 task", count) { i in
    _ = try await warm.verifyTransaction(tokens[i])
}
let cores = ProcessInfo.processInfo.activeProcessorCount
let start = ContinuousClock.now
try await withThrowingTaskGroup(of: Void.self) { group in
    for worker in 0..<cores {
        group.addTask {
            var i = worker
            while i < count {
                _ = try await warm.verifyTransaction(tokens[i])
                i += cores
            }
        }
    }
    try await group.waitForAll()
}
let seconds = (ContinuousClock.now - start) / .seconds(1)
print(String(format: "%-34@ %8d in %6.2f s = %9.0f verifications/s", "warm (cached chain), \(cores) tasks" as NSString, count, seconds, Double(count) / seconds))

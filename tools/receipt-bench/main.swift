// Receipt verification throughput: StoreKit 1 app receipts with 50 purchases each, verified per
// second with a cold chain cache (a new verifier per receipt: the chain is built and validated
// by libcrypto) and a warm one (one verifier: one RSA signature check and the payload parse
// per receipt), on one task and on every core. The goal (issue 15) is ≥ 2,000/s warm on 2 cores.
// Run: swift run -c release receipt-bench [receipts] [rounds]
import BenchSupport
import Foundation
import PurchaseVerification
import ReceiptVerification
import SandboxStore

let count = CommandLine.arguments.count > 1 ? Int(CommandLine.arguments[1]) ?? 4_000 : 4_000
let rounds = CommandLine.arguments.count > 2 ? Int(CommandLine.arguments[2]) ?? 7 : 7
let authority = try SandboxReceiptAuthority.generate()
let now = Date()
var receipts: [[UInt8]] = []
// 200 distinct receipts (different creation dates and ids), cycled: signing is the slow part here.
for r in 0..<200 {
    let purchases = (0..<50).map { i in
        InAppPurchase(
            productId: "com.example.levels\(i)", transactionId: String(1_000_000_000_000_000 + r * 100 + i),
            originalTransactionId: String(1_000_000_000_000_000 + r * 100 + i), purchaseDate: now.addingTimeInterval(Double(-i * 3600)),
            originalPurchaseDate: now.addingTimeInterval(Double(-i * 3600)))
    }
    let receipt = AppReceipt(
        receiptType: "ProductionSandbox", bundleId: "com.example.app", appVersion: "1.0", originalAppVersion: "1.0",
        creationDate: now.addingTimeInterval(Double(-r)), expirationDate: nil, opaqueValue: Array(repeating: 1, count: 16),
        sha1Hash: Array(repeating: 2, count: 20), inAppPurchases: purchases)
    receipts.append(try authority.sign(payload: try ReceiptPayload.encode(receipt)))
}
print("receipt: \(receipts[0].count) bytes, 50 purchases, RSA-2048, SHA-256; \(count) verifications per run, \(rounds) rounds")

let roots = [authority.root]
let warm = try ReceiptVerifier(bundleId: "com.example.app", trustRoots: roots, environments: .sandbox)
_ = try warm.verify(receipts[0])
let cores = ProcessInfo.processInfo.activeProcessorCount
var cold: [Double] = [], one: [Double] = [], all: [Double] = []
let snapshot = receipts
for _ in 0..<rounds {
    cold.append(
        try await rate(max(200, count / 10), tasks: 1) { i in _ = try ReceiptVerifier(bundleId: "com.example.app", trustRoots: roots, environments: .sandbox).verify(snapshot[i % snapshot.count]) })
    one.append(try await rate(count, tasks: 1) { i in _ = try warm.verify(snapshot[i % snapshot.count]) })
    all.append(try await rate(count, tasks: cores) { i in _ = try warm.verify(snapshot[i % snapshot.count]) })
}
print("verifications per second, median (min-max) of the rounds")
print(medianLine("cold (new verifier, chain validated)", cold))
print(medianLine("warm, 1 task", one))
print(medianLine("warm, \(cores) tasks", all))

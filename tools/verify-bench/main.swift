// Verification throughput: StoreKit 2 signed transactions verified per second with a cold chain
// cache (a new verifier per token, so every chain is built and validated) and a warm one (one
// verifier), on one task and on every core.
//
//   swift run -c release verify-bench [tokens] [rounds]   medians (min-max) of the rounds
//   verify-bench --export <dir> [tokens]                  writes <dir>/root.cer and <dir>/tokens.txt
//   verify-bench --from <dir> [rounds]                    measures those tokens: a line per measure
//                                                         and round, "<measure> <verifications/s>"
//
// The last two are for tools/bench-verify.sh, which runs Apple's own verifier (the Python
// app-store-server-library) over the same tokens in turn with this one.
import BenchSupport
import Foundation
import PurchaseVerification
import SandboxStore

let bundleId = "com.example.app"
var arguments = Array(CommandLine.arguments.dropFirst())
var exportTo: String?
var importFrom: String?
if arguments.first == "--export", arguments.count >= 2 {
    exportTo = arguments[1]
    arguments.removeFirst(2)
} else if arguments.first == "--from", arguments.count >= 2 {
    importFrom = arguments[1]
    arguments.removeFirst(2)
}

// The tokens and the root that signed them: read, or made (signing is the slow part here).
let (tokens, root) = try { () throws -> ([String], _) in
    if let folder = importFrom {
        let lines = try String(contentsOfFile: folder + "/tokens.txt", encoding: .utf8).split(separator: "\n").map(String.init)
        return (lines, try AppleRoots.load(path: folder + "/root.cer"))
    }
    let count = arguments.first.flatMap { Int($0) } ?? 20_000
    if exportTo == nil, !arguments.isEmpty { arguments.removeFirst() }
    let authority = try SandboxCertificateAuthority.generate()
    let now = Date()
    var signed: [String] = []
    for i in 0..<count {
        var t = Transaction(
            transactionId: String(2_000_000_000_000_001 + i), originalTransactionId: nil, bundleId: bundleId,
            productId: "com.example.levels\(i % 10)", purchaseDate: now, type: .nonConsumable, environment: .sandbox, signedDate: now)
        t.quantity = 1
        signed.append(try authority.sign(t))
    }
    return (signed, authority.root)
}()
if let folder = exportTo {
    try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
    try Data(derBytes(root)).write(to: URL(fileURLWithPath: folder + "/root.cer"))
    try Data((tokens.joined(separator: "\n") + "\n").utf8).write(to: URL(fileURLWithPath: folder + "/tokens.txt"))
    exit(0)
}
let rounds = arguments.first.flatMap { Int($0) } ?? (importFrom == nil ? 7 : 1)

let configuration = VerifierConfiguration(bundleId: bundleId, trustRoots: [root], environments: .sandbox)
let snapshot = tokens

let warm = SignedDataVerifier(configuration: configuration)
let first = try await warm.verifyTransaction(snapshot[0])
guard first.bundleId == bundleId else { fatalError("the first token did not decode to \(bundleId)") }
let cores = ProcessInfo.processInfo.activeProcessorCount
let measures = ["cold", "warm-1", "warm-\(cores)"]
var samples: [[Double]] = Array(repeating: [], count: measures.count)
for _ in 0..<rounds {
    let round = [
        try await rate(max(200, snapshot.count / 20), tasks: 1) { i in
            _ = try await SignedDataVerifier(configuration: configuration).verifyTransaction(snapshot[i])
        },
        try await rate(snapshot.count, tasks: 1) { i in _ = try await warm.verifyTransaction(snapshot[i]) },
        try await rate(snapshot.count, tasks: cores) { i in _ = try await warm.verifyTransaction(snapshot[i]) },
    ]
    for (index, value) in round.enumerated() {
        samples[index].append(value)
        if importFrom != nil { print("\(measures[index]) \(Int(value))") }
    }
}
if importFrom == nil {
    print("\(snapshot.count) tokens (ES256, x5c chain of 3), \(rounds) rounds; verifications per second, median (min-max)")
    let labels = ["cold (new verifier, chain validated)", "warm (cached chain), 1 task", "warm (cached chain), \(cores) tasks"]
    for (label, values) in zip(labels, samples) { print(medianLine(label, values)) }
}

import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

func iapPack(_ arguments: [String], environment: [String: String]? = nil) throws -> ProcessResult {
    try run(productsDirectory() + "/iap-pack", arguments, environment: environment)
}

/// Compressible text: log lines with varying numbers.
func logText(lines: Int, seed: UInt64) -> String {
    var out = ""
    out.reserveCapacity(lines * 80)
    var x = seed
    for i in 0..<lines {
        x = x &* 6364136223846793005 &+ 1442695040888963407
        out += "2026-11-\(i % 28 + 1) 12:\(i % 60):\(i % 7) INFO request id=\(x >> 40) path=/v1/items/\(i % 977) status=\(x % 3 == 0 ? 404 : 200)\n"
    }
    return out
}

/// The sample content folder of this repository.
func repositoryContent(_ product: String) -> String {
    URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("content").appendingPathComponent(product).path
}

func sha256Hex(_ path: String) throws -> String {
    try run("sha256sum", [path]).stdout.split(separator: " ").first.map(String.init) ?? ""
}

extension PackOptions {
    /// Files of over 1 MiB cut into 1 MiB chunks, so that a small test folder takes the path of
    /// large files: chunks compressed apart and joined, stored chunks read by the writer.
    var inSmallChunks: PackOptions {
        var options = self
        options.chunking = Chunking(wholeFileLimit: 1 << 20, chunkSize: 1 << 20)
        return options
    }
}

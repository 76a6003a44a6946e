import Foundation
import Testing
@testable import ContentArchive

/// A fresh temporary folder, removed when the value is released.
final class TemporaryFolder: @unchecked Sendable {
    let path: String

    init() throws {
        let base = FileManager.default.temporaryDirectory.path + "/iap-tests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: base, withIntermediateDirectories: true)
        path = base
    }

    deinit { try? FileManager.default.removeItem(atPath: path) }

    func sub(_ name: String) -> String { path + "/" + name }

    @discardableResult
    func write(_ relative: String, _ contents: String) throws -> String {
        try write(relative, Data(contents.utf8))
    }

    @discardableResult
    func write(_ relative: String, _ data: Data) throws -> String {
        let full = sub(relative)
        try FileManager.default.createDirectory(atPath: (full as NSString).deletingLastPathComponent, withIntermediateDirectories: true)
        try data.write(to: URL(fileURLWithPath: full))
        return full
    }

    func files(in relative: String) -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: sub(relative))) ?? []).sorted()
    }
}

struct ProcessResult {
    let status: Int32
    let stdout: String
    let stderr: String
}

/// Runs a program to completion (the real tools: unzip, python3, the built CLIs).
@discardableResult
func run(_ executable: String, _ arguments: [String], environment: [String: String]? = nil) throws -> ProcessResult {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: executable.hasPrefix("/") ? executable : "/usr/bin/env")
    process.arguments = executable.hasPrefix("/") ? arguments : [executable] + arguments
    if let environment { process.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 } }
    // Output goes to files rather than pipes, so a chatty child can never block on a full pipe.
    let base = FileManager.default.temporaryDirectory.path + "/iap-run-" + UUID().uuidString
    FileManager.default.createFile(atPath: base + ".out", contents: nil)
    FileManager.default.createFile(atPath: base + ".err", contents: nil)
    defer {
        try? FileManager.default.removeItem(atPath: base + ".out")
        try? FileManager.default.removeItem(atPath: base + ".err")
    }
    let out = FileHandle(forWritingAtPath: base + ".out")!, err = FileHandle(forWritingAtPath: base + ".err")!
    process.standardOutput = out
    process.standardError = err
    process.standardInput = FileHandle.nullDevice
    try process.run()
    process.waitUntilExit()
    try? out.close()
    try? err.close()
    return ProcessResult(status: process.terminationStatus,
                         stdout: (try? String(contentsOfFile: base + ".out", encoding: .utf8)) ?? "",
                         stderr: (try? String(contentsOfFile: base + ".err", encoding: .utf8)) ?? "")
}

/// The folder that holds the built executables (beside the test bundle).
func productsDirectory() -> String {
    var url = URL(fileURLWithPath: CommandLine.arguments[0]).resolvingSymlinksInPath()
    for _ in 0..<4 {
        url.deleteLastPathComponent()
        if FileManager.default.isExecutableFile(atPath: url.path + "/iap-pack") { return url.path }
    }
    return FileManager.default.currentDirectoryPath + "/.build/debug"
}

func iapPack(_ arguments: [String], environment: [String: String]? = nil) throws -> ProcessResult {
    try run(productsDirectory() + "/iap-pack", arguments, environment: environment)
}

/// Deterministic pseudo-random bytes (SplitMix64), so tests need no fixtures.
func pseudoRandomBytes(_ count: Int, seed: UInt64) -> Data {
    var state = seed
    var data = Data(count: count)
    data.withUnsafeMutableBytes { raw in
        let bytes = raw.bindMemory(to: UInt8.self)
        var i = 0
        while i < count {
            state &+= 0x9E37_79B9_7F4A_7C15
            var z = state
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            z ^= z >> 31
            for b in 0..<8 where i < count {
                bytes[i] = UInt8(truncatingIfNeeded: z >> (8 * UInt64(b)))
                i += 1
            }
        }
    }
    return data
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

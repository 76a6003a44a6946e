import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

@Suite("Builds stopped part-way", .onTestThreads)
struct InterruptionTests {
    @Test("SIGTERM mid-build removes the temporary archive and exits 143, as a shell reports a killed command")
    func terminatedBuildCleansUp() throws {
        let tmp = try TemporaryFolder()
        // Text at level 12 compresses slowly enough for the signal to land while the archive is
        // being written (it is sent as soon as the temporary file exists).
        for index in 0..<3 { try tmp.write("src/log-\(index).txt", logText(lines: 100_000, seed: UInt64(index))) }
        let out = tmp.sub("out")
        let (caught, process) = try interrupt(
            productsDirectory() + "/iap-pack",
            ["build", tmp.sub("src"), "--product-id", "com.example.x", "--content-version", "1.0", "--level", "12", "-o", out],
            with: SIGTERM, stderrPath: tmp.sub("stderr.txt")
        ) { tmp.files(in: "out").contains { $0.contains(".partial-") } }
        try #require(caught, "the build ended before its temporary archive was seen")
        #expect(process.terminationStatus == 128 + SIGTERM)
        #expect(tmp.files(in: "out").isEmpty, "left behind: \(tmp.files(in: "out"))")
        let message = try String(contentsOfFile: tmp.sub("stderr.txt"), encoding: .utf8)
        #expect(message.contains("stopped by SIGTERM; its unfinished files were removed"), "\(message)")
    }

    @Test("the next build into the folder removes what killed builds left, and nothing a live build or anyone else is writing")
    func leftoversOfKilledBuilds() throws {
        let tmp = try TemporaryFolder()
        try tmp.write("src/a.txt", "content")
        let out = tmp.sub("out")
        let old = Date().addingTimeInterval(-3600)
        func leftover(_ name: String, modified: Date = old) throws {
            try tmp.write("out/" + name, "partial bytes")
            try FileManager.default.setAttributes([.modificationDate: modified], ofItemAtPath: tmp.sub("out/" + name))
        }
        // Left by builds killed an hour ago (`kill -9`, a power cut): removed.
        try leftover(".com.example.x-1.0.zip.partial-999999")
        try leftover(".com.example.other-0.9.manifest.json.partial-999998")
        // A build in another process still writing its archive (it holds the lock): kept.
        try leftover(".com.example.x-0.8.zip.partial-999997")
        let held = open(tmp.sub("out/.com.example.x-0.8.zip.partial-999997"), O_RDONLY)
        defer { close(held) }
        #expect(flock(held, LOCK_EX | LOCK_NB) == 0)
        // Created a moment ago, perhaps not locked yet: kept.
        try leftover(".com.example.x-0.7.zip.partial-999996", modified: Date())
        // Not a build's temporary file at all: kept.
        try leftover(".notes.txt.partial-1")
        try leftover(".com.example.x-0.6.zip.partial-abc")

        let result = try iapPack(["build", tmp.sub("src"), "--product-id", "com.example.x", "--content-version", "1.0", "-o", out])
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stdout.contains("removed   \(out)/.com.example.x-1.0.zip.partial-999999, left by a build that was stopped"))
        #expect(result.stdout.contains("removed   \(out)/.com.example.other-0.9.manifest.json.partial-999998"))
        #expect(
            tmp.files(in: "out") == [
                ".com.example.x-0.6.zip.partial-abc", ".com.example.x-0.7.zip.partial-999996", ".com.example.x-0.8.zip.partial-999997",
                ".com.example.x-1.0.zip.hashes", ".notes.txt.partial-1", "com.example.x-1.0.manifest.json", "com.example.x-1.0.zip",
            ])
    }
}

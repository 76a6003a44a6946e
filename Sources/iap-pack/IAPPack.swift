import ArgumentParser
import CommandLineReporting
import ContentArchive
import Foundation
import IAPProtocol

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Exit codes, documented in the README.
enum Exit {
    static let invalidInput: Int32 = 1
    static let capExceeded: Int32 = 2
    static let ioFailure: Int32 = 3

    static func code(for error: ArchiveError) -> Int32 {
        switch error.code {
        case .invalidInput, .corrupt: invalidInput
        case .capExceeded: capExceeded
        case .io: ioFailure
        }
    }
}

@main
struct IAPPack: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap-pack",
        abstract: "Packs In-App Purchase content into versioned, reproducible archives.",
        discussion: """
            Exit codes: 0 success, 1 invalid input (or an invalid archive), 2 the archive would \
            exceed the size cap, 3 a file could not be read or written, 64 bad command-line usage, \
            128 + N stopped by signal N (the build's temporary files are removed).
            """,
        version: IAPContentVersion.current,
        subcommands: [Build.self, Verify.self, Inspect.self, Extract.self])
}

/// Prints the outcome of a subcommand: JSON on stdout, or a human summary; errors on stderr.
protocol Reporting {
    var json: Bool { get }
}

extension Reporting {
    var reporter: Reporter { Reporter(tool: "iap-pack", json: json) }

    func reporting(_ body: () throws(ArchiveError) -> Void) throws {
        try reporter.run(exitCode: Exit.code(for:), body)
    }
}

func humanBytes(_ bytes: UInt64) -> String {
    ByteCountFormatter.string(fromByteCount: Int64(bytes), countStyle: .binary)
}

/// "1 entry", "3 entries".
func countedEntries(_ count: Int) -> String {
    count == 1 ? "1 entry" : "\(count) entries"
}

struct Build: ParsableCommand, Reporting {
    static let configuration = CommandConfiguration(
        abstract: "Pack a content folder into <id>-<version>.zip and <id>-<version>.manifest.json.",
        discussion: """
            <folder> is a plain folder, whose files become Contents/, or an Xcode In-App Purchase \
            Content folder holding ContentInfo.plist and Contents/ (the flags may then be omitted, and \
            must agree with the plist when given). Symbolic links and special files inside it are refused \
            (<folder> itself may be a link); .DS_Store, .git, .svn, .hg and CVS are left out, as Xcode \
            leaves them out of bundles. \
            Entries are sorted and carry the time in SOURCE_DATE_EPOCH (default 1980-01-01T00:00:00Z) \
            and fixed permissions, so the same input always gives the same bytes.
            """)

    @Argument(help: "The content folder.")
    var folder: String

    @Option(name: .customLong("product-id"), help: "The product identifier, e.g. com.example.game.levels1.")
    var productId: String?

    @Option(name: .customLong("content-version"), help: "The content version: integers separated by periods, e.g. 1.0.")
    var contentVersion: String?

    @Option(name: .shortAndLong, help: "The folder to write into (created if missing).")
    var output: String = "."

    @Option(help: "Compression level: 0 stores; 1-9 match zip -<level>'s size over the whole archive at the least CPU (a level per kind of file, chosen from samples); 10-12 smallest and slowest.")
    var level: Int = 6

    @Option(
        help: ArgumentHelp(
            "A previous build of this product: its archive (with the manifest beside it), its manifest, or its output folder (holding several, the newest older than this version).",
            discussion: "Unchanged files take their compressed bytes from it; the output is byte for byte what a build without it gives."))
    var previous: String?

    @Flag(
        name: .customLong("no-sync"),
        help: "Do not wait for the disk: the archive is complete when the command returns, but a power cut may lose it (build it again).")
    var noSync = false

    @Flag(help: "Print one JSON object describing the result on stdout.")
    var json = false

    func run() throws {
        signal(SIGXFSZ, SIG_IGN)  // a file-size limit then fails the write cleanly instead of killing us
        let handlers = Interruption.removeUnfinishedFilesOnStop(tool: "iap-pack")
        try withExtendedLifetime(handlers) { try reporting(pack) }
    }

    private func pack() throws(ArchiveError) {
        let started = Date()
        var options = PackOptions(outputDirectory: output, level: level, timestamp: try ArchiveTimestamp.fromEnvironment())
        if let productId { options.productId = try ProductIdentifier(productId) }
        if let contentVersion { options.contentVersion = try ContentVersion(contentVersion) }
        options.previous = previous
        options.sync = !noSync
        let line: ProgressLine? = isatty(STDERR_FILENO) == 1 && !json ? ProgressLine() : nil
        var callback: (@Sendable (PackProgress) -> Void)?
        if let line { callback = { line.update($0) } }
        let result = try ArchivePacker.pack(folder: folder, options: options, progress: callback)
        line?.finish()
        let m = result.manifest
        let seconds = Date().timeIntervalSince(started)
        if json {
            reporter.printJSON(
                BuildOutput(
                    archive: result.archivePath, manifest: result.manifestPath, productId: m.productId.rawValue,
                    contentVersion: m.contentVersion.string, archiveSize: m.archiveSize, sha256: m.archiveSHA256,
                    contentLength: m.contentLength, entries: m.entries.count, reusedEntries: result.reusedEntries,
                    reusedBytes: result.reusedBytes, leftOut: result.leftOut, seconds: seconds))
        } else {
            let percent = m.contentLength == 0 ? 100 : Double(m.archiveSize) * 100 / Double(m.contentLength)
            print(
                """
                packed \(m.productId) \(m.contentVersion)
                  archive   \(result.archivePath) (\(humanBytes(m.archiveSize)), \(countedEntries(m.entries.count)))
                  manifest  \(result.manifestPath)
                  sha256    \(m.archiveSHA256)
                  content   \(humanBytes(m.contentLength)) uncompressed; the archive is \(String(format: "%.1f", percent))% of that
                  took      \(String(format: "%.2f", seconds)) s
                """)
            if let previous {
                print("  reused    \(countedEntries(result.reusedEntries)) (\(humanBytes(result.reusedBytes)) compressed) from \(previous)")
            }
            if !result.leftOut.isEmpty {
                let shown = result.leftOut.prefix(3).joined(separator: ", ") + (result.leftOut.count > 3 ? " and \(result.leftOut.count - 3) more" : "")
                print("  left out  \(shown): Finder and version-control files, which Xcode leaves out of bundles too")
            }
            for leftover in result.removedLeftovers {
                print("  removed   \(leftover), left by a build that was stopped")
            }
        }
    }

    struct BuildOutput: Encodable {
        let archive, manifest, productId, contentVersion: String
        let archiveSize: UInt64
        let sha256: String
        let contentLength: UInt64
        let entries: Int
        let reusedEntries: Int
        let reusedBytes: UInt64
        let leftOut: [String]
        let seconds: Double
    }
}

/// A progress line on stderr, redrawn at most ten times a second.
final class ProgressLine: @unchecked Sendable {
    private let lock = NSLock()
    private var last = Date.distantPast

    func update(_ progress: PackProgress) {
        lock.lock()
        defer { lock.unlock() }
        let now = Date()
        guard now.timeIntervalSince(last) >= 0.1 || progress.bytesDone == progress.bytesTotal else { return }
        last = now
        let fraction = progress.bytesTotal == 0 ? 1 : Double(progress.bytesDone) / Double(progress.bytesTotal)
        let line = "\rpacking " + String(format: "%3.0f%%", fraction * 100) + "  \(humanBytes(progress.bytesDone)) of \(humanBytes(progress.bytesTotal))   "
        Console.err(line)
    }

    func finish() { Console.err("\r\u{1B}[K") }
}

struct Verify: ParsableCommand, Reporting {
    static let configuration = CommandConfiguration(
        abstract: "Check an archive: structure, every CRC, the plist, and the manifest beside it if there is one.")

    @Argument(help: "The archive.")
    var archive: String

    @Option(help: "The manifest to check against (default: <archive without .zip>.manifest.json, if present).")
    var manifest: String?

    @Flag(help: "Print one JSON object describing the result on stdout.")
    var json = false

    func run() throws {
        try reporting { () throws(ArchiveError) in
            let report = try ArchiveVerifier.verify(archive: archive, manifest: manifest)
            if json {
                reporter.printJSON(report)
            } else {
                print(
                    """
                    ok: \(report.archive) holds \(report.productId) \(report.contentVersion)
                      \(countedEntries(report.entryCount)), \(humanBytes(report.contentLength)) uncompressed, every CRC-32 correct
                      sha256 \(report.archiveSHA256)
                      \(report.manifest.map { "matches \($0) (every entry's SHA-256, size and offset)" } ?? "no manifest beside it: hashes not compared")
                    """)
            }
        }
    }
}

struct Inspect: ParsableCommand, Reporting {
    static let configuration = CommandConfiguration(abstract: "Print an archive's metadata and entries.")

    @Argument(help: "The archive.")
    var archive: String

    @Flag(help: "Print one JSON object on stdout.")
    var json = false

    struct Output: Encodable {
        let archive: String
        let productId: String
        let contentVersion: String
        let archiveSize: UInt64
        let contentLength: UInt64
        let entries: [Entry]
        struct Entry: Encodable {
            let path: String
            let method: String
            let uncompressedSize: UInt64
            let compressedSize: UInt64
            let crc32: UInt32
            let localHeaderOffset: UInt64
            let dataOffset: UInt64
        }
    }

    func run() throws {
        try reporting { () throws(ArchiveError) in
            let reader = try ArchiveReader(path: archive)
            let info = try reader.contentInfo()
            let entries = reader.entries.map {
                Output.Entry(
                    path: $0.path, method: $0.method.rawValue, uncompressedSize: $0.uncompressedSize,
                    compressedSize: $0.compressedSize, crc32: $0.crc32,
                    localHeaderOffset: $0.localHeaderOffset, dataOffset: $0.dataOffset)
            }
            let output = Output(
                archive: archive, productId: info.productIdentifier.rawValue,
                contentVersion: info.contentVersion.string, archiveSize: reader.size,
                contentLength: entries.reduce(0) { $0 + $1.uncompressedSize }, entries: entries)
            if json {
                reporter.printJSON(output)
                return
            }
            print("\(archive): \(output.productId) \(output.contentVersion), \(humanBytes(output.archiveSize)), \(countedEntries(entries.count)), \(humanBytes(output.contentLength)) uncompressed")
            print("  method   uncompressed   compressed  crc32     offset      path")
            for e in entries {
                let method = e.method.padding(toLength: 7, withPad: " ", startingAt: 0)
                print("  " + method + String(format: " %13llu %12llu  %08x %10llu  ", e.uncompressedSize, e.compressedSize, e.crc32, e.localHeaderOffset) + e.path)
            }
        }
    }
}

struct Extract: ParsableCommand, Reporting {
    static let configuration = CommandConfiguration(
        abstract: "Safely extract an archive into a new folder, as a device installs it.",
        discussion: """
            Entries stream into a temporary folder beside <destination>, which is renamed into place only \
            when every size and CRC-32 is right; unsafe paths, links, duplicates and zip bombs are refused. \
            <destination> must not exist.
            """)

    @Argument(help: "The archive.") var archive: String
    @Argument(help: "The folder to create, e.g. <content-dir>/<product>/<version>.") var destination: String
    @Option(name: .customLong("product-id"), help: "Refuse the archive unless its plist names this product.") var productId: String?
    @Option(name: .customLong("content-version"), help: "Refuse the archive unless its plist names this version.") var contentVersion: String?
    @Flag(help: "Print one JSON object on stdout.") var json = false

    func run() throws {
        let handlers = Interruption.removeUnfinishedFilesOnStop(tool: "iap-pack")
        try withExtendedLifetime(handlers) { try reporting(extract) }
    }

    private func extract() throws(ArchiveError) {
        var expected: ContentInfo?
        if productId != nil || contentVersion != nil {
            let info = try ArchiveReader(path: archive).contentInfo()
            expected = ContentInfo(
                productIdentifier: try productId.map { id throws(ArchiveError) in try ProductIdentifier(id) } ?? info.productIdentifier,
                contentVersion: try contentVersion.map { v throws(ArchiveError) in try ContentVersion(v) } ?? info.contentVersion)
        }
        let info = try SafeExtractor.extract(archive: archive, to: destination, expecting: expected)
        if json {
            reporter.printJSON(["contentURL": destination, "productId": info.productIdentifier.rawValue, "contentVersion": info.contentVersion.string])
        } else {
            print("installed \(info.productIdentifier) \(info.contentVersion) at \(destination)")
        }
    }
}

import ArgumentParser
import Base64URL
import CommandLineReporting
import ContentFetch
import DurableFiles
import Foundation
import IAPProtocol
import TransactionQueue

#if canImport(Glibc)
    import Glibc
#endif

@main
struct IAPFetch: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap-fetch",
        abstract: "Downloads purchased content resumably, verifies and installs it, then finishes the transaction.",
        discussion: """
            Exit codes: 0 every transaction finished, or left to the app because there is nothing to \
            download for it: the server has no hosted content for its product (a consumable, say) or it \
            was refunded (`run` says which and leaves it unfinished), 1 some failed (they stay unfinished \
            and are retried by the next run; the reason is printed; for `get`, also a product without \
            hosted content or a refunded purchase), 130 interrupted (paused; the next run resumes).
            """,
        version: IAPContentVersion.current,
        subcommands: [Run.self, Get.self, Status.self, Installed.self, Cancel.self])
}

/// `--limit-rate`: bytes per second, with an optional K, M or G (binary) suffix.
struct Rate: ExpressibleByArgument {
    let bytesPerSecond: Int

    init?(argument: String) {
        let units: [Character: Int] = ["K": 1 << 10, "M": 1 << 20, "G": 1 << 30]
        let multiplier = argument.last.flatMap { units[Character($0.uppercased())] } ?? 1
        guard let number = Int(multiplier == 1 ? argument : String(argument.dropLast())), number > 0,
            number <= Int.max / multiplier
        else { return nil }
        bytesPerSecond = number * multiplier
    }
}

struct Options: ParsableArguments {
    @Option(help: "The content server, e.g. http://127.0.0.1:8080.") var server: String
    @Option(name: .customLong("content-dir"), help: "Where content is installed: <dir>/<productId>/<contentVersion>/.") var contentDir: String
    @Flag(help: "One JSON object per line for every update and every finished transaction.") var json = false
    @Option(name: .customLong("limit-rate"), help: "Cap the bandwidth, e.g. 500K or 20M bytes per second.") var limitRate: Rate?
    @Option(help: "Connections per download (1-16): parallel ranges for archives of 32 MiB and more.") var connections = 1
    @Option(
        name: .customLong("ca-file"),
        help: ArgumentHelp(
            "A certificate authority (PEM) to trust for https:// servers besides the system's, e.g. the private CA of a staging server; repeatable.",
            valueName: "pem"))
    var caFiles: [String] = []

    func validate() throws {
        guard (1...16).contains(connections) else {
            throw ValidationError("--connections \(connections) is out of range: use 1 to 16")
        }
        guard let url = URL(string: server), url.scheme == "http" || url.scheme == "https", url.host != nil else {
            throw ValidationError("--server \(server) is not an http(s) URL such as http://127.0.0.1:8080")
        }
    }

    /// Reports errors as the other tools do under `--json`: the envelope on stdout as well.
    var reporter: Reporter { Reporter(tool: "iap-fetch", json: json) }

    func configuration() -> FetchConfiguration {
        var configuration = FetchConfiguration(server: server, contentDirectory: contentDir)
        configuration.userAgent = "iap-fetch/" + IAPContentVersion.current
        configuration.connections = connections
        configuration.rateLimit = limitRate?.bytesPerSecond
        configuration.additionalTrustRootFiles = caFiles
        return configuration
    }
}

/// Notices go to stderr; errors too, and under `--json` also as the envelope on stdout
/// (`Options.reporter`). Exit codes are documented on the command.
let reporter = Reporter(tool: "iap-fetch")

/// Runs a fetcher over a source, printing its updates, and exits with the documented code.
/// `emptyQueue`: what to say when the source held nothing to do (a run that prints nothing at
/// all looks like one that did not start). `requireContent`: a transaction with nothing to
/// download (its product has no hosted content, or it was refunded) is a failure (`get`, asked
/// for that one's content) rather than left to the app.
/// `quietlyFinished`: transactions finished before the run (an update check), not said to be finished again.
/// `then`: called with what the run did, after it is printed and before the exit code is decided
/// (not when the run was paused).
func runFetcher(
    _ options: Options, parallel: Int = 1, source: any TransactionSource, emptyQueue: String? = nil, requireContent: Bool = false, quietlyFinished: Set<String> = [],
    then: (RunSummary) -> Void = { _ in }
) async throws {
    let fetcher: ContentFetcher
    var configuration = options.configuration()
    configuration.parallelDownloads = parallel
    do { fetcher = try ContentFetcher(configuration: configuration, source: source) } catch {
        throw options.reporter.failure(error)
    }
    // Ctrl-C pauses: the journal is saved and the next run resumes.
    signal(SIGINT, SIG_IGN)
    let interrupt = DispatchSource.makeSignalSource(signal: SIGINT, queue: .global())
    interrupt.setEventHandler { Task { await fetcher.pauseAll() } }
    interrupt.resume()
    let printer = Task { await Printer(json: options.json).print(fetcher.updates) }
    var summary = await fetcher.start()
    if requireContent {
        summary.failed += (summary.withoutContent + summary.revoked).map { ($0.transactionId, $0.reason) }
        summary.withoutContent = []
        summary.revoked = []
    }
    await fetcher.shutdown()
    await printer.value
    interrupt.cancel()
    for id in summary.finished where !quietlyFinished.contains(id) {
        if options.json { emitJSON(["event": "transaction-finished", "transactionId": id]) } else { print("finished transaction \(id)") }
    }
    // Refunded purchases are not failures: nothing will ever be downloaded for them. An update
    // check asks about finished ones too (a queue keeps the signed transaction as bought).
    for (id, product, reason) in summary.revoked {
        if options.json {
            emitJSON(["event": "transaction-revoked", "transactionId": id, "productId": product, "message": reason.message])
        }
        if quietlyFinished.contains(id) {
            reporter.note("transaction \(id) (\(product)) was refunded or revoked, so its content is not brought up to date")
        } else {
            reporter.note("transaction \(id) (\(product)) was refunded or revoked, so it gets no content; it stays unfinished for the app to withdraw what it bought and finish")
        }
    }
    for (id, error) in summary.failed {
        if options.json {
            emitJSON(["event": "transaction-failed", "transactionId": id, "code": error.code.rawValue, "message": error.message])
        }
        reporter.note("transaction \(id) failed and stays unfinished: \(error.message)")
    }
    for (id, product, reason) in summary.withoutContent {
        if options.json {
            emitJSON(["event": "transaction-without-content", "transactionId": id, "productId": product, "message": reason.message])
        }
        let left = quietlyFinished.contains(id) ? "" : "; it stays unfinished for the app to deliver and finish"
        reporter.note("transaction \(id) (\(product)) has nothing to download: \(reason.message)\(left)")
    }
    for id in summary.cancelled {
        if options.json { emitJSON(["event": "download-cancelled", "downloadId": id]) }
        reporter.note("download \(id) was cancelled; its transaction stays unfinished")
    }
    if let emptyQueue, summary.finished.isEmpty, summary.failed.isEmpty, summary.withoutContent.isEmpty, summary.revoked.isEmpty, summary.cancelled.isEmpty,
        summary.paused.isEmpty, !summary.interrupted
    {
        reporter.note(emptyQueue)
    }
    if summary.interrupted {
        reporter.note("paused; run again to resume")
        throw ExitCode(130)
    }
    then(summary)
    if !summary.failed.isEmpty || !summary.cancelled.isEmpty { throw ExitCode(1) }
}

func emitJSON(_ object: [String: Any]) {
    guard let data = try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys, .withoutEscapingSlashes]) else { return }
    Console.out(data + Data("\n".utf8))
}

/// Renders updates: NDJSON, a redrawn progress line on a terminal, or plain periodic lines.
struct Printer {
    let json: Bool
    let terminal = isatty(STDOUT_FILENO) == 1

    func print(_ updates: AsyncStream<DownloadUpdate>) async {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        var lastPlain: [String: (DownloadState, Date)] = [:]
        var seen = Set<String>()
        // When each download first moved bytes in this run, and how many it had then.
        var transferStart: [String: (ContinuousClock.Instant, Int64)] = [:]
        var live = LiveLines()
        for await update in updates {
            if json {
                if let data = try? encoder.encode(update) { Console.out(data + Data("\n".utf8)) }
                continue
            }
            if update.state == .active, transferStart[update.id] == nil { transferStart[update.id] = (.now, update.bytesReceived) }
            let took = update.state == .finished ? transferStart[update.id].map { Self.took(.now - $0.0, bytes: update.bytesReceived - $0.1) } : nil
            // Finished before this run said anything of it: nothing was fetched, and a full bar
            // at 0.0 MB/s read as a download done again.
            let line = seen.insert(update.id).inserted && update.state == .finished ? alreadyInstalled(update) : describe(update, took: took)
            if terminal {
                live.show(update.id, line, active: update.state == .active)
            } else {
                let previous = lastPlain[update.id]
                if previous?.0 != update.state || Date().timeIntervalSince(previous?.1 ?? .distantPast) >= 2 {
                    lastPlain[update.id] = (update.state, Date())
                    // Written at once: through `print`, a pipe (a CI log) saw nothing until the end.
                    Console.out(line + "\n")
                }
            }
        }
    }

    /// The downloads under way, one redrawn line each below the lines already said (several
    /// run at once): each update moves the cursor back to the first of them, clears from there,
    /// prints what is said for good, then every line under way again.
    struct LiveLines {
        private var lines: [(id: String, text: String)] = []
        private var drawn = 0

        /// `active`: the download's line stays under way; otherwise it is said for good.
        mutating func show(_ id: String, _ text: String, active: Bool) {
            let index = lines.firstIndex { $0.id == id }
            var said = ""
            if active {
                if let index { lines[index].text = text } else { lines.append((id, text)) }
            } else {
                if let index { lines.remove(at: index) }
                said = text + "\n"
            }
            // A line longer than the terminal wraps, and the cursor would then come back short
            // of the first line: each line under way is cut to the width.
            let width = Self.columns() - 1
            var output = drawn > 0 ? "\u{1B}[\(drawn)A" : ""
            output += "\r\u{1B}[J" + said
            for line in lines { output += String(line.text.prefix(width)) + "\n" }
            drawn = lines.count
            Console.out(output)
        }

        static func columns() -> Int {
            var size = winsize()
            guard ioctl(STDOUT_FILENO, UInt(TIOCGWINSZ), &size) == 0, size.ws_col > 20 else { return 80 }
            return Int(size.ws_col)
        }
    }

    /// "12.3 MB in 1.4 s, 8.8 MB/s": what this run fetched, from its first bytes to the install.
    static func took(_ elapsed: Duration, bytes: Int64) -> String {
        let seconds = Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
        let size = megabytes(bytes)
        // A rate over a few milliseconds says nothing.
        guard seconds >= 0.05 else { return "\(size) in \(String(format: "%.2f", seconds)) s" }
        return "\(size) in \(String(format: "%.1f", seconds)) s, \(String(format: "%.1f", Double(bytes) / seconds / 1e6)) MB/s"
    }

    /// "41.8 KB" or "12.3 MB".
    static func megabytes(_ bytes: Int64) -> String {
        bytes < 1_000_000 ? String(format: "%.1f KB", Double(bytes) / 1e3) : String(format: "%.1f MB", Double(bytes) / 1e6)
    }

    func alreadyInstalled(_ u: DownloadUpdate) -> String {
        "\(u.productId) \(u.contentVersion ?? "") already installed" + (u.contentURL.map { " -> \($0)" } ?? "")
    }

    /// `took`: for a finished download, what this run fetched and how long it took.
    func describe(_ u: DownloadUpdate, took: String? = nil) -> String {
        let width = 24
        let filled = Int(u.progress * Double(width))
        let bar = String(repeating: "#", count: filled) + String(repeating: ".", count: width - filled)
        let eta = u.timeRemaining < 0 ? "--" : String(format: "%.0fs", u.timeRemaining)
        // A rate and time remaining say nothing once it is over (and a download shorter than the
        // rate's first sample showed 0.0 MB/s).
        let pace = u.state.isFinal ? "" : "\(String(format: "%.1f MB/s", u.bytesPerSecond / 1e6)) eta \(eta) "
        var text =
            "\(u.productId) \(u.contentVersion ?? "") [\(bar)] \(String(format: "%3.0f%%", u.progress * 100)) "
            + "\(Self.megabytes(u.bytesReceived))/\(u.expectedContentLength < 0 ? "?" : Self.megabytes(u.expectedContentLength)) \(pace)\(u.state.rawValue)"
        if let delta = u.delta, !u.state.isFinal { text += " (\(delta))" }
        if let took { text += " (\(took))" }
        if let error = u.error { text += ": \(error.message)" }
        if let url = u.contentURL { text += " -> \(url)" }
        return text
    }
}

struct Run: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Process every unfinished transaction in a queue folder (iap-sandbox's <dir>/queue).",
        discussion: """
            With --updates, finished purchases too (consumables aside): each asks the server again, and content is \
            downloaded only where the version the server grants now is not the one installed (a delta update when \
            it can), as an app does when a new content version is out. Each product is then said to be updated, \
            up to date, or refunded (its content stays installed: the app decides).
            """)
    @OptionGroup var options: Options
    @Option(help: "The transaction queue folder.") var queue: String
    @Flag(help: "Also bring the content of finished purchases up to date.") var updates = false
    @Option(help: "Transactions fetched at once (1-8); two of the same product never run together.") var parallel = 3

    func validate() throws {
        guard (1...8).contains(parallel) else {
            throw ValidationError("--parallel \(parallel) is out of range: use 1 to 8")
        }
    }

    func run() async throws {
        let queued: FileTransactionQueue
        do { queued = try FileTransactionQueue.existing(folder: queue) } catch {
            throw options.reporter.failure(error)
        }
        guard updates else {
            try await runFetcher(options, parallel: parallel, source: queued, emptyQueue: "no unfinished transactions in \(queue): nothing to download")
            return
        }
        let before = Dictionary(InstalledContent.all(in: options.contentDir).map { ($0.productId, $0.contentVersion) }, uniquingKeysWith: { $1 })
        let all: [QueuedTransaction]
        do { all = try queued.all() } catch { throw options.reporter.failure(error) }
        let product = Dictionary(all.map { ($0.transactionId, $0.productId) }, uniquingKeysWith: { $1 })
        // Said per product once the run is over; a product may be updated while another failed.
        func report(_ summary: RunSummary) {
            // A product whose purchases were all refunded is not "up to date": it is owned no more
            // (its content stays, which is the app's to decide).
            let owned = Set(summary.finished.compactMap { product[$0] })
            let refunded = Set(summary.revoked.map(\.productId)).subtracting(owned)
            for content in InstalledContent.all(in: options.contentDir) {
                let was = before[content.productId]
                if refunded.contains(content.productId) {
                    if options.json {
                        emitJSON(["event": "content-refunded", "productId": content.productId, "contentVersion": content.contentVersion])
                    } else {
                        print("\(content.productId) \(content.contentVersion) stays installed, but its purchase was refunded: the app decides whether to remove it")
                    }
                } else if options.json {
                    emitJSON(
                        was == content.contentVersion
                            ? ["event": "content-up-to-date", "productId": content.productId, "contentVersion": content.contentVersion]
                            : ["event": "content-updated", "productId": content.productId, "from": was ?? NSNull(), "to": content.contentVersion])
                } else if was == content.contentVersion {
                    print("\(content.productId) \(content.contentVersion) is up to date")
                } else {
                    print("\(content.productId): \(was.map { "updated from \($0) to" } ?? "installed") \(content.contentVersion)")
                }
            }
        }
        try await runFetcher(
            options, parallel: parallel, source: OwnedTransactions(queue: queued), emptyQueue: "no purchases in \(queue) that own content: nothing to bring up to date",
            quietlyFinished: Set(all.filter(\.isFinished).map(\.transactionId)), then: report)
    }
}

/// One signed transaction from a file; finishing it only reports it (there is no queue to update).
struct SingleTransaction: TransactionSource {
    let transaction: QueuedTransaction
    func unfinishedTransactions() async throws -> [QueuedTransaction] { [transaction] }
    func finish(transactionId: String) async throws {}
}

struct Get: AsyncParsableCommand {
    static let configuration = CommandConfiguration(abstract: "Download the content of one signed transaction (a JWS in a file).")
    @OptionGroup var options: Options
    @Option(help: "A file holding the signed transaction.") var transaction: String

    func run() async throws {
        // Looked at first: a folder read as text is "not UTF-8", and a large file passed by
        // mistake (the archive, say) would be read whole. A pipe is fine: `<(...)` in a shell.
        var info = stat()
        if stat(transaction, &info) == 0 {
            let kind = info.st_mode & S_IFMT
            let problem =
                kind == S_IFDIR
                ? "is a folder" : kind == S_IFREG && info.st_size > 1 << 20 ? "is \(info.st_size) bytes; a signed transaction is a few KB" : nil
            if let problem {
                throw options.reporter.failure("invalid-input", "--transaction \(transaction) \(problem): pass the file holding the JWS the app got from StoreKit")
            }
        }
        // Read through a handle, at most 1 MiB: `String(contentsOfFile:)` read nothing from a pipe.
        guard let handle = FileHandle(forReadingAtPath: transaction) else {
            // The system's reason (missing, permissions), in the project's wording.
            let reason = ioFailureMessage(access(transaction, R_OK) != 0 ? errno : EIO, action: "read --transaction", path: transaction)
            throw options.reporter.failure("invalid-input", "\(reason) (it should hold the signed transaction: the JWS the app got from StoreKit)")
        }
        let bytes = (try? handle.read(upToCount: 1 << 20)) ?? nil
        try? handle.close()
        guard let bytes, let decoded = String(validating: bytes, as: UTF8.self) else {
            throw options.reporter.failure(
                "invalid-input", "cannot read --transaction \(transaction): it is empty or not UTF-8 text (it should hold the signed transaction: the JWS the app got from StoreKit)")
        }
        let text = decoded.trimmingCharacters(in: .whitespacesAndNewlines)
        // Only the ids are read here; the server verifies the signature.
        let parts = text.split(separator: ".")
        guard parts.count == 3, let payload = Base64URL.decode(parts[1].utf8),
            let object = try? JSONSerialization.jsonObject(with: Data(payload)) as? [String: Any],
            let id = object["transactionId"] as? String, let product = object["productId"] as? String
        else {
            throw options.reporter.failure(
                "invalid-input", "--transaction \(transaction) does not hold a signed transaction (a JWS whose payload has transactionId and productId): pass the JWS the app got from StoreKit")
        }
        try await runFetcher(
            options, source: SingleTransaction(transaction: QueuedTransaction(transactionId: id, productId: product, signedTransaction: text)), requireContent: true)
    }
}

struct Status: ParsableCommand {
    static let configuration = CommandConfiguration(abstract: "Show every download's state from the journal.")
    @Option(name: .customLong("content-dir"), help: "The content folder.") var contentDir: String
    @Flag(help: "Print JSON.") var json = false

    func run() throws {
        let journal: DownloadJournal?
        let records: [DownloadRecord]
        do {
            journal = try DownloadJournal.existing(contentDirectory: contentDir)
            records = try journal?.listed() ?? []
        } catch {
            throw Reporter(tool: "iap-fetch", json: json).failure(error)
        }
        if json {
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
            encoder.dateEncodingStrategy = .iso8601
            print(String(decoding: try encoder.encode(records), as: UTF8.self))
            return
        }
        if journal == nil {
            print("no downloads yet: \(contentDir) does not exist (pass the --content-dir that iap-fetch get or run used)")
        } else if records.isEmpty {
            print("no downloads yet")
        }
        for r in records {
            let expected = r.delta?.bytesToFetch ?? r.expectedLength
            let progress = expected > 0 ? Double(r.recordedLength) / Double(expected) * 100 : 0
            print(
                "\(r.id)  \(r.productId) \(r.contentVersion)  \(r.state.rawValue)  \(String(format: "%.0f%%", r.state == .finished ? 100.0 : progress))\(r.error.map { "  \($0.message)" } ?? "")\(r.contentPath.map { "  \($0)" } ?? "")"
            )
            if let delta = r.delta { print("    \(delta.summary)") }
        }
    }
}

struct Installed: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "List the content installed in a content folder: each product's version and its folder (the contentURL an app reads).")
    @Option(name: .customLong("content-dir"), help: "The content folder.") var contentDir: String
    @Flag(help: "Print JSON: [{productId, contentVersion, contentURL}].") var json = false

    func run() throws {
        var isFolder: ObjCBool = false
        guard FileManager.default.fileExists(atPath: contentDir, isDirectory: &isFolder), isFolder.boolValue else {
            throw Reporter(tool: "iap-fetch", json: json).failure(
                "not-found", "\(contentDir) is not a folder: pass the --content-dir that iap-fetch get or run used")
        }
        let installed = InstalledContent.all(in: contentDir)
        if json {
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
            print(String(decoding: try encoder.encode(installed), as: UTF8.self))
            return
        }
        if installed.isEmpty { print("nothing installed in \(contentDir) yet") }
        for content in installed { print("\(content.productId)  \(content.contentVersion)  \(content.contentURL.path)") }
    }
}

struct Cancel: ParsableCommand {
    static let configuration = CommandConfiguration(abstract: "Cancel a download: its partial file is deleted; its transaction stays unfinished.")
    @Argument(help: "The download id (see status).") var id: String
    @Option(name: .customLong("content-dir"), help: "The content folder.") var contentDir: String

    func run() throws {
        do {
            guard let journal = try DownloadJournal.existing(contentDirectory: contentDir) else {
                throw ValidationError("no download \(id): \(contentDir) does not exist (pass the --content-dir that iap-fetch get or run used)")
            }
            switch try journal.cancel(id) {
            case .cancelled:
                print("cancelled \(id); its transaction stays unfinished")
            case .requested:
                print("asked the running iap-fetch to cancel \(id); it stops within a few MiB and leaves the transaction unfinished")
            case .alreadyFinished(let path):
                throw ValidationError("\(id) is already finished and installed at \(path)")
            case .unknown:
                throw ValidationError("no download \(id) in \(contentDir): see iap-fetch status")
            }
        } catch let error as FetchError {
            throw reporter.failure(error)
        }
    }
}

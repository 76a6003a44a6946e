import AsyncHTTPClient
import ContentArchive
import Crypto
import Foundation
import NIOCore
import NIOPosix
import SystemPackage
import TransactionQueue

/// How the fetcher works.
public struct FetchConfiguration: Sendable {
    /// The content server, e.g. http://127.0.0.1:8080.
    public var server: String
    /// Installed content goes to `<contentDirectory>/<productId>/<contentVersion>/`.
    public var contentDirectory: String
    /// Attempts per download in one run before it is `failed` (the transaction stays unfinished).
    public var maxAttempts = 5
    /// No byte for this long aborts the attempt (and it is retried).
    public var stallTimeout: Duration = .seconds(30)
    /// Optional bandwidth cap, bytes per second (shared by a download's connections).
    public var rateLimit: Int?
    /// The journal records progress every this many bytes: what a killed process can lose at most.
    public var journalInterval: Int64 = 1 << 20
    /// The partial file is synced to disk at most this often while bytes arrive (and whenever a
    /// transfer pauses or stops): what a power cut can lose, in transfer time. A timer rather than
    /// a byte count because each fsync makes the disk write back what the page cache holds while
    /// the transfer goes on; measured here, syncing every 64 MiB slowed a 1 GiB transfer by a
    /// quarter, and a download shorter than this interval now never waits for the disk.
    public var durableInterval: Duration = .seconds(10)
    /// Connections per download: more than one fetches parallel ranges into the same file and
    /// journal. Archives are split only into parts of at least `minimumSegment` bytes.
    public var connections = 1
    public var minimumSegment: Int64 = 16 << 20

    public init(server: String, contentDirectory: String) {
        self.server = server.hasSuffix("/") ? String(server.dropLast()) : server
        self.contentDirectory = contentDirectory
    }
}

/// What a `start()` did.
public struct RunSummary: Sendable {
    /// Transactions whose content was installed and which were then finished.
    public var finished: [String] = []
    /// Transactions left unfinished because a download failed, with the reason.
    public var failed: [(transactionId: String, error: FetchError)] = []
    /// Downloads paused with `pause(_:)`; `resume(_:)` continues them.
    public var paused: [String] = []
    /// Downloads cancelled; their transactions stay unfinished.
    public var cancelled: [String] = []
    /// `pauseAll()` stopped the run; the next start resumes.
    public var interrupted = false
}

/// The download queue, as `SKPaymentQueue` was for hosted content: takes each unfinished
/// transaction, obtains a grant, downloads resumably, verifies, installs, and only then finishes
/// the transaction. A failed or cancelled download leaves its transaction unfinished so that a
/// later start retries it.
///
/// Downloads are named `<transactionId>-<productId>`; `pause`, `resume` and `cancel` take that id
/// while a `start()` is running or after it returned. Observers read `updates`.
public actor ContentFetcher {
    public let configuration: FetchConfiguration
    public nonisolated let updates: AsyncStream<DownloadUpdate>
    private let continuation: AsyncStream<DownloadUpdate>.Continuation
    private let source: any TransactionSource
    private let journal: DownloadJournal
    private let client: HTTPClient
    private var lastEmitted: [String: ContinuousClock.Instant] = [:]

    private enum Control: Sendable { case pause, cancel }
    /// Thrown through a transfer when a download is paused or cancelled.
    private struct Stop: Error { let control: Control }

    private var pending: [QueuedTransaction] = []
    /// Transactions whose download was paused with `pause(_:)`, by download id.
    private var parked: [String: QueuedTransaction] = [:]
    /// Downloads being processed now.
    private var inFlight: Set<String> = []
    private var controls: [String: Control] = [:]
    private var stopAll = false
    private var loop: Task<Void, Never>?
    private enum Outcome: Sendable {
        case finished(String), failed(String, FetchError), paused(String), cancelled(String), interrupted
    }
    /// What happened, in order; each `start()` reports what happened while it ran.
    private var outcomes: [Outcome] = []
    /// `start()` calls waiting; with none, `outcomes` is emptied so it does not grow for ever.
    private var starts = 0
    private var transfers: [String: PartialArchive] = [:]

    public init(configuration: FetchConfiguration, source: any TransactionSource) throws(FetchError) {
        self.configuration = configuration
        self.source = source
        journal = try DownloadJournal(contentDirectory: configuration.contentDirectory)
        var httpConfiguration = HTTPClient.Configuration()
        httpConfiguration.timeout = .init(connect: .seconds(10), read: .nanoseconds(Int64(configuration.stallTimeout.components.seconds) * 1_000_000_000))
        httpConfiguration.decompression = .disabled
        httpConfiguration.connectionPool.concurrentHTTP1ConnectionsPerHostSoftLimit = max(8, configuration.connections + 1)
        client = HTTPClient(eventLoopGroupProvider: .singleton, configuration: httpConfiguration)
        (updates, continuation) = AsyncStream.makeStream(of: DownloadUpdate.self, bufferingPolicy: .bufferingNewest(1024))
    }

    /// Closes the HTTP client and the update stream.
    public func shutdown() async {
        continuation.finish()
        try? await client.shutdown()
    }

    // MARK: The queue

    /// Processes every unfinished transaction, and returns when none is left to do (downloads
    /// paused with `pause(_:)` stay paused). Downloads that an earlier process left paused or
    /// interrupted are resumed from their journal.
    public func start() async -> RunSummary {
        stopAll = false
        let mark = outcomes.count
        starts += 1
        defer {
            starts -= 1
            if starts == 0 { outcomes.removeAll() }
        }
        do {
            for transaction in try await source.unfinishedTransactions() {
                let id = Self.downloadId(transaction)
                guard !parked.keys.contains(id), !inFlight.contains(id),
                      !pending.contains(where: { $0.transactionId == transaction.transactionId }) else { continue }
                pending.append(transaction)
            }
        } catch {
            outcomes.append(.failed("", FetchError(.install, "cannot read the transaction queue: \(error)")))
        }
        await drain()
        var summary = RunSummary()
        for outcome in outcomes[mark...] {
            switch outcome {
            case .finished(let id): summary.finished.append(id)
            case .failed(let id, let error): summary.failed.append((id, error))
            // Only those still paused: a resumed download reports how it ended.
            case .paused(let id) where parked[id] != nil && !summary.paused.contains(id): summary.paused.append(id)
            case .paused: break
            case .cancelled(let id): summary.cancelled.append(id)
            case .interrupted: summary.interrupted = true
            }
        }
        return summary
    }

    /// Pauses download `id`: its journal is saved, its state becomes `paused`, and the queue goes
    /// on with the other transactions. Returns false when no such download is queued or running.
    @discardableResult
    public func pause(_ id: String) -> Bool {
        if inFlight.contains(id) {
            controls[id] = .pause
            return true
        }
        guard let index = pending.firstIndex(where: { Self.downloadId($0) == id }) else { return false }
        let transaction = pending.remove(at: index)
        parked[id] = transaction
        persistState(id, transaction, .paused)
        outcomes.append(.paused(id))
        return true
    }

    /// Resumes a download paused with `pause(_:)`, from the bytes on disk. Returns false when it
    /// is not paused.
    @discardableResult
    public func resume(_ id: String) -> Bool {
        if controls[id] == .pause {
            controls[id] = nil
            return true
        }
        guard let transaction = parked.removeValue(forKey: id) else { return false }
        pending.append(transaction)
        persistState(id, transaction, .waiting)
        Task { await self.drain() }
        return true
    }

    /// Cancels download `id`: its partial file is deleted, its state becomes `cancelled`, and its
    /// transaction stays unfinished. Returns false when no such download is queued, running or paused.
    @discardableResult
    public func cancel(_ id: String) -> Bool {
        if inFlight.contains(id) {
            controls[id] = .cancel
            return true
        }
        let transaction: QueuedTransaction
        if let parkedTransaction = parked.removeValue(forKey: id) {
            transaction = parkedTransaction
        } else if let index = pending.firstIndex(where: { Self.downloadId($0) == id }) {
            transaction = pending.remove(at: index)
        } else {
            return false
        }
        persistState(id, transaction, .cancelled)
        outcomes.append(.cancelled(id))
        return true
    }

    /// Pauses everything: the running download saves its journal and the queue stops; the next
    /// `start()` resumes. This is what Ctrl-C does in `iap-fetch`.
    public func pauseAll() {
        stopAll = true
    }

    /// The id of a transaction's download before its grant is known (one product per transaction).
    static func downloadId(_ transaction: QueuedTransaction) -> String {
        "\(transaction.transactionId)-\(transaction.productId)"
    }

    private func drain() async {
        if let loop {
            await loop.value
            return
        }
        let task = Task { await self.processPending() }
        loop = task
        await task.value
        if loop == task { loop = nil }
    }

    private func processPending() async {
        while !stopAll, !pending.isEmpty {
            let transaction = pending.removeFirst()
            let id = Self.downloadId(transaction)
            do {
                try await process(transaction)
                outcomes.append(.finished(transaction.transactionId))
            } catch let stop as Stop {
                switch stop.control {
                case .pause where stopAll:
                    break
                case .pause:
                    parked[id] = transaction
                    outcomes.append(.paused(id))
                case .cancel:
                    outcomes.append(.cancelled(id))
                }
            } catch let error as FetchError {
                outcomes.append(.failed(transaction.transactionId, error))
            } catch {
                outcomes.append(.failed(transaction.transactionId, FetchError(.network, "\(error)")))
            }
        }
        if stopAll { outcomes.append(.interrupted) }
    }

    /// Applies a request made while the download was between transfers.
    private func checkControl(_ id: String) throws(Stop) {
        if stopAll { throw Stop(control: .pause) }
        if let control = controls[id] { throw Stop(control: control) }
        if journal.takeCancelRequest(id) { throw Stop(control: .cancel) }
    }

    /// Records a state chosen while the download is not running, and tells observers.
    private func persistState(_ id: String, _ transaction: QueuedTransaction, _ state: DownloadState) {
        if var record = journal.load(id) {
            if state == .cancelled {
                try? journal.markCancelled(&record)
            } else {
                record.state = state
                record.updatedAt = Date()
                try? journal.save(record)
            }
            emit(update(record))
        } else {
            emit(Self.beforeGrant(transaction, state))
        }
    }

    /// An update for a download whose grant (so its version and size) is not known yet.
    private static func beforeGrant(_ transaction: QueuedTransaction, _ state: DownloadState, error: FetchError? = nil) -> DownloadUpdate {
        DownloadUpdate(id: downloadId(transaction), transactionId: transaction.transactionId, productId: transaction.productId,
                       contentVersion: nil, state: state, progress: 0, bytesReceived: 0, expectedContentLength: -1,
                       timeRemaining: -1, bytesPerSecond: 0, error: error, contentURL: nil)
    }

    // MARK: One transaction

    struct GrantResponse: Decodable {
        struct Download: Decodable {
            let productId: String
            let contentVersion: String
            let contentLength: Int64
            let sha256: String
            let url: String
        }
        let downloads: [Download]
    }

    private func process(_ transaction: QueuedTransaction) async throws {
        let id = Self.downloadId(transaction)
        inFlight.insert(id)
        defer {
            inFlight.remove(id)
            controls[id] = nil
        }
        try checkControl(id)
        let grant = try await requestGrant(transaction)
        for download in grant.downloads {
            let downloadId = "\(transaction.transactionId)-\(download.productId)"
            inFlight.insert(downloadId)
            defer { if downloadId != id { inFlight.remove(downloadId) } }
            try await deliver(download, transaction: transaction)
        }
        Failpoint.hit("installed")
        // Finishing is the last step: every download of this transaction is installed.
        try await source.finish(transactionId: transaction.transactionId)
    }

    private func requestGrant(_ transaction: QueuedTransaction, attempt: Int = 1) async throws -> GrantResponse {
        var request = HTTPClientRequest(url: configuration.server + "/v1/downloads")
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        let body = try JSONSerialization.data(withJSONObject: ["signedTransaction": transaction.signedTransaction])
        request.body = .bytes(ByteBuffer(bytes: body))
        let status: UInt, data: ByteBuffer
        do {
            let response = try await client.execute(request, timeout: .seconds(60))
            status = response.status.code
            data = try await response.body.collect(upTo: 1 << 20)
        } catch {
            return try await retry(attempt, Self.downloadId(transaction), FetchError(.network, "cannot reach \(configuration.server): \(error)")) {
                try await self.requestGrant(transaction, attempt: attempt + 1)
            }
        }
        let message = Self.errorMessage(data)
        switch status {
        case 200:
            guard let grant = try? JSONDecoder().decode(GrantResponse.self, from: Data(data.readableBytesView)) else {
                throw FetchError(.network, "the server's grant is not valid JSON")
            }
            return grant
        case 403 where message.code == "revoked":
            throw emitFailure(transaction, FetchError(.revoked, "transaction \(transaction.transactionId) was refunded or revoked: \(message.text)"))
        case 404:
            throw emitFailure(transaction, FetchError(.noContent, "no content for \(transaction.productId): \(message.text)"))
        case 400, 401, 403:
            throw emitFailure(transaction, FetchError(.refused, "the server refused the purchase (\(status) \(message.code)): \(message.text)"))
        default:
            return try await retry(attempt, Self.downloadId(transaction), FetchError(.network, "the server answered \(status): \(message.text)")) {
                try await self.requestGrant(transaction, attempt: attempt + 1)
            }
        }
    }

    private func emitFailure(_ transaction: QueuedTransaction, _ error: FetchError) -> FetchError {
        emit(Self.beforeGrant(transaction, .failed, error: error))
        return error
    }

    /// Exponential backoff with jitter between attempts; gives up after `maxAttempts`.
    private func retry<T>(_ attempt: Int, _ id: String, _ error: FetchError, _ again: () async throws -> T) async throws -> T {
        guard attempt < configuration.maxAttempts else { throw error }
        try checkControl(id)
        await backoff(attempt)
        try checkControl(id)
        return try await again()
    }

    /// Waits 0.25 s × 2^(attempt−1), plus up to as much again at random so clients do not retry in step.
    private func backoff(_ attempt: Int) async {
        let base = 0.25 * pow(2, Double(attempt - 1))
        try? await Task.sleep(for: .milliseconds(Int((base + Double.random(in: 0...base)) * 1000)))
    }

    private static func errorMessage(_ data: ByteBuffer) -> (code: String, text: String) {
        let object = (try? JSONSerialization.jsonObject(with: Data(data.readableBytesView))) as? [String: Any]
        let error = object?["error"] as? [String: Any]
        return (error?["code"] as? String ?? "", error?["message"] as? String ?? String(decoding: data.readableBytesView.prefix(200), as: UTF8.self))
    }

    // MARK: One download

    private func deliver(_ download: GrantResponse.Download, transaction: QueuedTransaction) async throws {
        let id = "\(transaction.transactionId)-\(download.productId)"
        let destination = configuration.contentDirectory + "/" + download.productId + "/" + download.contentVersion
        var record = journal.load(id) ?? DownloadRecord(
            id: id, transactionId: transaction.transactionId, productId: download.productId, contentVersion: download.contentVersion,
            sha256: download.sha256, expectedLength: download.contentLength, url: download.url, etag: nil, verifiedLength: 0,
            state: .waiting, error: nil, updatedAt: Date(), installedAt: nil, contentPath: nil)
        if record.state == .finished, record.sha256 == download.sha256, FileManager.default.fileExists(atPath: destination) {
            emit(update(record))
            return
        }
        if record.sha256 != download.sha256 || record.contentVersion != download.contentVersion || record.state == .cancelled {
            // Another archive than the one on disk, or a cancelled download: start over.
            unlink(journal.partialPath(id))
            record.sha256 = download.sha256
            record.contentVersion = download.contentVersion
            record.expectedLength = download.contentLength
            record.discardBytes()
        }
        record.url = download.url
        record.error = nil
        var attempt = 0
        while true {
            attempt += 1
            do {
                try checkControl(id)
                try await transfer(&record)
                break
            } catch let stop as Stop {
                controls[id] = nil
                if stop.control == .cancel {
                    try? journal.markCancelled(&record)
                } else {
                    record.state = .paused
                    record.updatedAt = Date()
                    try? journal.save(record)
                }
                emit(update(record))
                throw stop
            } catch let error as FetchError where [.revoked, .noContent, .refused, .busy].contains(error.code) {
                record.state = .failed
                record.error = error
                // A busy download's journal belongs to the process that holds it: leave it alone.
                if error.code != .busy { try? journal.save(record) }
                emit(update(record))
                throw error
            } catch is GrantExpired {
                // Ask for a fresh grant and continue from the bytes already on disk.
                let fresh = try await requestGrant(transaction)
                guard let same = fresh.downloads.first(where: { $0.productId == record.productId }) else {
                    throw FetchError(.noContent, "the new grant no longer lists \(record.productId)")
                }
                record.url = same.url
                if same.sha256 != record.sha256 { return try await deliver(same, transaction: transaction) }
            } catch {
                let failure = error as? FetchError ?? FetchError(.network, "\(error)")
                guard attempt < configuration.maxAttempts else {
                    record.state = .failed
                    record.error = failure
                    try? journal.save(record)
                    emit(update(record))
                    throw failure
                }
                // Waiting to retry; observers see why.
                record.state = .waiting
                record.error = failure
                emit(update(record))
                if !(error is ArchiveChanged) { await backoff(attempt) }
            }
        }
        try install(&record, destination: destination)
    }

    struct GrantExpired: Error {}

    /// The server's archive is not the one the journal describes (a 200 or 416 where a range was
    /// asked, or another ETag); the partial file was discarded.
    struct ArchiveChanged: Error, CustomStringConvertible {
        var description: String { "the archive changed on the server; starting over" }
    }

    /// One attempt: continues the partial file from what the journal says is on disk, over one or
    /// more connections, with `Range` and `If-Range`, hashing as bytes arrive; ends with the
    /// SHA-256 check.
    private func transfer(_ record: inout DownloadRecord) async throws {
        let path = journal.partialPath(record.id)
        let fd: SystemPackage.FileDescriptor
        do {
            fd = try SystemPackage.FileDescriptor.open(path, .readWrite, options: [.create], permissions: [.ownerReadWrite, .groupRead])
        } catch {
            throw FetchError(.install, "cannot write \(path): \(error); check free space and permissions of --content-dir")
        }
        defer { try? fd.close() }
        // The lock tells `iap-fetch cancel` and other runs that this process owns the download.
        guard flock(fd.rawValue, LOCK_EX | LOCK_NB) == 0 else {
            throw FetchError(.busy, "another iap-fetch is downloading \(record.id) into \(configuration.contentDirectory); let it finish or stop it first")
        }
        var segments = record.segments ?? [Segment(start: 0, end: record.expectedLength, done: record.verifiedLength)]
        if record.bootId != nil, record.bootId != BootID.current {
            // The machine restarted since: only the synced bytes are certain to be on disk.
            segments = record.durable ?? [Segment(start: 0, end: record.expectedLength, done: 0)]
        }
        if !Segment.isValid(segments, length: record.expectedLength) {
            segments = [Segment(start: 0, end: record.expectedLength, done: 0)]
        }
        if segments.count == 1 {
            // Bytes past the journal's mark may be torn by a kill: drop them.
            guard ftruncate(fd.rawValue, off_t(segments[0].done)) == 0 else {
                throw FetchError(.install, "cannot truncate \(path): \(String(cString: strerror(errno)))")
            }
            if configuration.connections > 1 {
                segments = Segment.plan(length: record.expectedLength, durable: segments[0].done,
                                        connections: configuration.connections, minimum: configuration.minimumSegment)
            }
        }
        let partial: PartialArchive
        do {
            partial = try PartialArchive(fd: fd, path: path, journal: journal, record: record, segments: segments,
                                         syncInterval: configuration.journalInterval, durableInterval: configuration.durableInterval)
        } catch {
            // The file is shorter than the journal says: start over rather than trust it.
            record.discardBytes()
            try journal.save(record)
            throw error
        }
        transfers[record.id] = partial
        defer {
            record = partial.record
            transfers[record.id] = nil
        }
        let missing = partial.missing
        if missing.isEmpty {
            // Every byte is already on disk (an earlier run stopped before installing).
            partial.record.state = .active
        } else {
            let (id, url, etag, length) = (record.id, record.url, record.etag, record.expectedLength)
            let limit = configuration.rateLimit.map { max(1, $0 / missing.count) }
            let whole = partial.segments.count == 1
            // Bytes waiting for the hash: 8 MiB on one connection, 16 MiB in all on several.
            let window = max(1 << 20, min(8 << 20, (16 << 20) / missing.count))
            do {
                try await withThrowingTaskGroup(of: Void.self) { group in
                    for part in missing {
                        group.addTask {
                            try await self.fetch(id: id, segment: part.segment, from: part.from, to: part.to, length: length,
                                                 whole: whole, url: url, etag: etag, fd: fd, rateLimit: limit,
                                                 window: window)
                        }
                    }
                    try await group.waitForAll()
                }
            } catch {
                // Keep what arrived, unless it belongs to an archive that changed.
                if error is ArchiveChanged {
                    try? partial.restart()
                    try? journal.save(partial.record)
                } else {
                    try? partial.sync()
                }
                throw error
            }
            try partial.sync(durable: false)
        }
        guard let digest = partial.digest() else {
            throw FetchError(.network, "the transfer ended at byte \(partial.hashed) of \(record.expectedLength)")
        }
        guard digest == partial.record.sha256 else {
            // Corrupt bytes: throw them away and fetch again.
            try partial.restart()
            try journal.save(partial.record)
            throw FetchError(.integrity, "the downloaded archive's SHA-256 is \(digest), not the granted \(partial.record.sha256)")
        }
        // Every byte is here and verified: observers see 100% before the install starts.
        emit(update(partial.record, received: partial.record.expectedLength, rate: partial.rate))
        Failpoint.hit("verified")
    }

    /// One connection's part of a transfer: asks for `[from, to)`; `BodyReceiver` writes what
    /// arrives at its offset on the event loop, and each part is then reported to the actor.
    private nonisolated func fetch(id: String, segment: Int, from: Int64, to: Int64, length: Int64, whole: Bool,
                                   url: String, etag: String?, fd: SystemPackage.FileDescriptor, rateLimit: Int?,
                                   window: Int) async throws {
        var request: HTTPClient.Request
        do { request = try HTTPClient.Request(url: url) } catch {
            throw FetchError(.refused, "the grant's URL \(url) is not usable: \(error)")
        }
        let ranged = from > 0 || to < length
        if ranged {
            request.headers.add(name: "Range", value: "bytes=\(from)-\(to - 1)")
            if let etag { request.headers.add(name: "If-Range", value: etag) }
        }
        let receiver = BodyReceiver(fd: fd, window: window, rateLimit: rateLimit)
        // One loop for the channel and the delegate: otherwise every part hops between two threads.
        let task = client.execute(request: request, delegate: receiver, eventLoop: .delegateAndChannel(on: client.eventLoopGroup.next()))
        defer {
            receiver.close()
            task.cancel()
        }
        try await withTaskCancellationHandler {
            var status: UInt = 0
            var position = from
            var end = to
            for try await event in receiver.events {
                switch event {
                case .head(let head):
                    status = head.status.code
                    switch status {
                    case 206:
                        let range = head.headers.first(name: "content-range") ?? ""
                        guard ranged, range.hasPrefix("bytes \(from)-\(to - 1)/") else {
                            throw FetchError(.network, "the server sent range '\(range)' for a request of bytes \(from)-\(to - 1)")
                        }
                    case 200:
                        if ranged {
                            // If-Range did not match: the archive changed. With one connection the
                            // whole new file is coming in this response; with several, every part
                            // starts over.
                            guard whole else { throw ArchiveChanged() }
                            try await restart(id)
                        }
                        (position, end) = (0, length)
                    case 403:
                        receiver.proceed(.collect)
                        continue
                    case 416: throw ArchiveChanged()
                    case 401: throw GrantExpired()
                    case 404: throw FetchError(.noContent, "the archive is no longer on the server")
                    default: throw FetchError(.network, "the server answered \(status)")
                    }
                    try await accept(id, etag: head.headers.first(name: "etag"))
                    receiver.proceed(.write(from: position, to: end))
                case .body(let chunk, let offset):
                    try await self.received(id, segment: segment, at: offset, chunk, writtenThrough: receiver.writtenThrough)
                    receiver.consumed(chunk.readableBytes)
                    position = offset + Int64(chunk.readableBytes)
                case .end(let collected):
                    if status == 403 {
                        let message = Self.errorMessage(collected ?? ByteBuffer())
                        throw FetchError(message.code == "revoked" ? .revoked : .refused, message.text)
                    }
                    guard position == end else {
                        throw FetchError(.network, "the transfer ended at byte \(position) of \(end)")
                    }
                    return
                }
            }
            try Task.checkCancellation()
            throw FetchError(.network, "the connection closed at byte \(position) of \(end)")
        } onCancel: {
            task.cancel()
        }
    }

    private func restart(_ id: String) throws {
        guard let partial = transfers[id] else { throw CancellationError() }
        try partial.restart()
    }

    /// A response was accepted: its validator must be the one of the bytes on disk.
    private func accept(_ id: String, etag: String?) throws {
        guard let partial = transfers[id] else { throw CancellationError() }
        if let etag {
            if let known = partial.record.etag, known != etag { throw ArchiveChanged() }
            partial.record.etag = etag
        }
        if partial.record.state != .active {
            partial.record.state = .active
            partial.record.error = nil
            try journal.save(partial.record)
            emit(update(partial.record, received: partial.bytesWritten, rate: partial.rate))
        }
    }

    /// A chunk was written: hash it, sync when due, apply pause or cancel, report progress.
    private func received(_ id: String, segment: Int, at offset: Int64, _ chunk: ByteBuffer, writtenThrough: Int64) throws {
        guard let partial = transfers[id] else { throw CancellationError() }
        try partial.wrote(chunk, segment: segment, at: offset, writtenThrough: writtenThrough)
        if stopAll { throw Stop(control: .pause) }
        if let control = controls[id] { throw Stop(control: control) }
        // Requests from other processes are read at syncs: a file check per chunk would cost more.
        let (recorded, makeDurable) = try partial.syncIfDue()
        if let snapshot = makeDurable { syncInBackground(id, partial: partial, snapshot: snapshot) }
        if recorded, journal.takeCancelRequest(id) { throw Stop(control: .cancel) }
        // Checked before building the update: this runs for every chunk received.
        if progressDue(id) { emit(update(partial.record, received: partial.bytesWritten, rate: partial.rate)) }
    }

    /// Extracts into `<content>/<product>/<version>` atomically, then removes older versions.
    private func install(_ record: inout DownloadRecord, destination: String) throws {
        let expected: ContentInfo
        do {
            expected = ContentInfo(productIdentifier: try ProductIdentifier(record.productId), contentVersion: try ContentVersion(record.contentVersion))
        } catch {
            throw FetchError(.install, "the grant names an invalid product or version: \(error)")
        }
        let parent = configuration.contentDirectory + "/" + record.productId
        // An extraction killed part-way leaves its temporary folder: remove it before trying again.
        for name in (try? FileManager.default.contentsOfDirectory(atPath: parent)) ?? [] where name.hasPrefix(".\(record.contentVersion).extracting-") {
            try? FileManager.default.removeItem(atPath: parent + "/" + name)
        }
        let plist = destination + "/" + ContentInfo.fileName
        if let data = FileManager.default.contents(atPath: plist), (try? ContentInfo(plist: data, source: plist)) == expected {
            // Installed by an earlier run that was stopped before it could record it.
        } else {
            do {
                try SafeExtractor.extract(archive: journal.partialPath(record.id), to: destination, expecting: expected)
            } catch {
                record.state = .failed
                record.error = FetchError(.install, error.message)
                try? journal.save(record)
                emit(update(record))
                throw record.error!
            }
        }
        for name in (try? FileManager.default.contentsOfDirectory(atPath: parent)) ?? [] where !name.hasPrefix(".") && name != record.contentVersion {
            if let version = try? ContentVersion(name), version < expected.contentVersion {
                try? FileManager.default.removeItem(atPath: parent + "/" + name)
            }
        }
        record.state = .finished
        record.error = nil
        record.installedAt = Date()
        record.contentPath = destination
        record.updatedAt = Date()
        try journal.save(record)
        unlink(journal.partialPath(record.id))
        emit(update(record))
    }

    /// fsyncs the partial file on a thread of its own, so that the event loop and this actor go on
    /// receiving and recording (an fsync of seconds of transfer can take a while); the journal then
    /// records `snapshot` as durable, unless the transfer ended meanwhile (its record is final then).
    private func syncInBackground(_ id: String, partial: PartialArchive, snapshot: [Segment]) {
        // A duplicate descriptor: the transfer may close its own before this fsync runs.
        let duplicate = dup(partial.fd.rawValue)
        guard duplicate >= 0 else { return }
        let identity = ObjectIdentifier(partial)
        Task {
            let synced = (try? await NIOThreadPool.singleton.runIfActive { fsync(duplicate) == 0 }) ?? false
            close(duplicate)
            self.backgroundSyncDone(id, identity: identity, snapshot: synced ? snapshot : nil)
        }
    }

    private func backgroundSyncDone(_ id: String, identity: ObjectIdentifier, snapshot: [Segment]?) {
        guard let partial = transfers[id], ObjectIdentifier(partial) == identity else { return }
        if let snapshot { try? partial.madeDurable(snapshot) } else { try? partial.madeDurable([]) }
    }

    // MARK: Updates

    private func update(_ record: DownloadRecord, received bytes: Int64? = nil, rate: RateEstimator = RateEstimator()) -> DownloadUpdate {
        let received = record.state == .finished ? record.expectedLength : (bytes ?? record.verifiedLength)
        return DownloadUpdate(
            id: record.id, transactionId: record.transactionId, productId: record.productId, contentVersion: record.contentVersion,
            state: record.state, progress: record.expectedLength > 0 ? Double(received) / Double(record.expectedLength) : 0,
            bytesReceived: received, expectedContentLength: record.expectedLength,
            timeRemaining: record.state == .finished ? 0 : rate.timeRemaining(record.expectedLength - received),
            bytesPerSecond: rate.bytesPerSecond, error: record.error, contentURL: record.state == .finished ? record.contentPath : nil)
    }

    /// Every state change is emitted; progress only when `progressDue`, at most four times a
    /// second per download.
    private func emit(_ update: DownloadUpdate) {
        lastEmitted[update.id] = .now
        continuation.yield(update)
    }

    private func progressDue(_ id: String) -> Bool {
        guard let last = lastEmitted[id] else { return true }
        return ContinuousClock.now - last >= .milliseconds(250)
    }
}

/// Crash points for tests: with `IAP_FETCH_KILL_AT=<name>` in the environment the process kills
/// itself with SIGKILL when it reaches that point (`verified`: after the SHA-256 check, before
/// install; `installed`: after install, before the transaction is finished), so a test can stop it
/// exactly where a power cut could. Without the variable this does nothing.
enum Failpoint {
    static let armed = ProcessInfo.processInfo.environment["IAP_FETCH_KILL_AT"]

    static func hit(_ name: String) {
        if armed == name { kill(getpid(), SIGKILL) }
    }
}

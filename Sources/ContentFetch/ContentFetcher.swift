import AsyncHTTPClient
import ContentArchive
import Crypto
import Foundation
import NIOCore
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
    /// Optional bandwidth cap, bytes per second.
    public var rateLimit: Int?
    /// The journal records progress every this many bytes (what a kill can cost).
    public var journalInterval: Int64 = 4 << 20

    public init(server: String, contentDirectory: String) {
        self.server = server.hasSuffix("/") ? String(server.dropLast()) : server
        self.contentDirectory = contentDirectory
    }
}

/// What one run did.
public struct RunSummary: Sendable {
    public var finished: [String] = []
    public var failed: [(transactionId: String, error: FetchError)] = []
    public var paused = false
}

/// Takes each unfinished transaction, obtains a grant, downloads resumably, verifies, installs,
/// and only then finishes the transaction. A failure leaves the transaction unfinished so a
/// later run retries it.
public actor ContentFetcher {
    public let configuration: FetchConfiguration
    public nonisolated let updates: AsyncStream<DownloadUpdate>
    private let continuation: AsyncStream<DownloadUpdate>.Continuation
    private let source: any TransactionSource
    private let journal: DownloadJournal
    private let client: HTTPClient
    private var lastEmitted: [String: ContinuousClock.Instant] = [:]
    private var pauseRequested = false

    public init(configuration: FetchConfiguration, source: any TransactionSource) throws(FetchError) {
        self.configuration = configuration
        self.source = source
        journal = try DownloadJournal(contentDirectory: configuration.contentDirectory)
        var httpConfiguration = HTTPClient.Configuration()
        httpConfiguration.timeout = .init(connect: .seconds(10), read: .nanoseconds(Int64(configuration.stallTimeout.components.seconds) * 1_000_000_000))
        httpConfiguration.decompression = .disabled
        client = HTTPClient(eventLoopGroupProvider: .singleton, configuration: httpConfiguration)
        (updates, continuation) = AsyncStream.makeStream(of: DownloadUpdate.self, bufferingPolicy: .bufferingNewest(1024))
    }

    /// Stops after the current chunk, with every journal saved (state `paused`).
    public func pause() { pauseRequested = true }

    /// Closes the HTTP client and the update stream.
    public func shutdown() async {
        continuation.finish()
        try? await client.shutdown()
    }

    /// Processes every unfinished transaction once.
    public func run() async -> RunSummary {
        var summary = RunSummary()
        let transactions: [QueuedTransaction]
        do {
            transactions = try await source.unfinishedTransactions()
        } catch {
            summary.failed.append(("", FetchError(.install, "cannot read the transaction queue: \(error)")))
            return summary
        }
        for transaction in transactions {
            if pauseRequested { summary.paused = true; break }
            do {
                try await process(transaction)
                summary.finished.append(transaction.transactionId)
            } catch let error as FetchError where error.code == .cancelled && pauseRequested {
                summary.paused = true
                break
            } catch let error as FetchError {
                summary.failed.append((transaction.transactionId, error))
            } catch {
                summary.failed.append((transaction.transactionId, FetchError(.network, "\(error)")))
            }
        }
        return summary
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
        let grant = try await requestGrant(transaction)
        for download in grant.downloads {
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
            return try await retry(attempt, FetchError(.network, "cannot reach \(configuration.server): \(error)")) {
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
            return try await retry(attempt, FetchError(.network, "the server answered \(status): \(message.text)")) {
                try await self.requestGrant(transaction, attempt: attempt + 1)
            }
        }
    }

    private func emitFailure(_ transaction: QueuedTransaction, _ error: FetchError) -> FetchError {
        emit(DownloadUpdate(id: "\(transaction.transactionId)-\(transaction.productId)", transactionId: transaction.transactionId,
                            productId: transaction.productId, contentVersion: nil, state: .failed, progress: 0, bytesReceived: 0,
                            expectedContentLength: -1, timeRemaining: -1, bytesPerSecond: 0, error: error, contentURL: nil))
        return error
    }

    /// Exponential backoff with jitter between attempts; gives up after `maxAttempts`.
    private func retry<T>(_ attempt: Int, _ error: FetchError, _ again: () async throws -> T) async throws -> T {
        guard attempt < configuration.maxAttempts, !pauseRequested else { throw error }
        await backoff(attempt)
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
            emit(update(record, rate: RateEstimator()))
            return
        }
        if record.sha256 != download.sha256 || record.contentVersion != download.contentVersion {
            // Another archive than the one on disk: start over.
            unlink(journal.partialPath(id))
            record.sha256 = download.sha256
            record.contentVersion = download.contentVersion
            record.expectedLength = download.contentLength
            record.verifiedLength = 0
            record.etag = nil
        }
        record.url = download.url
        record.error = nil
        var attempt = 0
        while true {
            attempt += 1
            do {
                try await transfer(&record)
                break
            } catch let error as FetchError where error.code == .cancelled {
                record.state = .paused
                try? journal.save(record)
                emit(update(record, rate: RateEstimator()))
                throw error
            } catch let error as FetchError where error.code == .revoked || error.code == .noContent || error.code == .refused {
                record.state = .failed
                record.error = error
                try? journal.save(record)
                emit(update(record, rate: RateEstimator()))
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
                guard attempt < configuration.maxAttempts, !pauseRequested else {
                    record.state = .failed
                    record.error = failure
                    try? journal.save(record)
                    emit(update(record, rate: RateEstimator()))
                    throw failure
                }
                // Waiting to retry; observers see why.
                record.state = .waiting
                record.error = failure
                emit(update(record, rate: RateEstimator()))
                await backoff(attempt)
            }
        }
        try install(&record, destination: destination)
    }

    struct GrantExpired: Error {}

    /// One attempt: continues the partial file from what the journal says is on disk, with
    /// `Range` and `If-Range`, hashing as bytes arrive; ends with the SHA-256 check.
    private func transfer(_ record: inout DownloadRecord) async throws {
        let partial = journal.partialPath(record.id)
        let fd: SystemPackage.FileDescriptor
        do {
            fd = try SystemPackage.FileDescriptor.open(partial, .readWrite, options: [.create], permissions: [.ownerReadWrite, .groupRead])
        } catch {
            throw FetchError(.install, "cannot write \(partial): \(error); check free space and permissions of --content-dir")
        }
        defer { try? fd.close() }
        // Bytes past the journal's mark may be torn by a kill: drop them.
        guard ftruncate(fd.rawValue, off_t(record.verifiedLength)) == 0 else {
            throw FetchError(.install, "cannot truncate \(partial): \(String(cString: strerror(errno)))")
        }
        var hasher = SHA256()
        var offset: Int64 = 0
        // Rebuild the hash of what is already on disk (SHA-256 state cannot be saved).
        var buffer = [UInt8](repeating: 0, count: 1 << 20)
        while offset < record.verifiedLength {
            let n = try buffer.withUnsafeMutableBytes { raw in
                try fd.read(fromAbsoluteOffset: offset, into: UnsafeMutableRawBufferPointer(rebasing: raw[0..<Int(min(Int64(raw.count), record.verifiedLength - offset))]))
            }
            if n == 0 { break }
            hasher.update(data: buffer[0..<n])
            offset += Int64(n)
        }
        if offset < record.expectedLength {
            var request = HTTPClientRequest(url: record.url)
            if offset > 0 {
                request.headers.add(name: "Range", value: "bytes=\(offset)-")
                if let etag = record.etag { request.headers.add(name: "If-Range", value: etag) }
            }
            let response = try await client.execute(request, timeout: .hours(24))
            switch response.status.code {
            case 206:
                let range = response.headers.first(name: "content-range") ?? ""
                guard range.hasPrefix("bytes \(offset)-") else {
                    throw FetchError(.network, "the server sent range '\(range)' for a request from byte \(offset)")
                }
            case 200:
                if offset > 0 {
                    // If-Range did not match: the archive changed; start over.
                    hasher = SHA256()
                    offset = 0
                    _ = ftruncate(fd.rawValue, 0)
                }
            case 416:
                throw FetchError(.network, "the server says byte \(offset) is past the end: the archive changed; starting over")
            case 401:
                throw GrantExpired()
            case 403:
                let body = try await response.body.collect(upTo: 64 << 10)
                let message = Self.errorMessage(body)
                throw FetchError(message.code == "revoked" ? .revoked : .refused, message.text)
            case 404:
                throw FetchError(.noContent, "the archive is no longer on the server")
            default:
                throw FetchError(.network, "the server answered \(response.status.code)")
            }
            record.etag = response.headers.first(name: "etag") ?? record.etag
            record.state = .active
            try journal.save(record)
            var rate = RateEstimator()
            var marked = offset
            let started = ContinuousClock.now
            var received: Int64 = 0
            emit(update(record, offset: offset, rate: rate))
            for try await chunk in response.body {
                guard !pauseRequested else {
                    try sync(fd, &record, offset)
                    throw FetchError(.cancelled, "paused")
                }
                guard offset + Int64(chunk.readableBytes) <= record.expectedLength else {
                    throw FetchError(.network, "the server sent more than the \(record.expectedLength) bytes granted")
                }
                do {
                    _ = try chunk.withUnsafeReadableBytes { try fd.writeAll(toAbsoluteOffset: offset, $0) }
                } catch {
                    throw FetchError(.install, "cannot write \(partial): \(error); free disk space and run again")
                }
                chunk.withUnsafeReadableBytes { hasher.update(bufferPointer: $0) }
                offset += Int64(chunk.readableBytes)
                received += Int64(chunk.readableBytes)
                rate.add(Int64(chunk.readableBytes))
                if offset - marked >= configuration.journalInterval {
                    try sync(fd, &record, offset)
                    marked = offset
                }
                // Checked before building the update: this runs for every chunk received.
                if progressDue(record.id) { emit(update(record, offset: offset, rate: rate)) }
                if let limit = configuration.rateLimit, limit > 0 {
                    let due = Duration.milliseconds(received * 1000 / Int64(limit))
                    let elapsed = ContinuousClock.now - started
                    if due > elapsed { try? await Task.sleep(for: due - elapsed) }
                }
            }
            try sync(fd, &record, offset)
            guard offset == record.expectedLength else {
                throw FetchError(.network, "the transfer ended at byte \(offset) of \(record.expectedLength)")
            }
        }
        let digest = hasher.finalize().map { String(format: "%02x", $0) }.joined()
        guard digest == record.sha256 else {
            // Corrupt bytes: throw them away and fetch again.
            _ = ftruncate(fd.rawValue, 0)
            record.verifiedLength = 0
            record.etag = nil
            try journal.save(record)
            throw FetchError(.integrity, "the downloaded archive's SHA-256 is \(digest), not the granted \(record.sha256)")
        }
        Failpoint.hit("verified")
    }

    /// fsync the partial file, then record how much of it is durable.
    private func sync(_ fd: SystemPackage.FileDescriptor, _ record: inout DownloadRecord, _ offset: Int64) throws {
        guard fsync(fd.rawValue) == 0 else { throw FetchError(.install, "cannot sync the partial download: \(String(cString: strerror(errno)))") }
        record.verifiedLength = offset
        record.updatedAt = Date()
        try journal.save(record)
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
                emit(update(record, rate: RateEstimator()))
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
        emit(update(record, rate: RateEstimator()))
    }

    // MARK: Updates

    private func update(_ record: DownloadRecord, offset: Int64? = nil, rate: RateEstimator) -> DownloadUpdate {
        let received = record.state == .finished ? record.expectedLength : (offset ?? record.verifiedLength)
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

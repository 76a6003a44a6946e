import AsyncHTTPClient
import ContentArchive
import Crypto
import DurableFiles
import Foundation
import IAPProtocol
import NIOCore
import NIOPosix
import TransactionQueue

/// The download queue, as `SKPaymentQueue` was for hosted content: takes each unfinished
/// transaction, obtains a grant, downloads resumably, verifies, installs, and only then finishes
/// the transaction. A failed or cancelled download leaves its transaction unfinished so that a
/// later start retries it. Up to `FetchConfiguration.parallelDownloads` transactions are processed
/// at once, one per product, sharing the bandwidth cap and the free space.
///
/// Downloads are named `<transactionId>-<productId>`; `pause`, `resume` and `cancel` take that id
/// while a `start()` is running or after it returned. Observers read `updates`.
public actor ContentFetcher {
    public let configuration: FetchConfiguration
    public nonisolated let updates: AsyncStream<DownloadUpdate>
    private let continuation: AsyncStream<DownloadUpdate>.Continuation
    private let source: any TransactionSource
    let journal: DownloadJournal
    let client: HTTPClient
    private let grants: GrantClient
    private let installer: ContentInstaller
    private let retry: RetryPolicy
    /// The bandwidth cap every transfer shares, when one is set.
    let limiter: RateLimiter?
    private var lastEmitted: [String: ContinuousClock.Instant] = [:]

    enum Control: Sendable { case pause, cancel }
    /// Thrown through a transfer when a download is paused or cancelled.
    struct Stop: Error { let control: Control }

    private var pending: [QueuedTransaction] = []
    /// Transactions whose download was paused with `pause(_:)`, by download id.
    private var parked: [String: QueuedTransaction] = [:]
    /// Downloads being processed now.
    private var inFlight: Set<String> = []
    var controls: [String: Control] = [:]
    var stopAll = false
    private var loop: Task<Void, Never>?
    /// Transactions being processed, by product: the queue starts another of a product only
    /// when none runs.
    private var runningProducts: [String: Int] = [:]
    /// Disk space the downloads running now were found to need when they started (what is left
    /// to fetch and to install) and have not yet taken on disk, by download, and the downloads
    /// waiting for some of it to be released.
    private var promisedSpace: [String: Int64] = [:]
    private var reservedSpace: Int64 { promisedSpace.values.reduce(0, +) }
    /// The running downloads' extractions as their archives arrive, by download id: the bytes
    /// they have written are on the disk already, though still part of what their downloads were
    /// promised (``reserveSpace(_:manifest:)``).
    private var extractions: [String: StreamingExtractor] = [:]
    /// Downloads promised less space than their archive and content (``reserveSpace(_:manifest:)``):
    /// their partial archives reserve no blocks for the bytes they leave to their extraction.
    var leanDownloads: Set<String> = []
    private var spaceWaiters: [CheckedContinuation<Void, Never>] = []
    /// Products with a download being delivered, each with the downloads waiting for it.
    private var busyProducts: [String: [CheckedContinuation<Void, Never>]] = [:]
    private enum Outcome: Sendable {
        case finished(String), failed(String, FetchError), withoutContent(QueuedTransaction, FetchError), revoked(QueuedTransaction, FetchError)
        case paused(String), cancelled(String)
        case interrupted
    }
    /// The server has no hosted content for the transaction's product: nothing to download.
    struct WithoutContent: Error { let reason: FetchError }
    /// What happened, in order; each `start()` reports what happened while it ran (the first of
    /// several at once also what happened since the last one returned).
    private var outcomes: [Outcome] = []
    /// `start()` calls waiting; with none, `outcomes` is emptied so it does not grow for ever.
    private var starts = 0
    var transfers: [String: PartialArchive] = [:]
    /// The installed versions delta updates were planned from in this run, by product.
    var planned: [String: InstalledVersion] = [:]
    /// Why the grant server could not be reached through a whole patience while the pending
    /// transactions were processed: the ones after it fail with that at once instead of waiting
    /// as long again (the next run tries again).
    private var serverUnreachable: FetchError?
    /// Manifests of the downloads in progress, by download id.
    var manifests: [String: LoadedManifest] = [:]
    /// The SHA-256 of the wrong bytes a download last verified in its current series of
    /// attempts (``transferWithRetries(_:granted:transaction:)``), by download id: the same wrong
    /// bytes again are the server's copy, not the network (``ServerCopyDamaged``).
    var wrongDigests: [String: String] = [:]
    /// Installed downloads' partial archives being deleted off this actor, by download id
    /// (``removeInstalledBytes(_:)``), with the bytes each deletion frees.
    private var removals: [String: (task: Task<Void, Never>, frees: Int64)] = [:]
    /// The server sent the same wrong bytes twice: its copy of the archive is damaged, and
    /// fetching it again would only fetch them again. Not retried in this run.
    struct ServerCopyDamaged: Error { let reason: FetchError }

    /// A download's manifest, with its SHA-256 and, for a delta, the entries it fetches by offset
    /// (worked out when first needed).
    struct LoadedManifest {
        let sha256: String
        let manifest: ArchiveManifest
        var fetchedByOffset: [ArchiveManifest.Entry]?
    }

    /// A fetcher for the transactions `source` yields, journaling under the configuration's
    /// content folder (created if missing; a path that is a file is a `.install` error).
    public init(configuration: FetchConfiguration, source: any TransactionSource) throws(FetchError) {
        self.configuration = configuration
        self.source = source
        // Before the journal's folder is made: a wrong --ca-file leaves nothing behind.
        let tls = try TLSTrust.configuration(adding: configuration.additionalTrustRootFiles)
        journal = try DownloadJournal(contentDirectory: configuration.contentDirectory)
        var httpConfiguration = HTTPClient.Configuration()
        httpConfiguration.timeout = .init(connect: .seconds(10), read: .nanoseconds(Int64(configuration.stallTimeout.components.seconds) * 1_000_000_000))
        httpConfiguration.decompression = .disabled
        httpConfiguration.connectionPool.concurrentHTTP1ConnectionsPerHostSoftLimit = max(8, configuration.connections + 1)
        httpConfiguration.tlsConfiguration = tls
        // HTTP/1.1 even where TLS offers HTTP/2: an archive is one long response, which gains
        // nothing from multiplexing, and through HTTP/2's frames, stream channel and flow control
        // a 1 GiB transfer took 2.4 s against 1.6 s on HTTP/1.1 from the same nginx (curl: 1.1-1.4 s
        // either way). A delta's many ranges use pooled connections instead.
        httpConfiguration.httpVersion = .http1Only
        // A connection that cannot be made fails its request at once, to be tried again by
        // RetryPolicy for its patience like every other: AsyncHTTPClient's own retries ran until
        // its connect timeout (10 s) per request, a refused certificate included (it retries a
        // failed handshake too: swift-server/async-http-client#919).
        httpConfiguration.connectionPool.retryConnectionEstablishment = false
        client = HTTPClient(eventLoopGroupProvider: .singleton, configuration: httpConfiguration)
        grants = GrantClient(server: configuration.server, client: client, userAgent: configuration.userAgent, maxRetryAfter: configuration.maxRetryAfter)
        installer = ContentInstaller(contentDirectory: configuration.contentDirectory)
        retry = RetryPolicy(maxAttempts: configuration.maxAttempts, patience: configuration.unreachablePatience)
        limiter = configuration.rateLimit.map(RateLimiter.init(bytesPerSecond:))
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
    /// interrupted are resumed from their journal. The summary also holds what ended between
    /// this call and the last one (a download resumed with `resume(_:)` meanwhile).
    public func start() async -> RunSummary {
        stopAll = false
        // A first caller also reports what ended since the last run returned: a download that
        // `resume(_:)` carried on in the background may have finished before this call.
        let mark = starts == 0 ? 0 : outcomes.count
        starts += 1
        defer {
            starts -= 1
            if starts == 0 { outcomes.removeAll() }
        }
        do {
            for transaction in try await source.unfinishedTransactions() {
                let id = Self.downloadId(transaction)
                guard !parked.keys.contains(id), !inFlight.contains(id),
                    !pending.contains(where: { $0.transactionId == transaction.transactionId })
                else { continue }
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
            case .withoutContent(let transaction, let reason): summary.withoutContent.append((transaction.transactionId, transaction.productId, reason))
            case .revoked(let transaction, let reason): summary.revoked.append((transaction.transactionId, transaction.productId, reason))
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
        if signal(.pause, to: id) { return true }
        guard let transaction = dequeue(id, includingParked: false) else { return false }
        parked[id] = transaction
        persistState(id, transaction, .pause)
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
        persistState(id, transaction, .resume)
        Task { await self.drain() }
        return true
    }

    /// Cancels download `id`: its partial file is deleted, its state becomes `cancelled`, and its
    /// transaction stays unfinished. Returns false when no such download is queued, running or paused.
    @discardableResult
    public func cancel(_ id: String) -> Bool {
        if signal(.cancel, to: id) { return true }
        guard let transaction = dequeue(id, includingParked: true) else { return false }
        persistState(id, transaction, .cancel)
        outcomes.append(.cancelled(id))
        return true
    }

    /// Asks a running download to stop; its transfer applies it at the next chunk.
    private func signal(_ control: Control, to id: String) -> Bool {
        guard inFlight.contains(id) else { return false }
        controls[id] = control
        wakeSpaceWaiters()
        return true
    }

    /// Takes download `id` out of those waiting to run (and, with `includingParked`, the paused ones).
    private func dequeue(_ id: String, includingParked: Bool) -> QueuedTransaction? {
        if includingParked, let transaction = parked.removeValue(forKey: id) { return transaction }
        guard let index = pending.firstIndex(where: { Self.downloadId($0) == id }) else { return nil }
        return pending.remove(at: index)
    }

    /// Pauses everything: the running download saves its journal and the queue stops; the next
    /// `start()` resumes. This is what Ctrl-C does in `iap-fetch`.
    public func pauseAll() {
        stopAll = true
        wakeSpaceWaiters()
    }

    /// The id of a transaction's download of `productId` (by default its own product: before
    /// its grant is known, one product per transaction).
    static func downloadId(_ transaction: QueuedTransaction, productId: String? = nil) -> String {
        downloadIdPrefix(transaction) + (productId ?? transaction.productId)
    }

    /// What the ids of all of a transaction's downloads start with.
    static func downloadIdPrefix(_ transaction: QueuedTransaction) -> String { "\(transaction.transactionId)-" }

    /// Returns once no queue loop runs, such as the one `resume(_:)` starts in the background.
    func idle() async {
        // `drain()` clears `loop` after its task ends; a loop still set but ended is idle too.
        while let current = loop {
            await current.value
            if loop == current { return }
        }
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

    /// Runs the pending transactions, up to `parallelDownloads` at once and one per product, until
    /// none is left or `pauseAll()`.
    private func processPending() async {
        serverUnreachable = nil
        await withTaskGroup(of: Void.self) { group in
            var running = 0
            while true {
                while !stopAll, running < max(1, configuration.parallelDownloads),
                    let next = pending.firstIndex(where: { runningProducts[$0.productId, default: 0] == 0 })
                {
                    let transaction = pending.remove(at: next)
                    running += 1
                    runningProducts[transaction.productId, default: 0] += 1
                    group.addTask {
                        await self.run(transaction)
                        await self.ended(transaction)
                    }
                }
                guard running > 0 else { break }
                await group.next()
                running -= 1
            }
        }
        if stopAll { outcomes.append(.interrupted) }
    }

    private func ended(_ transaction: QueuedTransaction) {
        runningProducts[transaction.productId, default: 1] -= 1
        if runningProducts[transaction.productId] == 0 { runningProducts[transaction.productId] = nil }
    }

    /// Processes one transaction and records how it ended.
    private func run(_ transaction: QueuedTransaction) async {
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
        } catch let without as WithoutContent {
            outcomes.append(.withoutContent(transaction, without.reason))
        } catch let error as FetchError where error.code == .revoked {
            outcomes.append(.revoked(transaction, error))
        } catch let error as FetchError {
            outcomes.append(.failed(transaction.transactionId, error))
        } catch {
            outcomes.append(.failed(transaction.transactionId, FetchError(.network, "\(error)")))
        }
    }

    // MARK: One product at a time

    /// Waits until no other download of `productId` is being delivered: an install replaces the
    /// product's folder, and a delta update is planned from the version installed there.
    private func acquireProduct(_ productId: String) async {
        guard busyProducts[productId] != nil else {
            busyProducts[productId] = []
            return
        }
        await withCheckedContinuation { busyProducts[productId, default: []].append($0) }
    }

    private func releaseProduct(_ productId: String) {
        guard var waiting = busyProducts[productId], !waiting.isEmpty else {
            busyProducts[productId] = nil
            return
        }
        let next = waiting.removeFirst()
        busyProducts[productId] = waiting
        next.resume()
    }

    /// Applies a request made while the download was between transfers.
    func checkControl(_ id: String) throws(Stop) {
        if stopAll { throw Stop(control: .pause) }
        if let control = controls[id] { throw Stop(control: control) }
        if journal.takeCancelRequest(id) { throw Stop(control: .cancel) }
    }

    /// Applies pause, resume or cancel to a download that is not running, from its journal, or
    /// before its grant from its transaction alone.
    private func persistState(_ id: String, _ transaction: QueuedTransaction, _ event: DownloadStateMachine.Event) {
        var download =
            journal.load(id).map(DownloadStateMachine.init(record:))
            ?? DownloadStateMachine(transactionId: transaction.transactionId, productId: transaction.productId)
        try? apply(event, to: &download)
    }

    // MARK: One transaction

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
            try await deliverWhenProductFree(download, transaction: transaction)
        }
        Failpoint.hit("installed")
        // Finishing is the last step: every download of this transaction is installed.
        do {
            try await source.finish(transactionId: transaction.transactionId)
        } catch {
            await removedInstalledBytes(of: transaction)
            throw error
        }
        await removedInstalledBytes(of: transaction)
    }

    /// Deletes the partial archive (and manifest) of installed download `id` on a thread of the
    /// blocking pool, then releases the space the download held. Freeing a 1 GiB file's blocks
    /// takes the `unlink` 0.25-0.4 s on ext4 mounted with `discard` (which trims them as they are
    /// freed; 3 ms without), and on this actor it held back the install's report and every other
    /// download's progress that long. Only an installed download's: its file is never written
    /// again, where a download starting over writes a new one at the same path at once.
    private func removeInstalledBytes(_ id: String) {
        guard removals[id] == nil else { return }
        let journal = journal
        let frees = journal.partialAllocatedBytes(id)
        let task = Task {
            try? await NIOThreadPool.singleton.runIfActive { journal.removeBytes(id) }
            self.removed(id)
        }
        removals[id] = (task, frees)
    }

    private func removed(_ id: String) {
        removals[id] = nil
        releaseSpace(of: id)
    }

    /// Waits for the deletions ``removeInstalledBytes(_:)`` started for `transaction`'s
    /// downloads, so that its processing ends with them done (a run's process exits having freed
    /// the space, a test finds the files gone); not for other transactions' running beside it.
    private func removedInstalledBytes(of transaction: QueuedTransaction) async {
        let prefix = Self.downloadIdPrefix(transaction)
        for (id, removal) in removals where id.hasPrefix(prefix) { await removal.task.value }
    }

    /// The grants for `transaction`, retried through network errors; a refusal fails the
    /// download (before its grant, so observers see it by transaction). A product without hosted
    /// content throws ``WithoutContent``: no download exists, so no update says failed.
    private func requestGrant(_ transaction: QueuedTransaction) async throws -> DownloadGrants {
        let id = Self.downloadId(transaction)
        var download = DownloadStateMachine(transactionId: transaction.transactionId, productId: transaction.productId)
        var announced = false
        if let unreachable = serverUnreachable {
            // Tried for its whole patience a moment ago: the next transactions of this run would
            // each wait as long again for the same answer.
            let error = FetchError(.network, "\(unreachable.message) (tried for \(configuration.unreachablePatience.components.seconds) s for an earlier transaction of this run)")
            try? apply(.fail(error), to: &download)
            throw error
        }
        do {
            return try await retry.run(
                { _ in try await grants.request(transaction) },
                retryable: { ($0 as? FetchError)?.code == .network || $0 is RetryLater },
                willRetry: { _, error in
                    try checkControl(id)
                    // Said at once (waiting, with the reason): a server that is down takes a
                    // minute of tries, which looked like a hang.
                    if let later = error as? RetryLater {
                        try? apply(.retrying(later.reason), to: &download)
                        announced = true
                        return .atLeast(later.after)
                    }
                    if let error = error as? FetchError {
                        try? apply(.retrying(error), to: &download)
                        announced = true
                    }
                    return .backoff
                })
        } catch let unreachable as Unreachable {
            serverUnreachable = unreachable.reason
            try? apply(.fail(unreachable.reason), to: &download)
            throw unreachable.reason
        } catch let error as FetchError {
            if error.code == .noContent { throw WithoutContent(reason: error) }
            if error.code == .revoked {
                // Refunded: no download will exist, and none is reported but one observers saw
                // (waiting to retry, or left by a stopped run: it ends here, its bytes with it).
                if let saved = journal.load(id), saved.state != .finished {
                    download = DownloadStateMachine(record: saved)
                } else if !announced {
                    throw error
                }
            }
            try? apply(.fail(error), to: &download)
            throw error
        }
    }

    // MARK: One download

    /// Delivers `granted` once no other download of its product runs (a grant names the
    /// transaction's product, which the queue already keeps to one at a time, but it is the
    /// server's answer that says).
    private func deliverWhenProductFree(_ granted: GrantedDownload, transaction: QueuedTransaction) async throws {
        let id = Self.downloadId(transaction, productId: granted.productId)
        inFlight.insert(id)
        defer { if id != Self.downloadId(transaction) { inFlight.remove(id) } }
        await acquireProduct(granted.productId)
        defer { releaseProduct(granted.productId) }
        try await deliver(granted, transaction: transaction)
    }

    /// Downloads, verifies and installs one granted archive, retrying by ``RetryPolicy``; a grant
    /// that expires mid-download is renewed and the bytes on disk kept.
    private func deliver(_ granted: GrantedDownload, transaction: QueuedTransaction) async throws {
        let id = Self.downloadId(transaction, productId: granted.productId)
        var download =
            journal.load(id).map(DownloadStateMachine.init(record:))
            ?? DownloadStateMachine(transactionId: transaction.transactionId, productId: granted.productId)
        if download.state == .finished, download.record.sha256 == granted.sha256, installer.isInstalled(download.record) {
            // Installed by a run killed before its transaction was finished, maybe before its
            // partial archive was deleted too.
            removeInstalledBytes(id)
            emit(download.update())
            return
        }
        try apply(.granted(granted), to: &download)
        let manifest = try await fetchManifest(granted, id: id)
        if manifest != nil, download.record.manifestSHA256 != granted.manifestSHA256 {
            download.updateBytes { $0.manifestSHA256 = granted.manifestSHA256 }
        }
        if let manifest, download.record.delta == nil, download.record.recordedLength == 0, download.record.segments == nil,
            let plan = planDelta(manifest, granted: granted)
        {
            download.updateBytes {
                $0.delta = plan
                $0.segments = plan.ranges
            }
            try journal.save(download.record)
            emit(download.update())
            Failpoint.hit("delta-planned")
        }
        // A run killed while its partial archive left the stored files' bytes to its extraction:
        // they go back before that folder is swept.
        if let folder = download.record.streamedInto { try copyBackLeftOut(&download, folder: folder, manifest: manifest) }
        // Before the space is counted: a run killed while extracting left up to an archive's worth.
        installer.removeLeftoverExtractions(productId: granted.productId)
        do {
            try await reserveSpace(&download, manifest: manifest)
        } catch let stop as Stop {
            throw stopped(stop, &download)
        } catch {
            let failure = error as? FetchError ?? FetchError(.install, "\(error)")
            try? apply(.fail(failure), to: &download)
            throw failure
        }
        // Once its partial archive is gone (``removeInstalledBytes(_:)``) when installed: a
        // download waiting for space looks at the disk only then.
        defer {
            extractions[id] = nil
            leanDownloads.remove(id)
            if removals[id] == nil { releaseSpace(of: id) }
        }
        // A delta update that cannot be installed (an installed file changed meanwhile, a fetched
        // entry that does not match) falls back once to the whole archive.
        for attempt in 0..<2 {
            // A whole archive (a delta that fell back too) is extracted as it arrives, following its manifest's layout.
            let extraction = manifest.flatMap { installer.streamingExtraction(of: $0, for: download.record) }
            extractions[id] = extraction
            try await transferWithRetries(&download, granted: granted, transaction: transaction, extraction: extraction)
            do {
                // Off this actor: extracting a large archive takes a second or more, and the
                // other downloads' progress goes through it meanwhile.
                let (installer, partial, record) = (installer, journal.partialPath(id), download.record)
                let path: String
                if let delta = download.record.delta {
                    let saved = try loadManifest(id, sha256: delta.manifestSHA256)
                    let installed = planned[granted.productId]
                    path = try await NIOThreadPool.singleton.runIfActive {
                        try installer.installDelta(partial: partial, manifest: saved, plan: delta, installed: installed, for: record)
                    }
                } else {
                    path = try await NIOThreadPool.singleton.runIfActive {
                        try installer.install(archive: partial, for: record, manifest: manifest, extracted: extraction)
                    }
                }
                manifests[id] = nil
                planned[granted.productId] = nil
                // Its journal saved as installed, the download's partial file and manifest go.
                try apply(.installed(contentPath: path), to: &download)
                return
            } catch {
                if attempt == 0, download.record.delta != nil {
                    download.updateBytes { $0.discardBytes() }
                    try journal.save(download.record)
                    unlink(journal.partialPath(id))
                    continue
                }
                let failure = error as? FetchError ?? FetchError(.install, "\(error)")
                try? apply(.fail(failure), to: &download)
                throw failure
            }
        }
    }

    /// Copies back into the partial archive the stored files' bytes it left out
    /// (``LeftOutRanges``) from the extraction folder a killed run left, before the folder is
    /// swept; bytes not there (what the extraction's writer still held) are fetched again. A
    /// folder gone was copied back already (a pause), or removed by hand: the final SHA-256 and
    /// the manifest's chunk hashes then find the missing bytes. One still locked belongs to a
    /// process downloading this very archive, which this run then finds busy.
    private func copyBackLeftOut(_ download: inout DownloadStateMachine, folder name: String, manifest: ArchiveManifest?) throws {
        let record = download.record
        let folder = configuration.contentDirectory + "/" + record.productId + "/" + name
        var lost: UInt64?
        // Only a folder of the product's own that an extraction names so is read.
        let fd = name.contains("/") || !name.contains(StreamingExtractor.marker) ? -1 : open(folder, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_DIRECTORY)
        if fd >= 0 {
            defer { close(fd) }
            guard (try? FileLock.lock(fd, path: folder, wait: false)) != nil else { return }
            let through = max(record.recordedLength, record.durable?.reduce(0) { $0 + $1.done } ?? 0)
            // Without the manifest there is no layout to copy by: everything is fetched again.
            lost =
                manifest.map {
                    StreamingExtractor.copyBack(manifest: $0, folder: folder, into: journal.partialPath(record.id), through: UInt64(max(0, through)))
                } ?? 0
        }
        download.updateBytes { record in
            if let lost { record.keepBytes(below: Int64(lost)) }
            record.streamedInto = nil
        }
        try journal.save(download.record)
    }

    private func transferWithRetries(
        _ download: inout DownloadStateMachine, granted: GrantedDownload, transaction: QueuedTransaction, extraction: StreamingExtractor? = nil
    ) async throws {
        let id = download.id
        // Kept for these attempts only: a later run (or `start()` of a long-lived fetcher) asks again.
        defer { wrongDigests[id] = nil }
        do {
            try await retry.run(
                { _ in
                    try checkControl(id)
                    try await transfer(&download, extraction: extraction)
                },
                retryable: { error in
                    if error is Stop || error is ServerCopyDamaged { return false }
                    if let error = error as? FetchError { return ![.revoked, .noContent, .refused, .busy, .tls].contains(error.code) }
                    return true
                },
                willRetry: { _, error in
                    switch error {
                    case is GrantExpired:
                        // A fresh grant; the bytes on disk stay unless the archive changed meanwhile.
                        // Unpublished while it downloaded: that fails this download.
                        let fresh: DownloadGrants
                        do { fresh = try await requestGrant(transaction) } catch let without as WithoutContent { throw without.reason }
                        guard let same = fresh.downloads.first(where: { $0.productId == granted.productId }) else {
                            throw FetchError(.noContent, "the new grant no longer lists \(granted.productId)")
                        }
                        try apply(.granted(same), to: &download)
                        return RetryPolicy.Wait.none
                    case is ArchiveChanged:
                        return RetryPolicy.Wait.none
                    case let later as RetryLater:
                        try apply(.retrying(later.reason), to: &download)
                        return .atLeast(later.after)
                    default:
                        // Waiting to retry; observers see why.
                        try apply(.retrying(error as? FetchError ?? FetchError(.network, "\(error)")), to: &download)
                        return .backoff
                    }
                })
        } catch let stop as Stop {
            throw stopped(stop, &download)
        } catch {
            let failure = (error as? Unreachable)?.reason ?? (error as? ServerCopyDamaged)?.reason ?? error as? FetchError ?? FetchError(.network, "\(error)")
            try? apply(.fail(failure), to: &download)
            throw failure
        }
    }

    /// A pause or cancel applied to `download` (saved and told); returns it to be thrown on.
    private func stopped(_ stop: Stop, _ download: inout DownloadStateMachine) -> Stop {
        controls[download.id] = nil
        try? apply(stop.control == .cancel ? .cancel : .pause, to: &download)
        return stop
    }

    /// Fetches the granted version's manifest into the journal folder, checked against the
    /// grant's SHA-256; nil when the grant names none or it cannot be had: the download then
    /// fetches the whole archive, whose own SHA-256 is checked.
    private func fetchManifest(_ granted: GrantedDownload, id: String) async throws -> ArchiveManifest? {
        guard let url = granted.manifestURL, let sha256 = granted.manifestSHA256 else { return nil }
        if let saved = try? loadManifest(id, sha256: sha256) { return saved }
        let data: Data
        do {
            var request = HTTPClientRequest(url: url)
            request.headers.add(name: "User-Agent", value: configuration.userAgent)
            let response = try await client.execute(request, timeout: .seconds(30))
            guard response.status == .ok else { return nil }
            data = Data(try await response.body.collect(upTo: 64 << 20).readableBytesView)
        } catch {
            return nil
        }
        guard Hex.encode(SHA256.hash(data: data)) == sha256,
            let manifest = try? ArchiveManifest.decode(data, source: url),
            manifest.archiveSHA256 == granted.sha256, manifest.productId.rawValue == granted.productId,
            manifest.contentVersion.string == granted.contentVersion
        else { return nil }
        try? AtomicFile.write(data, to: journal.manifestPath(id), permissions: 0o644)
        manifests[id] = LoadedManifest(sha256: sha256, manifest: manifest)
        return manifest
    }

    /// A delta from the installed version of the product, when one is installed with its
    /// manifest and enough of it can be reused.
    private func planDelta(_ manifest: ArchiveManifest, granted: GrantedDownload) -> DeltaPlan? {
        guard let sha256 = granted.manifestSHA256, let installed = installer.installedVersion(productId: granted.productId),
            installed.contentVersion != granted.contentVersion
        else { return nil }
        let folder = installer.destination(productId: granted.productId, contentVersion: installed.contentVersion)
        planned[granted.productId] = installed
        return DeltaPlan.make(manifest: manifest, manifestSHA256: sha256, installed: installed, installedFolder: folder)
    }

    /// Refuses to start when the content folder cannot hold what is left to fetch and the new
    /// version beside the installed one (which stays until the new one is in place). When it
    /// could, but not beside what the downloads running now still need, waits until one of them
    /// ends and looks again: one at a time, each would have found the disk as the last one left
    /// it, saying so meanwhile (the state `waiting`, with the reason). A pause or cancel asked
    /// for meanwhile applies at once (``Stop``), not once space frees up. What it reserves stays
    /// until `releaseSpace(of:)`, less what the download takes on disk meanwhile
    /// (`spaceTaken(_:by:)`).
    ///
    /// A download whose partial archive will leave its large stored files to the extraction
    /// (``LeftOutRanges``) needs no blocks for those bytes: where the disk cannot hold the whole
    /// archive beside the content, it is let start if it can without them (a *lean* download,
    /// ``leanDownloads``), so that a pack of large stored files installs with about its own size
    /// free rather than twice it. Should its extraction be given up part-way, the archive needs
    /// those blocks after all, and the download fails for space then, keeping what it fetched.
    private func reserveSpace(_ download: inout DownloadStateMachine, manifest: ArchiveManifest?) async throws {
        let record = download.record
        var toFetch = (record.delta?.bytesToFetch ?? record.expectedLength) - record.recordedLength
        if record.delta == nil {
            // An earlier run reserved the archive's blocks (`PartialArchive.reserve`): the disk's
            // free space already leaves them out.
            toFetch -= min(toFetch, max(0, journal.partialAllocatedBytes(record.id) - record.recordedLength))
        }
        let toWrite = record.delta?.bytesToWrite ?? manifest.map { Int64($0.contentLength) } ?? 0
        let needed = toFetch + toWrite
        let lean = needed - min(toFetch, leftOutBytes(record, manifest: manifest))
        while true {
            var fs = statvfs()
            guard statvfs(configuration.contentDirectory, &fs) == 0 else { return }
            let free = Int64(fs.f_bavail) * Int64(fs.f_frsize)
            // What running downloads' extractions wrote is taken from the disk and counted in their
            // promise too; once they end it stays, and their archives go: as free as now, and that.
            let written = extractions.values.reduce(0) { $0 + Int64($1.bytesInFolder) }
            let fits = { (bytes: Int64) in free + written >= bytes && (self.reservedSpace == 0 || free + written - self.reservedSpace >= bytes) }
            if fits(needed) {
                promisedSpace[record.id, default: 0] += needed
                return
            }
            if lean < needed, fits(lean) {
                leanDownloads.insert(record.id)
                promisedSpace[record.id, default: 0] += lean
                return
            }
            // The deletions under way free their bytes in a moment: a download waits for them
            // rather than being refused for space it will have.
            guard free + written + removals.values.reduce(0, { $0 + $1.frees }) >= lean else {
                let least = lean < needed ? ", or \(lean) with its large stored files written once (one connection, no rate limit)" : ""
                throw FetchError(
                    .install,
                    "\(record.productId) \(record.contentVersion) needs \(needed) bytes free in \(configuration.contentDirectory) (\(toFetch) to fetch, \(toWrite) to install beside the current version\(least)); \(free) are free: free disk space and run again"
                )
            }
            try checkControl(record.id)
            let reason = FetchError(
                .install,
                "needs \(needed) bytes free in \(configuration.contentDirectory) beside the \(reservedSpace) the running downloads still need (\(free) are free): starts when one of them ends"
            )
            if download.record.error != reason { try? apply(.retrying(reason), to: &download) }
            await withCheckedContinuation { spaceWaiters.append($0) }
        }
    }

    /// The bytes of a whole archive's download that its partial archive will leave to the
    /// extraction (``LeftOutRanges``) past those fetched already: the blocks of its large stored
    /// files, when it is fetched on one connection without a rate limit (the only transfer that
    /// leaves them out), and none otherwise.
    private func leftOutBytes(_ record: DownloadRecord, manifest: ArchiveManifest?) -> Int64 {
        guard record.delta == nil, configuration.connections == 1, limiter == nil, let manifest, !installer.isInstalled(record) else { return 0 }
        let left = LeftOutRanges(StreamingExtractor.storedRanges(of: manifest))
        return left.blocks.reduce(0) { $0 + max(0, $1.upperBound - max($1.lowerBound, record.recordedLength)) }
    }

    private func releaseSpace(of id: String) {
        promisedSpace[id] = nil
        wakeSpaceWaiters()
    }

    /// Download `id` took `bytes` on disk (the archive's blocks, reserved before its transfer):
    /// the disk's free space leaves them out from now, so they are no longer counted as promised.
    func spaceTaken(_ bytes: Int64, by id: String) {
        let moved = min(bytes, promisedSpace[id] ?? 0)
        guard moved > 0 else { return }
        promisedSpace[id, default: 0] -= moved
        wakeSpaceWaiters()
    }

    /// Space was freed, or a pause or cancel was asked for: the downloads waiting for space look again.
    private func wakeSpaceWaiters() {
        let waiting = spaceWaiters
        spaceWaiters.removeAll()
        for waiter in waiting { waiter.resume() }
    }

    // MARK: State and updates

    /// The one place where a download's state changes are saved and told: applies `event`,
    /// then performs what the state machine asks. An event the state does not allow changes nothing.
    func apply(
        _ event: DownloadStateMachine.Event, to download: inout DownloadStateMachine,
        received: Int64? = nil, rate: RateEstimator = RateEstimator()
    ) throws(FetchError) {
        guard let action = try? download.handle(event) else { return }
        switch action {
        case .none:
            return
        case .emit:
            break
        case .saveAndEmit(let removePartial):
            try journal.save(download.record)
            // After the save: a kill in between leaves a journal that no longer counts on the file.
            if removePartial {
                if download.record.state == .finished { removeInstalledBytes(download.id) } else { journal.removeBytes(download.id) }
            }
        }
        emit(download.update(received: received, rate: rate))
    }

    /// Every state change is emitted; progress only when `progressDue`, at most four times a
    /// second per download.
    func emit(_ update: DownloadUpdate) {
        lastEmitted[update.id] = .now
        continuation.yield(update)
    }

    func progressDue(_ id: String) -> Bool {
        guard let last = lastEmitted[id] else { return true }
        return ContinuousClock.now - last >= .milliseconds(250)
    }
}

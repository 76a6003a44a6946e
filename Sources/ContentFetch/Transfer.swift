import AsyncHTTPClient
import ContentArchive
import Crypto
import DurableFiles
import Foundation
import IAPProtocol
import NIOCore
import NIOPosix
import Synchronization
import SystemPackage

/// The server's answer shows a grant that expired mid-download: a fresh grant continues it.
struct GrantExpired: Error {}

/// The server's archive is not the one the journal describes (a 200 or 416 where a range was
/// asked, or another ETag); the partial file was discarded.
struct ArchiveChanged: Error, CustomStringConvertible {
    var description: String { "the archive changed on the server; starting over" }
}

/// Where the fetcher gets one response's events from: ``BodyReceiver`` (AsyncHTTPClient) or
/// ``DirectBodyReader``.
protocol ResponseBodySource: Sendable {
    var events: AsyncThrowingStream<BodyReceiver.Event, Error> { get }
    /// Where the body written so far ends (parts not yet handed over included).
    var writtenThrough: Int64 { get }
    func proceed(_ disposition: BodyReceiver.Disposition)
    func consumed(_ count: Int)
}

extension BodyReceiver: ResponseBodySource {}
extension DirectBodyReader: ResponseBodySource {}

/// Hands out the indexes of the ranges to fetch, one at a time, to the connections of a transfer.
final class RangeQueue: Sendable {
    private let next = Mutex(0)
    func take() -> Int {
        next.withLock { value in
            defer { value += 1 }
            return value
        }
    }
}

// One transfer of one archive: the partial file continued from the journal over one or more
// connections, hashed as bytes arrive, checked against the grant's SHA-256.
extension ContentFetcher {
    /// One attempt: continues the partial file from what the journal says is on disk, over one or
    /// more connections, with `Range` and `If-Range`, hashing as bytes arrive; ends with the
    /// SHA-256 check.
    /// `extraction`, when given, takes the archive's bytes as they are hashed.
    func transfer(_ download: inout DownloadStateMachine, extraction: StreamingExtractor? = nil) async throws {
        let record = download.record
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
        var segments: [Segment]
        if let delta = record.delta {
            // Only the delta's ranges are in the file, at their offsets; nothing is truncated.
            segments = record.segments ?? delta.ranges
            if record.bootId != nil, record.bootId != BootID.current { segments = record.durable ?? delta.ranges }
            if !delta.matches(segments) { segments = delta.ranges }
        } else {
            segments = record.segments ?? [Segment(start: 0, end: record.expectedLength, done: record.recordedLength)]
            if record.bootId != nil, record.bootId != BootID.current {
                // The machine restarted since: only the synced bytes are certain to be on disk.
                segments = record.durable ?? [Segment(start: 0, end: record.expectedLength, done: 0)]
            }
            if !Segment.isValid(segments, length: record.expectedLength) {
                segments = [Segment(start: 0, end: record.expectedLength, done: 0)]
            }
            if segments.count == 1 {
                // Bytes past the journal's mark may be torn by a kill: drop them, when there are
                // any. A file already that short is left alone: on ext4 a truncation to zero marks
                // the file so that closing it writes back and allocates every byte written since
                // (`auto_da_alloc`), which held the end of a fresh 1 GiB download for half a second.
                var status = stat()
                guard fstat(fd.rawValue, &status) == 0 else {
                    throw FetchError(.install, "cannot read the size of \(path): \(String(cString: strerror(errno)))")
                }
                if Int64(status.st_size) > segments[0].done, ftruncate(fd.rawValue, off_t(segments[0].done)) != 0 {
                    throw FetchError(.install, "cannot truncate \(path): \(String(cString: strerror(errno)))")
                }
                if configuration.connections > 1 {
                    segments = Segment.plan(
                        length: record.expectedLength, durable: segments[0].done,
                        connections: configuration.connections, minimum: configuration.minimumSegment)
                }
            }
        }
        // A lean download (``leanDownloads``: a whole archive on one connection without a rate
        // limit) reserves no blocks for the bytes its file will leave out: the disk may not hold
        // them beside the content. Ranges an earlier run on several connections left go on as
        // several, which leave nothing out.
        let lean =
            leanDownloads.contains(record.id) && segments.count == 1
            ? extraction.flatMap { $0.isActive ? LeftOutRanges($0.storedRanges) : nil } : nil
        if record.delta == nil {
            // What no segment has written yet: the blocks the rest of the archive will take.
            let from = segments.map { $0.start + $0.done }.min() ?? 0
            spaceTaken(try PartialArchive.reserve(fd, path: path, from: from, to: record.expectedLength, leavingOut: lean?.blocks ?? []), by: record.id)
        }
        let partial: PartialArchive
        do {
            partial = try PartialArchive(
                fd: fd, path: path, journal: journal, download: download, segments: segments,
                syncInterval: configuration.journalInterval, recordGap: configuration.journalMinimumGap,
                durableInterval: configuration.durableInterval, extraction: extraction)
        } catch {
            // The file is shorter than the journal says: start over rather than trust it.
            download.updateBytes { $0.discardBytes() }
            try journal.save(download.record)
            throw error
        }
        transfers[record.id] = partial
        defer {
            download = partial.download
            transfers[record.id] = nil
        }
        let missing = partial.missing
        if missing.isEmpty {
            // Every byte is already on disk (an earlier run stopped before installing).
            try apply(.accepted, to: &partial.download)
        } else {
            let (id, url, etag, length) = (record.id, record.url, record.etag, record.expectedLength)
            // A delta may have hundreds of ranges: they are taken in turn by a few connections.
            let workers = min(missing.count, max(configuration.connections, record.delta == nil ? 1 : 4))
            let whole = partial.segments.count == 1 && record.delta == nil
            // A delta's many small ranges keep AsyncHTTPClient's pooled connections.
            let direct = record.delta == nil
            // Bytes written but not yet handed to this actor: they wait in the page cache, not in
            // memory of ours, and a deep window lets one receiver run ahead while the hash catches
            // up. With several, the hash only follows the first range anyway, and 16 MiB in all
            // keeps a pause or cancel prompt when this actor is slow to run.
            let window = workers == 1 ? 32 << 20 : max(4 << 20, (16 << 20) / workers)
            let next = RangeQueue()
            // A delta's ranges are not hashed as one archive: their pages are never dropped.
            let frontier = record.delta == nil ? partial.frontier : nil
            // One connection through the whole archive: every piece arrives where the hash stands,
            // so it can be hashed from the reader's buffer and written around the page cache. Not
            // under a rate limit, which paces reads in small steps that pieces would bunch up.
            let unbuffered = workers == 1 && whole && limiter == nil ? path : nil
            let leaving = unbuffered == nil ? nil : try leaveOut(partial)
            if lean != nil, leaving == nil, let from = missing.first?.from {
                // Nothing is left out after all (the extraction was given up as the file was opened):
                // every block is needed, and a disk that cannot hold them is found now.
                spaceTaken(try PartialArchive.reserve(fd, path: path, from: from, to: length), by: id)
            }
            do {
                try await withThrowingTaskGroup(of: Void.self) { group in
                    for _ in 0..<workers {
                        group.addTask {
                            while true {
                                let index = next.take()
                                guard index < missing.count else { return }
                                let part = missing[index]
                                try await self.fetch(
                                    id: id, segment: part.segment, from: part.from, to: part.to, length: length,
                                    whole: whole, url: url, etag: etag, fd: fd,
                                    window: window, direct: direct, frontier: frontier, unbuffered: unbuffered, leaving: leaving)
                            }
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
                    try? partial.recordProgress(durability: .powerLoss)
                }
                throw error
            }
            try partial.recordProgress(durability: .processKill)
        }
        if let delta = partial.record.delta {
            try checkDeltaRanges(partial, delta: delta)
            emit(partial.download.update(received: delta.bytesToFetch, rate: partial.rate))
            Failpoint.hit("verified")
            return
        }
        guard let digest = try partial.digest() else {
            throw FetchError(.network, "the transfer ended at byte \(partial.hashed) of \(record.expectedLength)")
        }
        guard digest == partial.record.sha256 else {
            // The chunks are checked below from the file: the bytes the extraction holds go back first.
            partial.extraction?.abandon(because: "the archive's SHA-256 does not match the grant's")
            // Corrupt bytes: with the manifest's chunk hashes, only what follows the first damaged
            // chunk is fetched again; without (or when the damage is outside every entry), all of it.
            let wrong = "the downloaded archive's SHA-256 is \(digest), not the granted \(partial.record.sha256)"
            let next: String
            if let sha256 = partial.record.manifestSHA256, let manifest = try? loadManifest(record.id, sha256: sha256),
                manifest.archiveSHA256 == partial.record.sha256, let damaged = firstDamagedChunk(partial, manifest: manifest)
            {
                partial.download.updateBytes {
                    $0.segments = nil
                    $0.durable = nil
                    $0.recordedLength = damaged
                    $0.bootId = BootID.current
                }
                next = "fetching again from byte \(damaged), where the first damaged chunk starts"
            } else {
                try partial.restart()
                next = "fetching it again"
            }
            try journal.save(partial.record)
            // The same wrong bytes twice come from the server's copy, not the network: five
            // attempts would fetch them (up to 2 GiB) five times. The next run asks again, from
            // where the bytes went wrong.
            let repeated = wrongDigests[record.id] == digest
            wrongDigests[record.id] = digest
            guard !repeated else {
                throw ServerCopyDamaged(
                    reason: FetchError(
                        .integrity,
                        "\(wrong), the same wrong bytes twice: the server's copy of the archive is damaged (or something between the server and this device changes the bytes the same way each time), and it is not fetched again in this run; the server's operator finds a damaged copy with `iap-server check` (or the server's daily read) and repairs it by publishing the archive again"
                    ))
            }
            throw FetchError(.integrity, "\(wrong); \(next)")
        }
        // Every byte is here and verified: observers see 100% before the install starts.
        emit(partial.download.update(received: partial.record.expectedLength, rate: partial.rate))
        Failpoint.hit("verified")
    }

    /// One connection's part of a transfer: asks for `[from, to)`; `BodyReceiver` writes what
    /// arrives at its offset on the event loop, and each part is then reported to the actor.
    nonisolated func fetch(
        id: String, segment: Int, from: Int64, to: Int64, length: Int64, whole: Bool,
        url: String, etag: String?, fd: SystemPackage.FileDescriptor,
        window: Int, direct: Bool, frontier: HashFrontier?, unbuffered: String?, leaving: LeftOutRanges? = nil
    ) async throws {
        let ranged = from > 0 || to < length
        var headers: [(String, String)] = [("User-Agent", configuration.userAgent)]
        if ranged {
            headers.append(("Range", "bytes=\(from)-\(to - 1)"))
            if let etag { headers.append(("If-Range", etag)) }
        }
        if direct && DirectBodyReader.handles(url) {
            let reader = DirectBodyReader(
                fd: fd, window: window, limiter: limiter, stallTimeout: configuration.stallTimeout, frontier: frontier, unbuffered: unbuffered,
                leaving: leaving)
            reader.start(url: url, headers: headers)
            defer { reader.close() }
            do {
                try await withTaskCancellationHandler {
                    try await consume(reader, id: id, segment: segment, from: from, to: to, length: length, ranged: ranged, whole: whole)
                } onCancel: {
                    reader.close()
                }
                return
            } catch is DirectBodyReader.Unsupported {
                // A redirect or a body without Content-Length: AsyncHTTPClient handles those.
            }
        }
        var request: HTTPClient.Request
        do { request = try HTTPClient.Request(url: url) } catch {
            throw FetchError(.refused, "the grant's URL \(url) is not usable: \(error)")
        }
        for (name, value) in headers { request.headers.add(name: name, value: value) }
        let receiver = BodyReceiver(fd: fd, window: window, limiter: limiter, frontier: frontier, unbuffered: unbuffered, leaving: leaving)
        // One loop for the channel and the delegate: otherwise every part hops between two threads.
        let task = client.execute(request: request, delegate: receiver, eventLoop: .delegateAndChannel(on: client.eventLoopGroup.next()))
        defer {
            receiver.close()
            task.cancel()
        }
        do {
            try await withTaskCancellationHandler {
                try await consume(receiver, id: id, segment: segment, from: from, to: to, length: length, ranged: ranged, whole: whole)
            } onCancel: {
                task.cancel()
            }
        } catch {
            throw connectionFailure(error, url: url) ?? error
        }
    }

    /// Handles the events of one response: checks its head, records its body, ends the range.
    private nonisolated func consume(
        _ source: some ResponseBodySource, id: String, segment: Int, from: Int64, to: Int64, length: Int64,
        ranged: Bool, whole: Bool
    ) async throws {
        var status: UInt = 0
        var position = from
        var end = to
        for try await event in source.events {
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
                    source.proceed(.collect)
                    continue
                case 416: throw ArchiveChanged()
                case 401: throw GrantExpired()
                case 404: throw FetchError(.noContent, "the archive is no longer on the server")
                default:
                    let retryAfter = head.headers.first(name: "retry-after")
                    if let later = RetryLater.from(status: status, retryAfter: retryAfter, cap: configuration.maxRetryAfter, what: "the archive") {
                        throw later
                    }
                    // Its reason (a 503 for an archive damaged on the server, say) is in the body.
                    source.proceed(.collect)
                    continue
                }
                try await accept(id, etag: head.headers.first(name: "etag"))
                source.proceed(.write(from: position, to: end))
            case .body(let count, let offset):
                try await self.received(id, segment: segment, count: count, writtenThrough: source.writtenThrough)
                source.consumed(count)
                position = offset + Int64(count)
            case .piece(let piece):
                defer { piece.release() }
                try await self.received(id, segment: segment, piece: piece, writtenThrough: source.writtenThrough)
                position = piece.offset + Int64(piece.count)
            case .end(let collected):
                if status == 403 {
                    let envelope = ErrorEnvelope.read((collected ?? ByteBuffer()).readableBytesView)
                    throw FetchError(envelope.code() == .revoked ? .revoked : .refused, envelope.error.message)
                }
                if status != 200, status != 206 {
                    let message = ErrorEnvelope.read((collected ?? ByteBuffer()).readableBytesView).error.message
                    throw FetchError(.network, "the server answered \(status)" + (message.isEmpty ? "" : ": \(message)"))
                }
                guard position == end else {
                    throw FetchError(.network, "the transfer ended at byte \(position) of \(end)")
                }
                try await rangeReceived(id, segment: segment, through: end)
                Failpoint.hit("range-done")
                return
            }
        }
        try Task.checkCancellation()
        throw FetchError(.network, "the connection closed at byte \(position) of \(end)")
    }

    /// Checks every fetched entry's stored bytes against the manifest's chunk hashes; damaged
    /// ones are forgotten (their ranges fetched again by the retry) and reported as an integrity error.
    /// A delta range is complete on disk: its entries are checked now, so a damaged one is
    /// fetched again at once rather than found when everything else is in.
    func rangeReceived(_ id: String, segment: Int, through end: Int64) throws {
        guard let partial = transfers[id], let delta = partial.record.delta, partial.segments.indices.contains(segment) else { return }
        try checkDeltaRanges(partial, delta: delta, within: partial.segments[segment].start..<end)
    }

    private func checkDeltaRanges(_ partial: PartialArchive, delta: DeltaPlan, within span: Range<Int64>? = nil) throws {
        let manifest = try loadManifest(partial.record.id, sha256: delta.manifestSHA256)
        guard let size = manifest.chunkSize else { return }
        let entries = fetchedEntries(partial.record.id, delta: delta, manifest: manifest)
        // Entries are sorted by offset: those inside the span are one run of them.
        var first = entries.startIndex
        if let span {
            var high = entries.endIndex
            while first < high {
                let middle = (first + high) / 2
                if Int64(entries[middle].dataOffset) < span.lowerBound { first = middle + 1 } else { high = middle }
            }
        }
        var damaged: [(path: String, start: Int64, end: Int64)] = []
        for entry in entries[first...] {
            if let span, Int64(entry.dataOffset + entry.compressedSize) > span.upperBound { break }
            guard let expected = entry.chunks else { continue }
            if ChunkHasher.digests(of: partial.fd, at: entry.dataOffset, count: entry.compressedSize, chunkSize: size) != expected {
                damaged.append((entry.path, Int64(entry.dataOffset), Int64(entry.dataOffset + entry.compressedSize)))
            }
        }
        guard damaged.isEmpty else {
            try partial.refetch(damaged.map { ($0.start, $0.end) })
            throw FetchError(.integrity, "\(damaged.count) updated entries (\(damaged[0].path) first) do not match the manifest's chunk hashes; fetching them again")
        }
    }

    /// The entries a delta fetches that have stored bytes, by offset; worked out once per run:
    /// every range that arrives is checked against them, and a large product has thousands of
    /// entries of which a delta fetches a few.
    private func fetchedEntries(_ id: String, delta: DeltaPlan, manifest: ArchiveManifest) -> [ArchiveManifest.Entry] {
        if let known = manifests[id]?.fetchedByOffset { return known }
        let fetched = Set(delta.fetched)
        let entries = manifest.entries.filter { fetched.contains($0.path) && $0.compressedSize > 0 }.sorted { $0.dataOffset < $1.dataOffset }
        manifests[id]?.fetchedByOffset = entries
        return entries
    }

    /// Where the first entry chunk whose bytes on disk do not match the manifest starts; nil when
    /// every chunk matches (the damage is in headers or the central directory).
    private func firstDamagedChunk(_ partial: PartialArchive, manifest: ArchiveManifest) -> Int64? {
        guard let size = manifest.chunkSize else { return nil }
        for entry in manifest.entries.sorted(by: { $0.dataOffset < $1.dataOffset }) where entry.compressedSize > 0 {
            guard let expected = entry.chunks else { return nil }
            let found = ChunkHasher.digests(of: partial.fd, at: entry.dataOffset, count: entry.compressedSize, chunkSize: size) ?? []
            if let index = expected.indices.first(where: { $0 >= found.count || found[$0] != expected[$0] }) {
                return Int64(entry.dataOffset + UInt64(index) * size)
            }
        }
        return nil
    }

    /// The manifest saved for download `id`, checked against `sha256` again (it is small).
    func loadManifest(_ id: String, sha256: String) throws -> ArchiveManifest {
        // Decoding a manifest of thousands of entries takes a while: each is decoded once per run.
        if let cached = manifests[id], cached.sha256 == sha256 { return cached.manifest }
        let path = journal.manifestPath(id)
        guard let data = FileManager.default.contents(atPath: path), Hex.encode(SHA256.hash(data: data)) == sha256 else {
            throw FetchError(.install, "the manifest saved for \(id) is missing or damaged; the download starts over")
        }
        let manifest = try ArchiveManifest.decode(data, source: path)
        manifests[id] = LoadedManifest(sha256: sha256, manifest: manifest)
        return manifest
    }

    func restart(_ id: String) throws {
        guard let partial = transfers[id] else { throw CancellationError() }
        try partial.restart()
    }

    /// A response was accepted: its validator must be the one of the bytes on disk.
    func accept(_ id: String, etag: String?) throws {
        guard let partial = transfers[id] else { throw CancellationError() }
        if let etag {
            if let known = partial.record.etag, known != etag { throw ArchiveChanged() }
            partial.download.updateBytes { $0.etag = etag }
        }
        try apply(.accepted, to: &partial.download, received: partial.bytesWritten, rate: partial.rate)
    }

    /// Bytes were written: hash them, sync when due, apply pause or cancel, report progress.
    /// A piece written around the page cache: hashed from its buffer when it is next in line
    /// (otherwise read back from the file, as other bytes are), then recorded as other bytes are.
    /// Blocks the writer left out are written here unless the extraction took them.
    func received(_ id: String, segment: Int, piece: UnbufferedWriter.Piece, writtenThrough: Int64) throws {
        guard let partial = transfers[id] else { throw CancellationError() }
        let extracted = partial.hash(piece.bytes, at: piece.offset)
        if !extracted {
            for range in piece.leftOut { try partial.write(piece.bytes(of: range), at: range.lowerBound) }
        }
        try received(id, segment: segment, count: piece.count, writtenThrough: writtenThrough)
    }

    /// With one connection and a streamed extraction, the stored files' blocks are left out of
    /// the partial archive (``LeftOutRanges``): the journal first names the extraction's folder,
    /// where a later run finds them after a kill.
    private func leaveOut(_ partial: PartialArchive) throws -> LeftOutRanges? {
        guard let extraction = partial.extraction, extraction.isActive else { return nil }
        let ranges = extraction.storedRanges
        guard !ranges.isEmpty else { return nil }
        let leaving = LeftOutRanges(ranges)
        extraction.copyBack(into: partial.path)
        partial.leaving = leaving
        let folder = (extraction.folder as NSString).lastPathComponent
        if partial.record.streamedInto != folder {
            partial.download.updateBytes { $0.streamedInto = folder }
            // Without an fsync: a record that survives a power cut was synced after this one and
            // names the folder too; one synced before counts only bytes the file holds.
            try journal.save(partial.record, durability: .processKill)
        }
        return leaving
    }

    func received(_ id: String, segment: Int, count: Int, writtenThrough: Int64) throws {
        guard let partial = transfers[id] else { throw CancellationError() }
        try partial.wrote(count, segment: segment, writtenThrough: writtenThrough)
        if stopAll { throw Stop(control: .pause) }
        if let control = controls[id] { throw Stop(control: control) }
        // Requests from other processes are read at syncs: a file check per chunk would cost more.
        let (recorded, makeDurable) = try partial.recordIfDue()
        if let snapshot = makeDurable { syncInBackground(id, partial: partial, snapshot: snapshot) }
        if recorded, journal.takeCancelRequest(id) { throw Stop(control: .cancel) }
        if Failpoint.isSet("half-recorded"), partial.bytesWritten * 2 >= partial.record.expectedLength {
            try partial.recordProgress(durability: .processKill)
            Failpoint.hit("half-recorded")
        }
        // Checked before building the update: this runs for every batch received.
        if progressDue(id) { emit(partial.download.update(received: partial.bytesWritten, rate: partial.rate)) }
    }

    /// fsyncs the partial file on a thread of its own, so that the event loop and this actor go on
    /// receiving and recording (an fsync of seconds of transfer can take a while); the journal then
    /// records `snapshot` as durable, unless the transfer ended meanwhile (its record is final then).
    func syncInBackground(_ id: String, partial: PartialArchive, snapshot: [Segment]) {
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

    func backgroundSyncDone(_ id: String, identity: ObjectIdentifier, snapshot: [Segment]?) {
        guard let partial = transfers[id], ObjectIdentifier(partial) == identity else { return }
        if let snapshot { try? partial.madeDurable(snapshot) } else { try? partial.madeDurable([]) }
    }
}

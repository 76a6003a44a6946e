import CLinuxWriteback
import ContentArchive
import Crypto
import DurableFiles
import Foundation
import NIOCore
import SystemPackage

/// A byte range of the archive fetched over its own connection. The journal records `done`: the
/// bytes from `start` that are synced to disk.
struct Segment: Codable, Sendable, Equatable {
    var start: Int64
    /// Exclusive.
    var end: Int64
    var done: Int64

    /// Splits `[0, length)` for `connections` connections, the first segment keeping the
    /// `durable` bytes already on disk; never into segments smaller than `minimum`.
    static func plan(length: Int64, durable: Int64, connections: Int, minimum: Int64) -> [Segment] {
        let remaining = length - durable
        let count = Int(max(1, min(Int64(connections), remaining / max(1, minimum))))
        guard count > 1 else { return [Segment(start: 0, end: length, done: durable)] }
        let share = remaining / Int64(count)
        var segments = [Segment(start: 0, end: durable + share, done: durable)]
        for k in 1..<count {
            let start = durable + Int64(k) * share
            segments.append(Segment(start: start, end: k == count - 1 ? length : start + share, done: 0))
        }
        return segments
    }

    /// Whether `segments` tile `[0, length)` in order, each with a sane `done`: a journal from
    /// disk is checked before it is trusted.
    static func isValid(_ segments: [Segment], length: Int64) -> Bool {
        var next: Int64 = 0
        for s in segments {
            guard s.start == next, s.end > s.start, s.done >= 0, s.start + s.done <= s.end else { return false }
            next = s.end
        }
        return next == length && !segments.isEmpty
    }
}

/// The partial archive on disk while one or more connections write into it: what each segment has
/// written and synced, and the SHA-256 of the contiguous prefix.
///
/// The hash follows a frontier: bytes that arrive exactly at it are hashed as they arrive; bytes
/// that later segments wrote ahead of it are read back from the file (from the page cache) once
/// the frontier reaches them. With one connection every byte is hashed as it arrives, and with
/// several the check still completes with the last byte instead of re-reading 2 GiB at the end.
/// Used only from the fetcher actor.
final class PartialArchive {
    let fd: SystemPackage.FileDescriptor
    let path: String
    let journal: DownloadJournal
    let syncInterval: Int64
    /// The least time between two progress records (see `FetchConfiguration.journalMinimumGap`).
    let recordGap: Duration
    let durableInterval: Duration
    /// The download's state and record; byte bookkeeping here changes only its bytes.
    var download: DownloadStateMachine
    var record: DownloadRecord { download.record }
    var rate = RateEstimator()
    private(set) var segments: [Segment]
    /// Bytes written from each segment's start and handled here (hashed when at the frontier);
    /// at least its `done`.
    private(set) var written: [Int64]
    /// Bytes the receivers have written from each segment's start, possibly ahead of `written`:
    /// what the journal records, since they are in the file as much as the others are.
    private var ahead: [Int64]
    private var hasher = SHA256()
    private(set) var hashed: Int64 = 0
    /// `hashed`, for the body sources' threads (``WriteBehind``).
    let frontier = HashFrontier()
    /// The segment the hash frontier is in.
    private var cursor = 0
    private var syncedTotal: Int64
    private var durableTotal: Int64
    private var durableSyncRunning = false
    private var lastDurableSync = ContinuousClock.now
    private var lastRecord = ContinuousClock.now
    /// A delta update fetches scattered ranges: there is no contiguous archive to hash, and each
    /// fetched entry is checked against the manifest's chunk hashes instead.
    private var sparse: Bool
    /// Takes every byte as it is hashed, in order: the install is written as the archive arrives.
    let extraction: StreamingExtractor?
    /// The blocks the body's writer leaves out of the file, which the extraction writes instead.
    var leaving: LeftOutRanges?
    /// Where the file's bytes stop being whole: set when the extraction was given up and could not
    /// put back every byte it held (``StreamingExtractor/notCopiedBack``).
    private var brokenFrom: Int64?

    init(
        fd: SystemPackage.FileDescriptor, path: String, journal: DownloadJournal, download: DownloadStateMachine,
        segments: [Segment], syncInterval: Int64, recordGap: Duration, durableInterval: Duration,
        extraction: StreamingExtractor? = nil
    ) throws(FetchError) {
        sparse = download.record.delta != nil
        var segments = segments
        // Bytes the extraction took that this attempt fetches again may differ from those it
        // hashes (only the final hash is checked): such an extraction is given up, and the
        // install reads the archive instead. The bytes it holds that the file left out and this
        // attempt keeps go back into the file; any it could not put back are fetched again.
        if let extraction, let first = segments.first, extraction.position > UInt64(first.start + first.done) {
            let kept = first.start + first.done
            extraction.abandon(
                because: "the transfer starts again at \(kept), before the \(extraction.position) bytes extracted", copyingBackBelow: UInt64(kept))
            if let lost = extraction.notCopiedBack, Int64(lost) < kept { segments[0].done = max(0, Int64(lost) - first.start) }
        }
        self.extraction = extraction
        self.fd = fd
        self.path = path
        self.journal = journal
        self.download = download
        let record = download.record
        self.segments = segments
        self.syncInterval = syncInterval
        self.recordGap = recordGap
        self.durableInterval = durableInterval
        written = segments.map(\.done)
        ahead = written
        syncedTotal = written.reduce(0, +)
        durableTotal = record.bootId == nil ? syncedTotal : (record.durable ?? []).reduce(0) { $0 + $1.done }
        // SHA-256 state cannot be saved, so the hash of what is already on disk is rebuilt.
        try advanceHash()
    }

    var bytesWritten: Int64 { written.reduce(0, +) }

    /// The ranges still to fetch: (segment, from, to) with `to` exclusive.
    var missing: [(segment: Int, from: Int64, to: Int64)] {
        segments.indices.compactMap { i in
            let from = segments[i].start + written[i]
            return from < segments[i].end ? (i, from, segments[i].end) : nil
        }
    }

    /// Records `count` bytes that segment `index` has just written after its earlier ones; its
    /// receiver has written up to `writtenThrough` by now.
    func wrote(_ count: Int, segment index: Int, writtenThrough: Int64? = nil) throws(FetchError) {
        if let broken = brokenFrom { try forget(from: broken) }
        written[index] += Int64(count)
        // Pieces written but not handed here yet may lack blocks left out for the extraction:
        // only bytes handled here count then.
        let through = leaving == nil ? (writtenThrough ?? 0) - segments[index].start : 0
        ahead[index] = max(ahead[index], written[index], through)
        rate.add(Int64(count))
        try advanceHash(minimum: Self.hashWindow)
    }

    /// Hashes, from the file, written bytes that are contiguous with the hashed prefix, once at
    /// least `minimum` of them wait (or their segment is complete).
    ///
    /// The receiver writes what arrives and lets its buffers go at once; the hash reads the bytes
    /// back through mappings of the page cache. Handing the received buffers to this actor instead
    /// kept megabytes of them alive, so the event loop read every part into cold memory, and its
    /// writes into the page cache took up to eight times as long while the hash ran beside them
    /// (docs/performance.md, "The client's spread"). Mapping costs no copy; a few MiB at a time,
    /// unmapped once hashed, keep memory flat.
    private func advanceHash(minimum: Int64 = 0) throws(FetchError) {
        while !sparse && cursor < segments.count {
            let segment = segments[cursor]
            if hashed >= segment.end {
                cursor += 1
                continue
            }
            let available = segment.start + written[cursor]
            guard hashed < available, available - hashed >= minimum || available == segment.end else { return }
            // A mapping past the end of the file would fault on reading: a file shorter than the
            // journal says (damaged, or truncated by hand) is an error, as a short read was.
            var status = stat()
            guard fstat(fd.rawValue, &status) == 0, Int64(status.st_size) >= available else {
                throw FetchError(.install, "\(path) is shorter than its journal says; it will be fetched again")
            }
            while hashed < available {
                let end = min(available, hashed + Self.hashWindow)
                do throws(ArchiveError) {
                    let mapped = try MappedBytes(fd, range: UInt64(hashed)..<UInt64(end), path: path)
                    _ = hashAndExtract(mapped.bytes, at: hashed)
                } catch {
                    throw FetchError(.install, "cannot read back \(path): \(error.message)")
                }
                hashed = end
                frontier.store(end)
            }
        }
    }

    /// Hands hashed bytes to the extraction: one that fails has abandoned itself (the install then
    /// reads the archive), and the transfer goes on. Returns whether the extraction took them.
    @discardableResult
    private func extract(_ bytes: UnsafeRawBufferPointer, at offset: Int64) -> Bool {
        guard let extraction else { return false }
        if Failpoint.refuses("extraction"), offset * 2 >= record.expectedLength { extraction.abandon(because: "a test gave it up half-way") }
        if (try? extraction.consume(bytes, at: UInt64(offset))) != nil, extraction.isActive { return true }
        // Given up: from now on the writer writes every byte, and the file must hold those the
        // extraction put back; if it could not put them all back, they are fetched again.
        if let leaving, leaving.isOn {
            leaving.stop()
            if let lost = extraction.notCopiedBack { brokenFrom = min(brokenFrom ?? .max, Int64(lost)) }
        }
        return false
    }

    /// Hashes `bytes`, just written at `offset`, from the caller's buffer when they are where the
    /// hash stands (one connection, the prefix on disk hashed already); otherwise does nothing, and
    /// ``wrote(_:segment:writtenThrough:)`` reads them back from the file when their turn comes.
    /// Called before `wrote` for the same bytes, which then finds them hashed. Returns whether the
    /// extraction took them (the file may then leave them out).
    @discardableResult
    func hash(_ bytes: UnsafeRawBufferPointer, at offset: Int64) -> Bool {
        guard !sparse, cursor < segments.count, hashed == offset, offset + Int64(bytes.count) <= segments[cursor].end else { return false }
        let extracted = hashAndExtract(bytes, at: offset)
        hashed += Int64(bytes.count)
        frontier.store(hashed)
        return extracted
    }

    /// At least this many bytes are hashed and extracted side by side.
    private static let sideBySide = 1 << 20

    /// Hashes `bytes` and hands them to the extraction; returns whether it took them. With an
    /// extraction and a megabyte or more, the two run side by side on two threads, both reading
    /// the caller's buffer, and this returns once both are done.
    ///
    /// Why: SHA-256 cannot be split, and the extraction's CRC-32 and copy after it on the same
    /// thread made that thread the transfer's bound once the server sends faster than the hash
    /// (docs/performance.md, forty-third stop).
    private func hashAndExtract(_ bytes: UnsafeRawBufferPointer, at offset: Int64) -> Bool {
        guard let extraction, extraction.isActive, bytes.count >= Self.sideBySide else {
            hasher.update(bufferPointer: bytes)
            return extract(bytes, at: offset)
        }
        let lanes = SideBySide(archive: self, bytes: bytes, offset: offset)
        DispatchQueue.concurrentPerform(iterations: 2) { lane in lanes.run(lane) }
        hasher = lanes.hasher
        return lanes.extracted
    }

    /// The two lanes of ``hashAndExtract(_:at:)``: the first updates a copy of the hash, the
    /// second hands the bytes to the extraction (touching the archive's extraction state only);
    /// each writes its own result, read once both have returned.
    private final class SideBySide: @unchecked Sendable {
        let archive: PartialArchive
        let bytes: UnsafeRawBufferPointer
        let offset: Int64
        var hasher: SHA256
        var extracted = false

        init(archive: PartialArchive, bytes: UnsafeRawBufferPointer, offset: Int64) {
            (self.archive, self.bytes, self.offset, hasher) = (archive, bytes, offset, archive.hasher)
        }

        func run(_ lane: Int) {
            if lane == 0 { hasher.update(bufferPointer: bytes) } else { extracted = archive.extract(bytes, at: offset) }
        }
    }

    /// Writes bytes the body's writer left out, which the extraction did not take.
    func write(_ bytes: UnsafeRawBufferPointer, at offset: Int64) throws(FetchError) {
        do { _ = try fd.writeAll(toAbsoluteOffset: offset, bytes) } catch {
            throw FetchError(.install, "cannot write \(path): \(error); free disk space and run again")
        }
    }

    /// Bytes mapped at a time to be hashed, and the least that wait before they are.
    static let hashWindow: Int64 = 4 << 20

    /// Records progress when `syncInterval` bytes arrived since the last record and `recordGap`
    /// has passed since it; returns whether it recorded, and the segments to make durable when
    /// bytes were recorded and `durableInterval` passed since the last fsync (the caller fsyncs
    /// off its thread, then calls `madeDurable`).
    func recordIfDue() throws(FetchError) -> (recorded: Bool, makeDurable: [Segment]?) {
        let total = zip(written, ahead).reduce(0) { $0 + max($1.0, $1.1) }
        guard total - syncedTotal >= syncInterval else { return (false, nil) }
        let now = ContinuousClock.now
        guard now - lastRecord >= recordGap else { return (false, nil) }
        try recordProgress(durability: .processKill)
        guard !durableSyncRunning, syncedTotal > durableTotal, now - lastDurableSync >= durableInterval else { return (true, nil) }
        durableSyncRunning = true
        lastDurableSync = now
        return (true, segments)
    }

    /// An fsync that started after `snapshot` was recorded has completed.
    func madeDurable(_ snapshot: [Segment]) throws(FetchError) {
        durableSyncRunning = false
        let total = snapshot.reduce(0) { $0 + $1.done }
        guard total > durableTotal else { return }
        durableTotal = total
        download.updateBytes { $0.durable = snapshot }
        try journal.save(record)
    }

    /// Records in the journal what is written. For `.processKill` that costs no fsync: a killed
    /// process loses nothing the page cache holds, and the boot id tells a later run whether
    /// those bytes are still there. For `.powerLoss`, the file is synced first and the journal
    /// also keeps the synced segments for after a power cut.
    func recordProgress(durability: Durability) throws(FetchError) {
        let durable = durability == .powerLoss
        if durable {
            guard fsync(fd.rawValue) == 0 else {
                throw FetchError(.install, "cannot sync \(path): \(String(cString: strerror(errno))); free disk space and run again")
            }
        }
        for i in segments.indices { segments[i].done = min(segments[i].end - segments[i].start, max(written[i], ahead[i])) }
        syncedTotal = segments.reduce(0) { $0 + $1.done }
        lastRecord = .now
        if durable {
            durableTotal = syncedTotal
            lastDurableSync = .now
        }
        let (segments, total) = (segments, syncedTotal)
        download.updateBytes { record in
            if durable { record.durable = segments }
            record.bootId = BootID.current
            record.segments = segments.count > 1 || record.delta != nil ? segments : nil
            record.recordedLength = total
            record.updatedAt = Date()
        }
        try journal.save(record, durability: durability)
    }

    /// Reserves the disk blocks of `[from, to)` in the partial file before its bytes are fetched,
    /// without changing its size (which the journal's checks read).
    ///
    /// Why: a disk that cannot hold the archive is found before the transfer rather than near its
    /// end, downloads running side by side (or anything else) cannot take the space meanwhile, and
    /// each write then finds its blocks allocated: ext4 skips its per-block delayed-allocation
    /// bookkeeping, a tenth of the one-connection reader's CPU (docs/performance.md,
    /// "Space reserved"). Where the file system cannot reserve, nothing is done and the writes
    /// report a full disk as before. A download that fails here keeps no block reserved past its
    /// file's end.
    /// Returns the bytes newly taken on disk (blocks already the file's are not taken again).
    @discardableResult
    static func reserve(_ fd: SystemPackage.FileDescriptor, path: String, from: Int64, to end: Int64) throws(FetchError) -> Int64 {
        #if os(Linux)
            var status = stat()
            guard from < end, fstat(fd.rawValue, &status) == 0 else { return 0 }
            let before = Int64(status.st_blocks)
            guard cwriteback_reserve(fd.rawValue, from, end - from) != 0 else {
                return fstat(fd.rawValue, &status) == 0 ? max(0, Int64(status.st_blocks) - before) * 512 : 0
            }
            let reason = errno
            guard reason == ENOSPC || reason == EDQUOT else { return 0 }
            // A reservation that ran out of space part-way keeps what it took, past the file's
            // end: truncating to the size the file has gives it back.
            _ = ftruncate(fd.rawValue, status.st_size)
            throw FetchError(
                .install,
                "cannot reserve \(end - from) bytes for \(path): \(String(cString: strerror(reason))); free disk space and run again")
        #else
            return 0
        #endif
    }

    /// Reserves the blocks of `[from, to)` as ``reserve(_:path:from:to:)`` does, except those of
    /// `left` (whole blocks, in order), which the file leaves out; returns the bytes newly taken.
    static func reserve(
        _ fd: SystemPackage.FileDescriptor, path: String, from: Int64, to end: Int64, leavingOut left: [Range<Int64>]
    ) throws(FetchError) -> Int64 {
        var taken: Int64 = 0
        var start = from
        for block in left where block.upperBound > start && block.lowerBound < end {
            taken += try reserve(fd, path: path, from: start, to: block.lowerBound)
            start = block.upperBound
        }
        return taken + (try reserve(fd, path: path, from: start, to: end))
    }

    /// The archive changed on the server (a 200 answered a ranged request): everything on disk
    /// is discarded and the body that came with the 200 is written from byte 0.
    func restart() throws(FetchError) {
        // The new archive is not the one the extraction follows, nor are its ranges those left out.
        extraction?.abandon(because: "the archive changed on the server", copyingBackBelow: 0)
        leaving?.stop()
        // A delta's ranges belong to the archive that changed: the new one is fetched whole.
        sparse = false
        guard ftruncate(fd.rawValue, 0) == 0 else { throw FetchError(.install, "cannot truncate \(path): \(String(cString: strerror(errno)))") }
        // A whole archive's blocks were the file's a moment ago, so the fetcher's space accounting
        // is not told; after a delta's sparse ranges this takes more than it was told of, which
        // only makes other downloads wait longer for space.
        try Self.reserve(fd, path: path, from: 0, to: record.expectedLength)
        segments = [Segment(start: 0, end: record.expectedLength, done: 0)]
        written = [0]
        ahead = [0]
        hasher = SHA256()
        hashed = 0
        frontier.store(0)
        cursor = 0
        syncedTotal = 0
        durableTotal = 0
        download.updateBytes { $0.discardBytes() }
    }

    /// Forgets the bytes from `offset` on (one segment: the file lacks them) and ends the attempt;
    /// the next one hashes the file's prefix again and fetches the rest.
    private func forget(from offset: Int64) throws(FetchError) {
        brokenFrom = nil
        for i in segments.indices where segments[i].start + written[i] > offset {
            written[i] = max(0, offset - segments[i].start)
            ahead[i] = written[i]
            segments[i].done = min(segments[i].done, written[i])
        }
        hasher = SHA256()
        hashed = 0
        frontier.store(0)
        cursor = 0
        syncedTotal = min(syncedTotal, segments.reduce(0) { $0 + $1.done })
        durableTotal = min(durableTotal, syncedTotal)
        throw FetchError(
            .install, "the extraction was given up and could not put back the archive's bytes from \(offset) into \(path): they are fetched again")
    }

    /// Forgets the bytes of the segments that overlap `spans` (damaged ranges of a delta update),
    /// so that the next attempt fetches them again.
    func refetch(_ spans: [(start: Int64, end: Int64)]) throws(FetchError) {
        for i in segments.indices where spans.contains(where: { $0.start < segments[i].end && $0.end > segments[i].start }) {
            written[i] = 0
            ahead[i] = 0
            segments[i].done = 0
        }
        try recordProgress(durability: .powerLoss)
    }

    /// The archive's SHA-256, once every byte is written.
    func digest() throws(FetchError) -> String? {
        try advanceHash()
        guard hashed == record.expectedLength else { return nil }
        return Hex.encode(hasher.finalize())
    }
}

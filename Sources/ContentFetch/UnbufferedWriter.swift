import CLinuxWriteback
import Foundation
import Synchronization
import SystemPackage

#if canImport(Glibc)
    import Glibc
#endif

/// Writes a body to the partial file around the page cache (`O_DIRECT`, Linux), from a few
/// reused buffers, on a thread of its own; each piece, once on disk, goes to the fetcher, which
/// hashes it from the same buffer and hands the buffer back (``Piece/release()``). Both body
/// sources fill the buffers: ``DirectBodyReader`` from the socket on its thread (``acquire()``
/// waits), ``BodyReceiver`` from NIO's parts on the event loop (``tryAcquire()`` and
/// ``whenFree(_:)``, which must not wait).
///
/// Why: through the page cache, a one-connection transfer cost the reader 0.6 core-seconds per
/// GiB beyond reading the socket (the copy into pages the kernel hands out fresh, ext4's per-page
/// work, starting write-back and dropping the pages), and the hash read every byte back from
/// there; on two cores those and SHA-256 set the transfer's time. Read into a buffer, written
/// unbuffered and hashed from the buffer while it is still in the cache, the same transfer took
/// 1.07 s against 1.26 (old and new alternated in pairs; docs/performance.md, "Written around the
/// page cache"). The write runs beside the reading: written in turn, the two added up.
///
/// Pieces after the first start at a multiple of ``alignment``, as unbuffered writes must; the
/// first (a resumed download starts anywhere) and the last piece's tail go through the ordinary
/// descriptor. Memory is at most ``pieces`` x ``pieceSize``, whatever the archive's size, from a
/// ``PieceBufferPool`` that downloads running side by side share.
/// Ranges of the archive whose bytes the download's extraction writes into the installed files
/// as they arrive (``StreamingExtractor/storedRanges``): the writer leaves their whole blocks out
/// of the partial archive until ``stop()``, and each piece says what it left out.
///
/// Why: the partial archive is deleted once the content is installed, and its copy of a large
/// stored file was a second write of every byte: 1 GiB more written during a 1 GiB transfer.
/// Left out, `get` took 0.941 s against 1.086 (docs/performance.md, "Each byte written once").
/// Whatever needs the archive's bytes later gets them back from the extraction's files
/// (``StreamingExtractor/copyBack(into:)``): an extraction given up, a pause, the next run after a kill.
final class LeftOutRanges: Sendable {
    /// The whole blocks inside each range, in order.
    let blocks: [Range<Int64>]
    private let on = Atomic<Bool>(true)

    init(_ ranges: [Range<UInt64>], alignment: Int64 = Int64(UnbufferedWriter.alignment)) {
        blocks = ranges.compactMap { range in
            let start = (Int64(range.lowerBound) + alignment - 1) / alignment * alignment
            let end = Int64(range.upperBound) / alignment * alignment
            return start < end ? start..<end : nil
        }
    }

    /// Whether bytes are still left out.
    var isOn: Bool { on.load(ordering: .acquiring) }

    /// From now on every byte is written: the extraction that holds them was given up.
    func stop() { on.store(false, ordering: .releasing) }

    /// The parts of `range` to leave out, in order (none once stopped).
    func parts(of range: Range<Int64>) -> [Range<Int64>] {
        guard isOn else { return [] }
        var parts: [Range<Int64>] = []
        for block in blocks where block.lowerBound < range.upperBound && block.upperBound > range.lowerBound {
            parts.append(max(block.lowerBound, range.lowerBound)..<min(block.upperBound, range.upperBound))
        }
        return parts
    }
}

final class UnbufferedWriter: @unchecked Sendable {
    static let pieceSize = 4 << 20
    static let pieces = 4
    /// File offsets and lengths of unbuffered writes are multiples of this (the largest logical
    /// block size in common use), and so is the buffers' address.
    static let alignment = 4096

    /// One buffer's bytes, written at `offset`: the fetcher hashes them, then releases the buffer.
    struct Piece: @unchecked Sendable {
        fileprivate let owner: UnbufferedWriter
        fileprivate let slot: Int
        fileprivate let buffer: UnsafeMutableRawBufferPointer
        let offset: Int64
        let count: Int
        /// The archive ranges of this piece that were not written (``LeftOutRanges``).
        let leftOut: [Range<Int64>]

        var bytes: UnsafeRawBufferPointer { UnsafeRawBufferPointer(rebasing: buffer[0..<count]) }

        /// The bytes of `range`, which must be within the piece.
        func bytes(of range: Range<Int64>) -> UnsafeRawBufferPointer {
            UnsafeRawBufferPointer(rebasing: buffer[Int(range.lowerBound - offset)..<Int(range.upperBound - offset)])
        }

        /// The fetcher is done with the bytes: the reader may fill the buffer again.
        func release() { owner.release(slot) }
    }

    private struct Job {
        let slot: Int
        let buffer: UnsafeMutableRawBufferPointer
        let offset: Int64
        let count: Int
    }

    private let pool: PieceBufferPool
    private var member: PieceBufferPool.Member?
    private let direct: Int32
    /// A duplicate of the caller's descriptor, closed with the writer: the thread may finish a
    /// write after the caller gave up and closed its own, and must not write into whatever file
    /// reused that number.
    private let plain: Int32
    private let written: @Sendable (Piece) -> Void
    private let leaving: LeftOutRanges?
    /// Guards everything below.
    private let condition = NSCondition()
    /// The pool's buffer each slot holds while taken: being filled, queued, written or hashed.
    private var held: [UnsafeMutableRawBufferPointer?] = Array(repeating: nil, count: UnbufferedWriter.pieces)
    private var jobs: [Job] = []
    private var finished = false
    private var cancelled = false
    private var failure: FetchError?
    /// The writer's thread has ended.
    private var exited = false
    private var whenExited: (@Sendable (FetchError?) -> Void)?
    private var freeWaiters: [@Sendable () -> Void] = []
    /// Touched by the writer's thread only: the file system refused a direct write.
    private var directRefused = false

    /// Opens `path` again for unbuffered writes; nil where the file system has none, or `pool`
    /// has as many writers as buffers already, and the body then goes through the page cache.
    /// `plain` (the caller's descriptor of the same file, duplicated) writes the unaligned edges.
    /// `written` is called on the writer's thread, in order, as each piece is on disk. The
    /// buffers come from `pool`.
    init?(
        path: String, plain: SystemPackage.FileDescriptor, pool: PieceBufferPool = .shared, leaving: LeftOutRanges? = nil,
        written: @escaping @Sendable (Piece) -> Void
    ) {
        #if os(Linux)
            guard cwriteback_o_direct != 0 else { return nil }
            let fd = open(path, O_WRONLY | cwriteback_o_direct | O_CLOEXEC)
            guard fd >= 0 else { return nil }
            let ordinary = fcntl(plain.rawValue, F_DUPFD_CLOEXEC, 0)
            guard ordinary >= 0 else {
                close(fd)
                return nil
            }
            direct = fd
            self.plain = ordinary
        #else
            return nil
        #endif
        self.written = written
        self.leaving = leaving
        self.pool = pool
        // Weak: the pool outlives the writer, which leaves it in `deinit`.
        member = pool.join { [weak self] in self?.bufferFreed() }
        // `deinit` closes the descriptors.
        guard member != nil else { return nil }
        Thread.detachNewThread { [self] in writeLoop() }
    }

    deinit {
        // Nothing else can touch the buffers now: pieces and the thread hold the writer.
        if let member { pool.leave(member, returning: held.compactMap { $0 }) }
        close(direct)
        close(plain)
    }

    /// How many bytes the piece that starts at `position` takes, of a body that ends at `end`: a
    /// whole buffer, less what is left, and the first of a resumed download ends where the
    /// file's blocks start, so that every later piece is aligned.
    static func capacity(at position: Int64, end: Int64) -> Int {
        let misaligned = Int(position % Int64(alignment))
        return Int(min(Int64(pieceSize - misaligned), max(1, end - position)))
    }

    /// A free buffer to fill, waiting for one; nil once cancelled or a write failed.
    func acquire() -> (slot: Int, buffer: UnsafeMutableRawBufferPointer)? {
        condition.lock()
        defer { condition.unlock() }
        while !cancelled && failure == nil {
            if let taken = takeLocked() { return taken }
            condition.wait()
        }
        return nil
    }

    /// A free buffer if there is one now, for callers that must not wait (an event loop); nil
    /// otherwise: ``whenFree(_:)`` says when to ask again, ``stopped`` whether to.
    func tryAcquire() -> (slot: Int, buffer: UnsafeMutableRawBufferPointer)? {
        condition.lock()
        defer { condition.unlock() }
        guard !cancelled, failure == nil else { return nil }
        return takeLocked()
    }

    /// Runs `body` once a buffer may be free, or the writer stopped (at once if so already); on
    /// whichever thread frees it.
    func whenFree(_ body: @escaping @Sendable () -> Void) {
        condition.lock()
        guard !cancelled, failure == nil, !canTakeLocked() else {
            condition.unlock()
            body()
            return
        }
        freeWaiters.append(body)
        condition.unlock()
    }

    /// Takes a buffer from the pool into a free slot; the caller holds `condition`.
    private func takeLocked() -> (slot: Int, buffer: UnsafeMutableRawBufferPointer)? {
        guard let member, let slot = held.firstIndex(where: { $0 == nil }), let buffer = pool.take(for: member) else { return nil }
        held[slot] = buffer
        return (slot, buffer)
    }

    private func canTakeLocked() -> Bool {
        guard let member else { return false }
        return held.contains { $0 == nil } && pool.wouldTake(for: member)
    }

    /// A buffer came back to the pool (this writer's or another's): waiting fillers ask again.
    private func bufferFreed() {
        condition.lock()
        let waiters = freeWaiters
        freeWaiters = []
        condition.broadcast()
        condition.unlock()
        for waiter in waiters { waiter() }
    }

    /// Why the writer stopped taking pieces, if it did: a write's failure, or a cancellation.
    var stopped: Error? {
        condition.lock()
        defer { condition.unlock() }
        return failure ?? (cancelled ? CancellationError() : nil)
    }

    /// Queues `count` bytes of buffer `slot` to be written at `offset`; an empty piece gives the
    /// buffer back at once.
    func submit(slot: Int, offset: Int64, count: Int) {
        guard count > 0 else { return release(slot) }
        condition.lock()
        guard let buffer = held[slot] else {
            condition.unlock()
            preconditionFailure("submitted a slot that holds no buffer")
        }
        jobs.append(Job(slot: slot, buffer: buffer, offset: offset, count: count))
        condition.broadcast()
        condition.unlock()
    }

    /// Waits until every queued piece is written (or a write failed, or cancelled) and the
    /// writer's thread has ended. Returns the write's failure, if one failed.
    func finish() -> FetchError? {
        condition.lock()
        defer { condition.unlock() }
        finished = true
        condition.broadcast()
        while !exited { condition.wait() }
        return failure
    }

    /// ``finish()`` without waiting: `body` runs on the writer's thread once every queued piece
    /// has been handed over (or at once, if the thread has ended), with the write's failure.
    func finish(then body: @escaping @Sendable (FetchError?) -> Void) {
        condition.lock()
        finished = true
        guard !exited else {
            let failure = failure
            condition.unlock()
            return body(failure)
        }
        whenExited = body
        condition.broadcast()
        condition.unlock()
    }

    /// Stops at once: waiting callers return, queued pieces are dropped.
    func cancel() {
        condition.lock()
        cancelled = true
        let waiters = freeWaiters
        freeWaiters = []
        condition.broadcast()
        condition.unlock()
        for waiter in waiters { waiter() }
    }

    private func release(_ slot: Int) {
        condition.lock()
        let buffer = held[slot]
        held[slot] = nil
        condition.unlock()
        // The pool tells every member, this one too (``bufferFreed()``).
        if let buffer, let member { pool.give(buffer, from: member) }
    }

    private func writeLoop() {
        while true {
            condition.lock()
            while jobs.isEmpty && !finished && !cancelled && failure == nil { condition.wait() }
            guard !cancelled, failure == nil, !jobs.isEmpty else {
                // Finished with every piece written, cancelled, or a write failed.
                exited = true
                let (done, failure, waiters) = (whenExited, failure, freeWaiters)
                (whenExited, freeWaiters) = (nil, [])
                condition.broadcast()
                condition.unlock()
                for waiter in waiters { waiter() }
                done?(failure)
                return
            }
            let job = jobs.removeFirst()
            condition.unlock()
            let (error, leftOut) = write(job)
            // Handed over before the next piece is taken, and before the thread ends: the end of
            // the body, which `finish` lets the caller report, follows every piece.
            if error == nil {
                written(Piece(owner: self, slot: job.slot, buffer: job.buffer, offset: job.offset, count: job.count, leftOut: leftOut))
            }
            if let error {
                condition.lock()
                failure = error
                condition.unlock()
            }
        }
    }

    /// Writes a piece: its aligned part unbuffered, less the blocks left out, the rest (an
    /// unaligned start or end) through the page cache. Returns the ranges left out.
    private func write(_ job: Job) -> (FetchError?, [Range<Int64>]) {
        let bytes = UnsafeRawBufferPointer(rebasing: job.buffer[0..<job.count])
        let alignment = Int64(Self.alignment)
        var done = !directRefused && job.offset % alignment == 0 ? Int(Int64(job.count) / alignment * alignment) : 0
        let refused = job.offset > 0 && Failpoint.refuses("direct-write")
        let leftOut = done > 0 && !refused ? leaving?.parts(of: job.offset..<(job.offset + Int64(done))) ?? [] : []
        if done > 0, let code = refused ? EINVAL : writeDirect(bytes, at: job.offset, count: done, leaving: leftOut) {
            // A file system that opens for direct I/O but refuses the write (its block size is
            // larger, or it only pretends): the rest goes through the page cache.
            guard code == EINVAL else { return (BodyPacing.cannotWrite(String(cString: strerror(code))), []) }
            directRefused = true
            done = 0
        }
        if done < job.count, let code = writeAll(plain, UnsafeRawBufferPointer(rebasing: bytes[done...]), at: job.offset + Int64(done)) {
            return (BodyPacing.cannotWrite(String(cString: strerror(code))), [])
        }
        return (nil, done > 0 ? leftOut : [])
    }

    /// Writes the first `count` bytes of a piece that starts at `offset` unbuffered, but for the
    /// ranges `leaving` (whole blocks, in order).
    private func writeDirect(_ bytes: UnsafeRawBufferPointer, at offset: Int64, count: Int, leaving: [Range<Int64>]) -> Int32? {
        var from = offset
        for gap in leaving + [(offset + Int64(count))..<(offset + Int64(count))] {
            if gap.lowerBound > from,
                let code = writeAll(direct, UnsafeRawBufferPointer(rebasing: bytes[Int(from - offset)..<Int(gap.lowerBound - offset)]), at: from)
            {
                return code
            }
            from = max(from, gap.upperBound)
        }
        return nil
    }

    /// Writes all of `bytes` at `offset`; the error number if a write failed. A short direct
    /// write leaves the rest unaligned, and its next write then fails as refused.
    private func writeAll(_ fd: Int32, _ bytes: UnsafeRawBufferPointer, at offset: Int64) -> Int32? {
        var done = 0
        while done < bytes.count {
            let n = pwrite(fd, bytes.baseAddress! + done, bytes.count - done, off_t(offset + Int64(done)))
            if n < 0 && errno == EINTR { continue }
            guard n > 0 else { return n < 0 ? errno : EIO }
            done += n
        }
        return nil
    }
}

import AsyncHTTPClient
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import SystemPackage

/// Receives one response on the client's event loop and writes its body straight into the
/// partial file at its offset, the way curl writes as it reads; the fetcher then learns which
/// bytes are on disk, hashes them from the file and keeps the books. Each part's buffer is let go
/// once written, so NIO reads the next into the same warm memory.
///
/// Plain-HTTP archive transfers go through ``DirectBodyReader`` instead; this one serves HTTPS,
/// redirects and the many small ranges of a delta update. With one connection through a whole
/// archive it copies the parts into an ``UnbufferedWriter``'s buffers instead of writing them.
///
/// This exists because AsyncHTTPClient's async body sequence stops reading the socket after every
/// part until the consumer asks for the next one (its high watermark is a single part), so the
/// transfer waited on the consumer at every part (docs/performance.md has the figures). With this delegate the
/// socket keeps being read while up to `window` bytes wait for the fetcher.
final class BodyReceiver: HTTPClientResponseDelegate, Sendable {
    typealias Response = Void

    enum Event: Sendable {
        case head(HTTPResponseHead)
        /// `count` bytes have been written from `offset`.
        case body(count: Int, offset: Int64)
        /// A piece is written from `offset` around the page cache (``UnbufferedWriter``): the
        /// fetcher hashes it from its buffer, then releases the buffer.
        case piece(UnbufferedWriter.Piece)
        /// The response ended; with `.collect`, the start of its body.
        case end(collected: ByteBuffer?)
    }

    /// What to do with the body, decided by the fetcher from the head.
    enum Disposition: Sendable {
        /// Write it at `from`; more than `to - from` bytes is an error.
        case write(from: Int64, to: Int64)
        /// Keep the first 64 KiB (an error message) in memory.
        case collect
    }

    private struct State {
        var disposition: Disposition?
        var position: Int64 = 0
        var end: Int64 = 0
        var collected: ByteBuffer?
        var waitingForHead: EventLoopPromise<Void>?
        var outstanding = 0
        var waitingForWindow: EventLoopPromise<Void>?
        var pacing: BodyPacing
        /// Writing around the page cache: the writer, the piece being filled, and where the
        /// bytes on disk end (``writtenThrough``).
        var writer: UnbufferedWriter?
        var filling: Filling?
        var written: Int64 = 0
    }

    /// A buffer of the ``UnbufferedWriter`` being filled on the event loop.
    private struct Filling: @unchecked Sendable {
        let slot: Int
        let buffer: UnsafeMutableRawBufferPointer
        let offset: Int64
        let capacity: Int
        var count = 0
    }

    let events: AsyncThrowingStream<Event, Error>
    private let continuation: AsyncThrowingStream<Event, Error>.Continuation
    private let fd: SystemPackage.FileDescriptor
    private let window: Int
    private let limiter: RateLimiter?
    private let frontier: HashFrontier?
    private let unbuffered: String?
    /// What the writer leaves out of the partial file, with `unbuffered`.
    private let leaving: LeftOutRanges?
    private let pool: PieceBufferPool
    private let state: NIOLockedValueBox<State>

    /// `limiter`, the fetcher's bandwidth cap, is applied here by not reading the socket ahead of
    /// it, so that TCP slows the sender down.
    /// `frontier`: how far the fetcher has hashed the file, for ``WriteBehind`` (nil: pages are
    /// written back early but kept). `unbuffered`: the partial file's path, to write the body
    /// around the page cache as ``DirectBodyReader`` does (see there), with buffers from `pool`,
    /// leaving out the blocks `leaving` names.
    init(
        fd: SystemPackage.FileDescriptor, window: Int = 8 << 20, limiter: RateLimiter? = nil, frontier: HashFrontier? = nil,
        unbuffered: String? = nil, leaving: LeftOutRanges? = nil, pool: PieceBufferPool = .shared
    ) {
        self.fd = fd
        self.frontier = frontier
        self.unbuffered = unbuffered
        self.leaving = leaving
        self.pool = pool
        self.window = window
        self.limiter = limiter
        state = NIOLockedValueBox(State(pacing: BodyPacing(limiter: limiter)))
        (events, continuation) = AsyncThrowingStream.makeStream(of: Event.self)
    }

    func didReceiveHead(task: HTTPClient.Task<Void>, _ head: HTTPResponseHead) -> EventLoopFuture<Void> {
        let promise = task.eventLoop.makePromise(of: Void.self)
        state.withLockedValue { $0.waitingForHead = promise }
        continuation.yield(.head(head))
        return promise.futureResult
    }

    /// Called by the fetcher once it has read the head.
    func proceed(_ disposition: Disposition) {
        let promise = state.withLockedValue { state -> EventLoopPromise<Void>? in
            state.disposition = disposition
            if case .write(let from, let to) = disposition {
                state.position = from
                state.end = to
                state.pacing = BodyPacing(limiter: limiter, behind: WriteBehind(fd: fd.rawValue, from: from, frontier: frontier))
                if let path = unbuffered {
                    // Weak: pieces waiting in `events` hold the writer, and through it this closure.
                    state.writer = UnbufferedWriter(path: path, plain: fd, pool: pool, leaving: leaving) { [weak self] piece in self?.handOver(piece) }
                    state.written = from
                }
            }
            defer { state.waitingForHead = nil }
            return state.waitingForHead
        }
        promise?.succeed()
    }

    func didReceiveBodyPart(task: HTTPClient.Task<Void>, _ buffer: ByteBuffer) -> EventLoopFuture<Void> {
        let eventLoop = task.eventLoop
        let (disposition, position, end) = state.withLockedValue { ($0.disposition, $0.position, $0.end) }
        guard case .write = disposition else {
            state.withLockedValue { state in
                var collected = state.collected ?? ByteBuffer()
                guard collected.readableBytes < BodyPacing.collectLimit else { return }
                var part = buffer
                collected.writeBuffer(&part)
                state.collected = collected
            }
            return eventLoop.makeSucceededVoidFuture()
        }
        if let writer = state.withLockedValue({ $0.writer }) { return fill(buffer, writer: writer, eventLoop: eventLoop) }
        let count = buffer.readableBytes
        do {
            try buffer.withUnsafeReadableBytes { bytes throws(FetchError) in try BodyPacing.write(bytes, to: fd, at: position, end: end) }
        } catch {
            return eventLoop.makeFailedFuture(error)
        }
        let (wait, next) = state.withLockedValue { state -> (EventLoopPromise<Void>?, BodyPacing.Next) in
            state.position += Int64(count)
            state.outstanding += count
            var promise: EventLoopPromise<Void>?
            if state.outstanding >= window {
                promise = eventLoop.makePromise(of: Void.self)
                state.waitingForWindow = promise
            }
            return (promise, state.pacing.wrote(count, at: position, windowFull: promise != nil))
        }
        next.work?.run()
        if let batch = next.batch { continuation.yield(.body(count: batch.count, offset: batch.offset)) }
        let windowOpen = wait?.futureResult ?? eventLoop.makeSucceededVoidFuture()
        guard let due = next.due, due > .now() else { return windowOpen }
        return windowOpen.flatMap { eventLoop.scheduleTask(deadline: due) {}.futureResult }
    }

    /// Copies `part` into the writer's buffers, queueing each one filled; when none is free, the
    /// returned future (which holds the next read back) completes once the rest is copied.
    private func fill(_ part: ByteBuffer, writer: UnbufferedWriter, eventLoop: any EventLoop) -> EventLoopFuture<Void> {
        var part = part
        while part.readableBytes > 0 {
            var (filling, position, end) = state.withLockedValue { ($0.filling, $0.position, $0.end) }
            if filling == nil {
                guard let (slot, buffer) = writer.tryAcquire() else {
                    if let stopped = writer.stopped { return eventLoop.makeFailedFuture(stopped) }
                    let promise = eventLoop.makePromise(of: Void.self)
                    writer.whenFree { [self, part] in eventLoop.execute { self.fill(part, writer: writer, eventLoop: eventLoop).cascade(to: promise) } }
                    return promise.futureResult
                }
                filling = Filling(slot: slot, buffer: buffer, offset: position, capacity: UnbufferedWriter.capacity(at: position, end: end))
            }
            guard var piece = filling else { break }
            let take = min(part.readableBytes, piece.capacity - piece.count)
            guard position + Int64(take) <= end, take > 0 else {
                state.withLockedValue { $0.filling = piece }
                return eventLoop.makeFailedFuture(BodyPacing.pastEnd(end))
            }
            part.readWithUnsafeReadableBytes { bytes in
                UnsafeMutableRawBufferPointer(rebasing: piece.buffer[piece.count..<(piece.count + take)]).copyMemory(
                    from: UnsafeRawBufferPointer(rebasing: bytes[0..<take]))
                return take
            }
            piece.count += take
            let full = piece.count == piece.capacity
            if full { writer.submit(slot: piece.slot, offset: piece.offset, count: piece.count) }
            state.withLockedValue { state in
                state.position += Int64(take)
                state.filling = full ? nil : piece
            }
        }
        return eventLoop.makeSucceededVoidFuture()
    }

    /// A piece is on disk: the journal may record it, and the fetcher hashes it.
    private func handOver(_ piece: UnbufferedWriter.Piece) {
        state.withLockedValue { $0.written = piece.offset + Int64(piece.count) }
        continuation.yield(.piece(piece))
    }

    /// Queues the piece being filled, if any, and ends the writer; `then` runs once every piece
    /// has been handed over, with the write's failure. Nil without a writer.
    private func finishWriting(then body: @escaping @Sendable (FetchError?) -> Void) -> Bool {
        let (writer, filling) = state.withLockedValue { state in
            defer { state.filling = nil }
            return (state.writer, state.filling)
        }
        guard let writer else { return false }
        if let filling { writer.submit(slot: filling.slot, offset: filling.offset, count: filling.count) }
        writer.finish(then: body)
        return true
    }

    /// Where the body written so far ends (parts not yet handled by the fetcher included).
    var writtenThrough: Int64 { state.withLockedValue { $0.writer == nil ? $0.position : $0.written } }

    /// Called by the fetcher when it has handled `count` bytes: reading resumes below half the window.
    func consumed(_ count: Int) {
        let promise = state.withLockedValue { state -> EventLoopPromise<Void>? in
            state.outstanding -= count
            guard state.outstanding < window / 2 else { return nil }
            defer { state.waitingForWindow = nil }
            return state.waitingForWindow
        }
        promise?.succeed()
    }

    func didReceiveError(task: HTTPClient.Task<Void>, _ error: Error) {
        // What came is written and handed over before the error, so the journal can keep it.
        if finishWriting(then: { [continuation] _ in continuation.finish(throwing: error) }) { return }
        // What is on disk is reported before the error, so the journal can keep it.
        if let batch = state.withLockedValue({ $0.pacing.takePending() }) { continuation.yield(.body(count: batch.count, offset: batch.offset)) }
        continuation.finish(throwing: error)
    }

    func didFinishRequest(task: HTTPClient.Task<Void>) throws {
        let ended = finishWriting { [continuation] failure in
            if let failure {
                continuation.finish(throwing: failure)
            } else {
                continuation.yield(.end(collected: nil))
                continuation.finish()
            }
        }
        if ended { return }
        let (batch, collected) = state.withLockedValue { ($0.pacing.takePending(), $0.collected) }
        if let batch { continuation.yield(.body(count: batch.count, offset: batch.offset)) }
        continuation.yield(.end(collected: collected))
        continuation.finish()
    }

    /// The fetcher is done with this response, or gave up on it: nothing waits any more.
    func close() {
        state.withLockedValue { $0.writer }?.cancel()
        let promises = state.withLockedValue { state -> [EventLoopPromise<Void>] in
            defer {
                state.waitingForHead = nil
                state.waitingForWindow = nil
            }
            return [state.waitingForHead, state.waitingForWindow].compactMap { $0 }
        }
        for promise in promises { promise.fail(CancellationError()) }
        continuation.finish()
    }
}

/// The rules both body sources (``BodyReceiver``, ``DirectBodyReader``) apply to each piece of a
/// body: it stays within the bytes asked for, is written at its offset, is paced to the rate
/// limit, reaches the fetcher in batches, and its pages are let go behind the hash
/// (``WriteBehind``).
struct BodyPacing {
    /// Bytes are handed to the fetcher in batches of about this many: each hand-over is a hop to
    /// the fetcher actor, and per 64 KiB part those hops cost a third as much CPU as the SHA-256
    /// itself (docs/performance.md). Small enough for progress and pause to stay prompt.
    static let batch = 512 << 10
    /// Of an error response (`.collect`), this much of the body is kept.
    static let collectLimit = 64 << 10

    /// What to do after a piece is written.
    struct Next {
        /// When reading may go on under the rate limit (nil: no limit).
        let due: NIODeadline?
        /// The bytes to hand to the fetcher now, if any.
        let batch: (count: Int, offset: Int64)?
        /// Page-cache work to run outside any lock, if any is due.
        let work: WriteBehind.Work?
    }

    /// The fetcher's bandwidth cap, or nil.
    let limiter: RateLimiter?
    private var behind: WriteBehind?
    /// Bytes written but not yet handed to the fetcher, from `pendingOffset`.
    private var pendingOffset: Int64 = 0
    private var pendingBytes = 0

    /// `behind`: the body's write-behind (nil until the body's place in the file is known).
    init(limiter: RateLimiter?, behind: WriteBehind? = nil) {
        self.limiter = limiter
        self.behind = behind
    }

    /// Writes `bytes` at `position` of `fd`, refusing bytes past `end` (exclusive).
    static func write(_ bytes: UnsafeRawBufferPointer, to fd: SystemPackage.FileDescriptor, at position: Int64, end: Int64) throws(FetchError) {
        guard position + Int64(bytes.count) <= end else { throw pastEnd(end) }
        do {
            _ = try fd.writeAll(toAbsoluteOffset: position, bytes)
        } catch {
            throw cannotWrite("\(error)")
        }
    }

    /// The server sent bytes past `end`, the range asked for.
    static func pastEnd(_ end: Int64) -> FetchError {
        FetchError(.network, "the server sent more than the bytes asked for (up to byte \(end))")
    }

    /// The partial file refused a write, for `reason` (most often a full disk).
    static func cannotWrite(_ reason: String) -> FetchError {
        FetchError(.install, "cannot write the partial download: \(reason); free disk space and run again")
    }

    /// Records `count` bytes written at `position`. Returns when reading may go on under the rate
    /// limit, the bytes to hand over now (a full batch, and always before reading waits,
    /// `windowFull` or the rate, since the fetcher can only consume what it was given and progress
    /// should not stall while the socket is not read), and the write-behind's work.
    mutating func wrote(_ count: Int, at position: Int64, windowFull: Bool) -> Next {
        if pendingBytes == 0 { pendingOffset = position }
        pendingBytes += count
        let due = limiter?.reserve(count)
        let waits = windowFull || due.map { $0 > .now() } == true
        let batch = pendingBytes >= Self.batch || waits ? takePending() : nil
        return Next(due: due, batch: batch, work: behind?.wrote(through: position + Int64(count)))
    }

    /// The bytes written and not yet handed over, if any; they count as handed over from now.
    mutating func takePending() -> (count: Int, offset: Int64)? {
        guard pendingBytes > 0 else { return nil }
        defer { pendingBytes = 0 }
        return (pendingBytes, pendingOffset)
    }
}

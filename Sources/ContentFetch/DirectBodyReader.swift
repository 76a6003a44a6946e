import Foundation
import IAPProtocol
import NIOCore
import NIOHTTP1
import Synchronization
import SystemPackage

#if canImport(Glibc)
    import Glibc
#endif

/// The body of one archive range request over plain HTTP, taken on a thread of its own with
/// blocking calls and put into the partial file at its offset: spliced from the socket where the
/// kernel can (``SocketSplice``), else read 256 KiB at a time and written, the way curl does; the
/// fetcher gets the same events as from ``BodyReceiver``.
///
/// Written by hand because the library cannot reach the goal here: AsyncHTTPClient reads the
/// socket 64 KiB at a time (its channels keep NIO's default receive allocator, and it offers no
/// option), and every read then passes its HTTP decoder, state machines and delegate: on one core
/// that cost as much CPU per GiB as curl's whole transfer, while SHA-256 needs the other core
/// (docs/performance.md, "The client's spread"). Only the common case comes here: `http://`,
/// a response with `Content-Length`, no redirect. Anything else is ``Unsupported`` before a
/// single body byte is taken, and the fetcher asks again through AsyncHTTPClient.
final class DirectBodyReader: Sendable {
    /// The response is one this reader leaves to AsyncHTTPClient (a redirect, no Content-Length).
    struct Unsupported: Error, CustomStringConvertible {
        let description: String
    }

    typealias Event = BodyReceiver.Event

    private struct State {
        var disposition: BodyReceiver.Disposition?
        var position: Int64 = 0
        var outstanding = 0
        var waiting = false
        var cancelled = false
        var socket: Int32 = -1
        var writer: UnbufferedWriter?
        /// The body's end, told once the thread has closed its descriptors.
        var end: Event?
    }

    let events: AsyncThrowingStream<Event, Error>
    private let continuation: AsyncThrowingStream<Event, Error>.Continuation
    /// The partial file, as the fetcher holds it; the thread writes through a duplicate it closes
    /// itself: it may finish a last write after the fetcher gave up on it and closed its own
    /// descriptor, and must not write into whatever file reused that number.
    private let file: SystemPackage.FileDescriptor
    private let window: Int
    private let limiter: RateLimiter?
    private let stallTimeout: Duration
    private let frontier: HashFrontier?
    /// The partial file's path, when the body is to be written around the page cache.
    private let unbuffered: String?
    /// What the writer leaves out of the partial file, with `unbuffered`.
    private let leaving: LeftOutRanges?
    private let pool: PieceBufferPool
    private let state = Mutex(State())
    /// The reader thread sleeps on this while it waits for the fetcher (the head's disposition,
    /// a window below half, the rate limit's next slot); every change it may wait for signals it.
    private let wake = DispatchSemaphore(value: 0)
    /// Bytes read per call: few enough calls that their cost vanishes, and a buffer that stays in
    /// the core's cache between the read that fills it and the write that empties it.
    static let readSize = 256 << 10
    /// A response head larger than this is refused (a hostile or broken server).
    static let maximumHead = 64 << 10

    /// `frontier`: how far the fetcher has hashed the file, for ``WriteBehind`` (nil: pages are
    /// written back early but kept). `unbuffered`: the partial file's path, to write the body
    /// around the page cache (``UnbufferedWriter``) where the file system can; the fetcher then
    /// gets ``BodyReceiver/Event/piece(_:)`` events, which it hashes; `leaving`: the blocks it then
    /// leaves out of the file (``LeftOutRanges``). `pool`: where the buffers
    /// come from (the process's, shared by the downloads running).
    init(
        fd: SystemPackage.FileDescriptor, window: Int, limiter: RateLimiter?, stallTimeout: Duration, frontier: HashFrontier? = nil,
        unbuffered: String? = nil, leaving: LeftOutRanges? = nil, pool: PieceBufferPool = .shared
    ) {
        file = fd
        self.frontier = frontier
        self.unbuffered = unbuffered
        self.leaving = leaving
        self.pool = pool
        self.window = window
        self.limiter = limiter
        self.stallTimeout = stallTimeout
        (events, continuation) = AsyncThrowingStream.makeStream(of: Event.self)
    }

    /// Whether `url` is one this reader can fetch.
    static func handles(_ url: String) -> Bool {
        guard let components = URLComponents(string: url), components.scheme?.lowercased() == "http", let host = components.host else { return false }
        return !host.isEmpty && components.user == nil
    }

    /// Starts the request on a new thread; events follow on `events`.
    func start(url: String, headers: [(String, String)]) {
        let own: SystemPackage.FileDescriptor
        do {
            own = try file.duplicate()
        } catch {
            continuation.finish(throwing: FetchError(.install, "cannot open the partial download again: \(error)"))
            return
        }
        Thread.detachNewThread { [self] in
            var failure: Error?
            do { try run(url: url, headers: headers, fd: own) } catch { failure = error }
            // Closed before the end is told: a fetcher that then deletes the partial file frees
            // its blocks only once no descriptor holds it, and a download waiting for that space
            // looked at the disk too early (refused with the file's size missing from it).
            let end = state.withLock { state in
                if state.socket >= 0 { Glibc.close(state.socket) }
                state.socket = -1
                defer { state.end = nil }
                return state.end
            }
            try? own.close()
            if let end { continuation.yield(end) }
            if let failure { continuation.finish(throwing: failure) } else { continuation.finish() }
        }
    }

    /// Called by the fetcher once it has read the head.
    func proceed(_ disposition: BodyReceiver.Disposition) {
        state.withLock { state in
            state.disposition = disposition
            if case .write(let from, _) = disposition { state.position = from }
        }
        wake.signal()
    }

    /// Where the body written so far ends.
    var writtenThrough: Int64 { state.withLock { $0.position } }

    /// Called by the fetcher when it has handled `count` bytes.
    func consumed(_ count: Int) {
        let signal = state.withLock { state -> Bool in
            state.outstanding -= count
            return state.waiting && state.outstanding < window / 2
        }
        if signal { wake.signal() }
    }

    /// The fetcher is done with this response, or gave up on it: the thread stops at once.
    func close() {
        state.withLock { state in
            state.cancelled = true
            // Wakes a blocking read or connect; the thread closes the descriptor itself.
            if state.socket >= 0 { shutdown(state.socket, Int32(SHUT_RDWR)) }
            state.writer?.cancel()
        }
        wake.signal()
        continuation.finish()
    }

    // MARK: - The reader thread

    private func run(url: String, headers: [(String, String)], fd: SystemPackage.FileDescriptor) throws {
        guard let components = URLComponents(string: url), let named = components.host else {
            throw Unsupported(description: "not an http URL")
        }
        let host = URLHost.bare(named)
        let port = components.port ?? 80
        let socket = try connect(host: host, port: port)
        var target = components.percentEncodedPath.isEmpty ? "/" : components.percentEncodedPath
        if let query = components.percentEncodedQuery { target += "?" + query }
        var request = "GET \(target) HTTP/1.1\r\nHost: \(URLHost.inURL(host))\(components.port.map { ":\($0)" } ?? "")\r\n"
        for (name, value) in headers { request += "\(name): \(value)\r\n" }
        request += "Connection: close\r\n\r\n"
        try send(Array(request.utf8), on: socket)

        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: Self.readSize, alignment: 4096)
        defer { buffer.deallocate() }
        var filled = 0
        var headEnd: Int?
        while headEnd == nil {
            guard filled < Self.maximumHead else { throw FetchError(.network, "the server's response head is over \(Self.maximumHead) bytes") }
            let n = try read(socket, into: UnsafeMutableRawBufferPointer(rebasing: buffer[filled..<Self.maximumHead]))
            guard n > 0 else { throw FetchError(.network, "the server closed the connection before its response head") }
            filled += n
            headEnd = Self.endOfHead(UnsafeRawBufferPointer(rebasing: buffer[0..<filled]))
        }
        let head = try Self.parseHead(UnsafeRawBufferPointer(rebasing: buffer[0..<headEnd!]))
        if (300..<400).contains(head.status.code) { throw Unsupported(description: "a redirect") }
        guard head.headers["transfer-encoding"].isEmpty, let length = try Self.contentLength(head.headers) else {
            throw Unsupported(description: "no Content-Length")
        }

        continuation.yield(.head(head))
        guard let disposition = waitForDisposition() else { return }
        var remaining = length
        // What followed the head in the first reads.
        var leftover = filled - headEnd!
        if leftover > 0 { buffer.copyMemory(from: UnsafeRawBufferPointer(rebasing: buffer[headEnd!..<filled])) }
        switch disposition {
        case .collect:
            var collected = ByteBuffer()
            while remaining > 0 {
                if leftover == 0 {
                    leftover = try read(socket, into: UnsafeMutableRawBufferPointer(rebasing: buffer[0..<Int(min(Int64(buffer.count), remaining))]))
                    guard leftover > 0 else { return }
                }
                let take = min(Int64(leftover), remaining)
                if collected.readableBytes < BodyPacing.collectLimit { collected.writeBytes(UnsafeRawBufferPointer(rebasing: buffer[0..<Int(take)])) }
                remaining -= take
                leftover = 0
            }
            state.withLock { $0.end = .end(collected: collected) }
        case .write(let from, let to):
            if let path = unbuffered, let writer = unbufferedWriter(path: path, fd: fd) {
                try receiveUnbuffered(from: socket, into: writer, leftover: UnsafeRawBufferPointer(rebasing: buffer[0..<leftover]), from: from, to: to)
                return
            }
            var position = from
            var pacing = BodyPacing(limiter: limiter, behind: WriteBehind(fd: fd.rawValue, from: from, frontier: frontier))
            // Through a pipe straight into the file where the kernel can (one copy, not two).
            var splice = SocketSplice()
            // What is on disk is reported before the reading ends, so the journal can keep it.
            func handOver() {
                if let batch = pacing.takePending() { continuation.yield(.body(count: batch.count, offset: batch.offset)) }
            }
            defer { handOver() }
            while remaining > 0 {
                let count: Int
                if leftover > 0 {
                    count = Int(min(Int64(leftover), remaining))
                    leftover = 0
                    try BodyPacing.write(UnsafeRawBufferPointer(rebasing: buffer[0..<count]), to: fd, at: position, end: to)
                } else if let pipe = splice {
                    // Under a rate limit, the reader's own size keeps the pace as even as before.
                    let limit = Int(min(Int64(limiter == nil ? SocketSplice.size : Self.readSize), remaining))
                    switch try pipe.move(from: socket, to: fd, at: position, upTo: limit, end: to, buffer: buffer, socketError: socketError) {
                    case .bytes(let moved): count = moved
                    case .unsupported(let moved):
                        splice = nil
                        count = moved
                        if moved == 0 { continue }
                    }
                    // Closed early: the fetcher names the byte.
                    guard count > 0 else { return }
                } else {
                    count = try read(socket, into: UnsafeMutableRawBufferPointer(rebasing: buffer[0..<Int(min(Int64(buffer.count), remaining))]))
                    // Closed early: the fetcher names the byte.
                    guard count > 0 else { return }
                    try BodyPacing.write(UnsafeRawBufferPointer(rebasing: buffer[0..<count]), to: fd, at: position, end: to)
                }
                let full = state.withLock { state -> Bool in
                    state.position = position + Int64(count)
                    state.outstanding += count
                    return state.outstanding >= window
                }
                let next = pacing.wrote(count, at: position, windowFull: full)
                if let batch = next.batch { continuation.yield(.body(count: batch.count, offset: batch.offset)) }
                position += Int64(count)
                remaining -= Int64(count)
                next.work?.run()
                if full, !waitForWindow() { return }
                if let due = next.due, !sleep(until: due) { return }
            }
            handOver()
            state.withLock { $0.end = .end(collected: nil) }
        }
    }

    /// A writer for the body around the page cache, registered so that ``close()`` stops it;
    /// nil where the file system cannot, or when closed already.
    private func unbufferedWriter(path: String, fd: SystemPackage.FileDescriptor) -> UnbufferedWriter? {
        // Weak: pieces waiting in `events` hold the writer, and through it this closure.
        let writer = UnbufferedWriter(path: path, plain: fd, pool: pool, leaving: leaving) { [weak self] piece in
            guard let self else { return }
            // On disk now: the journal may record it.
            state.withLock { $0.position = piece.offset + Int64(piece.count) }
            continuation.yield(.piece(piece))
        }
        guard let writer else { return nil }
        let open = state.withLock { state -> Bool in
            guard !state.cancelled else { return false }
            state.writer = writer
            return true
        }
        if !open { writer.cancel() }
        return open ? writer : nil
    }

    /// Reads the body `[from, to)` into the writer's buffers, a piece at a time; the writer
    /// writes each and hands it to the fetcher. `leftover`: body bytes read with the head.
    private func receiveUnbuffered(
        from socket: Int32, into writer: UnbufferedWriter, leftover: UnsafeRawBufferPointer, from: Int64, to: Int64
    ) throws {
        defer {
            writer.cancel()
            state.withLock { $0.writer = nil }
        }
        var position = from
        var leftover = leftover
        var closed = false
        var failure: Error?
        while position < to, !closed, failure == nil, let (slot, piece) = writer.acquire() {
            let capacity = UnbufferedWriter.capacity(at: position, end: to)
            var filled = min(leftover.count, capacity)
            if filled > 0 {
                piece.copyMemory(from: UnsafeRawBufferPointer(rebasing: leftover[0..<filled]))
                leftover = UnsafeRawBufferPointer(rebasing: leftover[filled...])
            }
            do {
                while filled < capacity {
                    let n = try read(socket, into: UnsafeMutableRawBufferPointer(rebasing: piece[filled..<capacity]))
                    // Closed early: the fetcher names the byte.
                    guard n > 0 else {
                        closed = true
                        break
                    }
                    filled += n
                }
            } catch {
                // What arrived before the error is kept.
                failure = error
            }
            writer.submit(slot: slot, offset: position, count: filled)
            position += Int64(filled)
        }
        if let error = writer.finish() { throw error }
        if let failure { throw failure }
        if position == to { state.withLock { $0.end = .end(collected: nil) } }
    }

    private func waitForDisposition() -> BodyReceiver.Disposition? {
        while true {
            let (disposition, cancelled) = state.withLock { ($0.disposition, $0.cancelled) }
            if cancelled { return nil }
            if let disposition { return disposition }
            wake.wait()
        }
    }

    /// Waits until the fetcher has handled half the window; false when cancelled.
    private func waitForWindow() -> Bool {
        while true {
            let (open, cancelled) = state.withLock { state -> (Bool, Bool) in
                let open = state.outstanding < window / 2
                state.waiting = !open && !state.cancelled
                return (open, state.cancelled)
            }
            if cancelled { return false }
            if open { return true }
            wake.wait()
        }
    }

    /// Sleeps until `due` unless cancelled meanwhile (false then).
    private func sleep(until due: NIODeadline) -> Bool {
        while true {
            if state.withLock({ $0.cancelled }) { return false }
            let left = due - .now()
            guard left > .zero else { return true }
            _ = wake.wait(timeout: .now() + .nanoseconds(Int(left.nanoseconds)))
        }
    }

    private func connect(host: String, port: Int) throws -> Int32 {
        var hints = addrinfo()
        hints.ai_socktype = Int32(SOCK_STREAM.rawValue)
        hints.ai_family = AF_UNSPEC
        var list: UnsafeMutablePointer<addrinfo>?
        let status = getaddrinfo(host, String(port), &hints, &list)
        guard status == 0, let first = list else {
            throw Unreachable(reason: FetchError(.network, "cannot resolve \(host): \(String(cString: gai_strerror(status)))"))
        }
        defer { freeaddrinfo(first) }
        var lastError = ECONNREFUSED
        var candidate: UnsafeMutablePointer<addrinfo>? = first
        while let info = candidate {
            candidate = info.pointee.ai_next
            let socket = Glibc.socket(info.pointee.ai_family, info.pointee.ai_socktype, info.pointee.ai_protocol)
            guard socket >= 0 else {
                lastError = errno
                continue
            }
            let registered = state.withLock { state -> Bool in
                guard !state.cancelled else { return false }
                state.socket = socket
                return true
            }
            guard registered else {
                Glibc.close(socket)
                throw CancellationError()
            }
            // Linux applies the send timeout to connect as well: AsyncHTTPClient's 10 s.
            setTimeout(socket, SO_SNDTIMEO, .seconds(10))
            setTimeout(socket, SO_RCVTIMEO, stallTimeout)
            var one: Int32 = 1
            setsockopt(socket, Int32(IPPROTO_TCP), TCP_NODELAY, &one, socklen_t(MemoryLayout<Int32>.size))
            if Glibc.connect(socket, info.pointee.ai_addr, info.pointee.ai_addrlen) == 0 { return socket }
            lastError = errno
            state.withLock { state in
                Glibc.close(socket)
                state.socket = -1
            }
        }
        throw Unreachable(reason: FetchError(.network, "cannot connect to \(URLHost.inURL(host)):\(port): \(String(cString: strerror(lastError)))"))
    }

    private func setTimeout(_ socket: Int32, _ option: Int32, _ duration: Duration) {
        let (seconds, attoseconds) = duration.components
        var value = timeval(tv_sec: Int(seconds), tv_usec: Int(attoseconds / 1_000_000_000_000))
        setsockopt(socket, SOL_SOCKET, option, &value, socklen_t(MemoryLayout<timeval>.size))
    }

    private func send(_ bytes: [UInt8], on socket: Int32) throws {
        var sent = 0
        while sent < bytes.count {
            let n = bytes.withUnsafeBytes { Glibc.send(socket, $0.baseAddress! + sent, $0.count - sent, Int32(MSG_NOSIGNAL)) }
            if n < 0, errno == EINTR { continue }
            guard n > 0 else { throw socketError("send the request") }
            sent += n
        }
    }

    private func read(_ socket: Int32, into buffer: UnsafeMutableRawBufferPointer) throws -> Int {
        while true {
            let n = recv(socket, buffer.baseAddress, buffer.count, 0)
            if n >= 0 { return n }
            if errno == EINTR { continue }
            throw socketError("read")
        }
    }

    private func socketError(_ action: String) -> Error {
        let code = errno
        if state.withLock({ $0.cancelled }) { return CancellationError() }
        if code == EAGAIN || code == EWOULDBLOCK {
            return FetchError(.network, "no byte arrived for \(stallTimeout.components.seconds) s; the download will be retried")
        }
        return FetchError(.network, "cannot \(action): \(String(cString: strerror(code)))")
    }

    /// Where the head ends (after its blank line), if it has.
    static func endOfHead(_ bytes: UnsafeRawBufferPointer) -> Int? {
        guard bytes.count >= 4 else { return nil }
        for i in 3..<bytes.count where bytes[i] == 10 && bytes[i - 1] == 13 && bytes[i - 2] == 10 && bytes[i - 3] == 13 {
            return i + 1
        }
        return nil
    }

    /// The status line and header fields of an HTTP/1.1 response head.
    ///
    /// Strict where a lenient reading could frame the body differently from a proxy in between
    /// (RFC 9112 §5): a field name must be a token (no space before the colon, no folded line),
    /// and a line may hold no bare CR, LF or NUL. Such a head is refused, not guessed at.
    static func parseHead(_ bytes: UnsafeRawBufferPointer) throws -> HTTPResponseHead {
        guard let text = String(bytes: bytes, encoding: .isoLatin1) else { throw FetchError(.network, "the server's response head is not text") }
        var lines = text.components(separatedBy: "\r\n")
        let statusLine = lines.removeFirst().split(separator: " ", maxSplits: 2, omittingEmptySubsequences: false)
        guard statusLine.count >= 2, statusLine[0].hasPrefix("HTTP/1."), statusLine[1].utf8.count == 3, statusLine[1].utf8.allSatisfy(isDigit),
            let code = Int(statusLine[1]), (100..<600).contains(code)
        else {
            throw FetchError(.network, "the server's answer is not an HTTP/1.1 response")
        }
        var headers = HTTPHeaders()
        for line in lines where !line.isEmpty {
            guard let colon = line.firstIndex(of: ":"), colon != line.startIndex, line[..<colon].utf8.allSatisfy(isToken),
                !line.utf8.contains(where: { $0 == 13 || $0 == 10 || $0 == 0 })
            else {
                throw FetchError(.network, "the server sent a malformed header line")
            }
            headers.add(name: String(line[..<colon]), value: line[line.index(after: colon)...].trimmingCharacters(in: .whitespaces))
        }
        return HTTPResponseHead(version: statusLine[0] == "HTTP/1.0" ? .http1_0 : .http1_1, status: .init(statusCode: code), headers: headers)
    }

    /// The body's length from `Content-Length`, nil when there is none. Several values (fields
    /// or a list) must all be the same run of digits (RFC 9110 §8.6); anything else throws: a
    /// reader that took the first of two lengths would frame the body as nobody else does.
    static func contentLength(_ headers: HTTPHeaders) throws(FetchError) -> Int64? {
        let values = headers["content-length"].flatMap { $0.split(separator: ",", omittingEmptySubsequences: false) }
            .map { $0.trimmingCharacters(in: .whitespaces) }
        guard let first = values.first else { return nil }
        guard values.allSatisfy({ $0 == first }), !first.isEmpty, first.utf8.allSatisfy(isDigit), let length = Int64(first)
        else {
            throw FetchError(.network, "the server sent a Content-Length that is not one whole number ('\(values.joined(separator: ", ").prefix(80))')")
        }
        return length
    }

    private static func isDigit(_ byte: UInt8) -> Bool { byte >= 0x30 && byte <= 0x39 }

    /// RFC 9110 §5.6.2 `tchar`.
    private static func isToken(_ byte: UInt8) -> Bool {
        switch byte {
        case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "0")...UInt8(ascii: "9"): true
        default: "!#$%&'*+-.^_`|~".utf8.contains(byte)
        }
    }
}

import AsyncHTTPClient
import Foundation
import IAPTestSupport
import NIOHTTP1
import Synchronization
import SystemPackage
import Testing

@testable import ContentFetch

/// A server on 127.0.0.1 that answers every connection with scripted bytes after reading the
/// request head: what a broken or hostile server sends, byte for byte.
final class ScriptedServer: @unchecked Sendable {
    let port: Int
    private let listener: Int32
    private final class Log: Sendable {
        /// The request heads received, in order.
        let requests = Mutex<[String]>([])
        /// Connections the client has closed (seen while stalling) or that were answered.
        let closed = Mutex(0)
    }
    private let log = Log()

    /// `answer` is sent on each connection; with `stall`, the connection then stays open silent.
    init(answer: [UInt8], stall: Bool = false) throws {
        let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        self.listener = listener
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(listener, $0, length) == 0 && listen(listener, 8) == 0 && getsockname(listener, $0, &length) == 0 }
        }
        guard bound else { throw POSIXError(.EADDRINUSE) }
        port = Int(UInt16(bigEndian: address.sin_port))
        Thread.detachNewThread { [log] in
            while true {
                let connection = accept(listener, nil, nil)
                guard connection >= 0 else { return }
                var head = [UInt8]()
                var byte: UInt8 = 0
                while !head.reversed().starts(with: [10, 13, 10, 13]), recv(connection, &byte, 1, 0) == 1 { head.append(byte) }
                log.requests.withLock { $0.append(String(decoding: head, as: UTF8.self)) }
                _ = answer.withUnsafeBytes { send(connection, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
                if stall {
                    // Held open without a byte until the client gives up.
                    while recv(connection, &byte, 1, 0) > 0 {}
                }
                close(connection)
                log.closed.withLock { $0 += 1 }
            }
        }
    }

    var url: String { "http://127.0.0.1:\(port)/v1/archives/x.zip?token=abc" }
    var received: [String] { log.requests.withLock { $0 } }
    var closedConnections: Int { log.closed.withLock { $0 } }

    deinit {
        shutdown(listener, Int32(SHUT_RDWR))
        close(listener)
    }
}

@Suite("DirectBodyReader against scripted servers", .onTestThreads)
struct DirectBodyReaderTests {
    struct Outcome {
        var status: UInt?
        var written: Int64 = 0
        var ended = false
        var error: Error?
        /// Pieces written around the page cache: where each starts, and its bytes as handed over.
        var pieces: [(offset: Int64, bytes: [UInt8])] = []
    }

    /// Runs one request against `server`, writing the body from `from` into `file`.
    /// With `closeEarly`, the caller's descriptor is closed as soon as the reader has started.
    /// With `unbuffered`, the body is written around the page cache where the file system can.
    func run(
        _ server: ScriptedServer, file: String, from: Int64 = 0, to: Int64, stall: Duration = .seconds(30), closeEarly: Bool = false,
        unbuffered: Bool = false
    ) async -> Outcome {
        guard let fd = try? FileDescriptor.open(file, .readWrite, options: [.create], permissions: .ownerReadWrite) else { return Outcome() }
        defer { if !closeEarly { try? fd.close() } }
        let reader = DirectBodyReader(fd: fd, window: 1 << 20, limiter: nil, stallTimeout: stall, unbuffered: unbuffered ? file : nil, pool: PieceBufferPool(limit: UnbufferedWriter.pieces))
        reader.start(url: server.url, headers: [("Range", "bytes=\(from)-\(to - 1)")])
        if closeEarly { try? fd.close() }
        defer { reader.close() }
        var outcome = Outcome()
        do {
            for try await event in reader.events {
                switch event {
                case .head(let head):
                    outcome.status = head.status.code
                    reader.proceed(.write(from: from, to: to))
                case .body(let count, _):
                    outcome.written += Int64(count)
                    reader.consumed(count)
                case .piece(let piece):
                    outcome.written += Int64(piece.count)
                    outcome.pieces.append((piece.offset, Array(piece.bytes)))
                    piece.release()
                case .end:
                    outcome.ended = true
                }
            }
        } catch {
            outcome.error = error
        }
        return outcome
    }

    func response(_ head: String, body: [UInt8] = []) -> [UInt8] { Array(head.replacingOccurrences(of: "\n", with: "\r\n").utf8) + body }

    @Test("a 206 with Content-Length is written at its offset, with the request's target, Host and Range")
    func partialContent() async throws {
        let tmp = try TemporaryFolder()
        let body = (0..<700_000).map { UInt8(truncatingIfNeeded: $0 &* 31) }
        let server = try ScriptedServer(answer: response("HTTP/1.1 206 Partial Content\nContent-Range: bytes 100-700099/800000\nContent-Length: 700000\n\n", body: body))
        let file = tmp.sub("partial")
        let outcome = await run(server, file: file, from: 100, to: 700_100)
        #expect(outcome.status == 206 && outcome.ended && outcome.written == 700_000 && outcome.error == nil)
        let written = try Data(contentsOf: URL(fileURLWithPath: file))
        #expect(written.count == 700_100 && Array(written[100...]) == body)
        // The reader writes through a descriptor of its own: the caller closing its own (as the
        // fetcher does when it gives up on a response) does not stop or misdirect a write.
        let again = await run(server, file: tmp.sub("closed-early"), from: 100, to: 700_100, closeEarly: true)
        #expect(again.ended && again.written == 700_000)
        #expect(try Array(Data(contentsOf: URL(fileURLWithPath: tmp.sub("closed-early")))[100...]) == body)
        let request = try #require(server.received.first)
        #expect(request.hasPrefix("GET /v1/archives/x.zip?token=abc HTTP/1.1\r\n"))
        #expect(request.contains("Host: 127.0.0.1:\(server.port)\r\n") && request.contains("Range: bytes=100-700099\r\n"))
    }

    @Test(
        "written around the page cache: pieces from an unaligned start, every later one on a block boundary, handed over as written; an early close keeps what came; on tmpfs too"
    )
    func unbufferedPieces() async throws {
        let tmp = try TemporaryFolder(onDisk: ())
        let size = 9_500_000
        let body = (0..<size).map { UInt8(truncatingIfNeeded: $0 &* 131 &+ $0 >> 13) }
        let server = try ScriptedServer(
            answer: response("HTTP/1.1 206 Partial Content\nContent-Range: bytes 1000-\(size + 999)/\(size + 1000)\nContent-Length: \(size)\n\n", body: body))
        let file = tmp.sub("unbuffered")
        try Data(repeating: 0xee, count: 1000).write(to: URL(fileURLWithPath: file))
        let outcome = await run(server, file: file, from: 1000, to: Int64(size) + 1000, unbuffered: true)
        #expect(outcome.ended && outcome.error == nil && outcome.written == Int64(size))
        let pieces = outcome.pieces
        try #require(pieces.count == 3, "4 MiB pieces, the first cut short to end on a block boundary")
        #expect(pieces.map(\.offset) == [1000, 4 << 20, 8 << 20])
        #expect(pieces.flatMap(\.bytes) == body, "the pieces hold the body, in order")
        let written = try Data(contentsOf: URL(fileURLWithPath: file))
        #expect(written.count == size + 1000 && written.prefix(1000).allSatisfy { $0 == 0xee } && Array(written[1000...]) == body)

        // Half the body, then the connection closes: what came is written and handed over, no end.
        let short = try ScriptedServer(answer: response("HTTP/1.1 200 OK\nContent-Length: 6000000\n\n", body: Array(body[0..<5_000_000])))
        let shortOutcome = await run(short, file: tmp.sub("short"), to: 6_000_000, unbuffered: true)
        #expect(shortOutcome.written == 5_000_000 && !shortOutcome.ended && shortOutcome.error == nil && !shortOutcome.pieces.isEmpty)
        #expect(try Data(contentsOf: URL(fileURLWithPath: tmp.sub("short"))) == Data(body[0..<5_000_000]))

        // tmpfs, which takes unbuffered writes since Linux 6.6 (before, the body goes through the
        // page cache): the same bytes either way.
        let shm = try TemporaryFolder(in: "/dev/shm")
        let fallback = await run(server, file: shm.sub("partial"), from: 1000, to: Int64(size) + 1000, unbuffered: true)
        #expect(fallback.ended && fallback.written == Int64(size))
        #expect(try Array(Data(contentsOf: URL(fileURLWithPath: shm.sub("partial")))[1000...]) == body)
    }

    @Test("a redirect or a body without Content-Length is left to AsyncHTTPClient before a byte is written")
    func unsupported() async throws {
        let tmp = try TemporaryFolder()
        for head in ["HTTP/1.1 302 Found\nLocation: http://127.0.0.1:1/elsewhere\nContent-Length: 0\n\n", "HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n5\r\nhello\r\n0\r\n\r\n"] {
            let server = try ScriptedServer(answer: response(head))
            let outcome = await run(server, file: tmp.sub("unsupported"), to: 10)
            #expect(outcome.error is DirectBodyReader.Unsupported, "\(head)")
            #expect(outcome.status == nil && outcome.written == 0)
        }
    }

    @Test("a huge or malformed head, an early close and a silent server are network errors that name the problem")
    func badServers() async throws {
        let tmp = try TemporaryFolder()
        let huge = try ScriptedServer(answer: response("HTTP/1.1 200 OK\n" + String(repeating: "X-Padding: \(String(repeating: "a", count: 1000))\n", count: 80) + "\n"))
        let hugeOutcome = await run(huge, file: tmp.sub("a"), to: 10)
        #expect((hugeOutcome.error as? FetchError)?.message.contains("response head is over 65536 bytes") == true)

        let garbage = try ScriptedServer(answer: response("SSH-2.0-OpenSSH_9.6\n\n"))
        let garbageOutcome = await run(garbage, file: tmp.sub("b"), to: 10)
        #expect((garbageOutcome.error as? FetchError)?.message.contains("not an HTTP/1.1 response") == true)

        // Half the body, then the connection closes: the bytes are reported, no end.
        let short = try ScriptedServer(answer: response("HTTP/1.1 200 OK\nContent-Length: 1000\n\n", body: [UInt8](repeating: 7, count: 500)))
        let shortOutcome = await run(short, file: tmp.sub("c"), to: 1000)
        #expect(shortOutcome.status == 200 && shortOutcome.written == 500 && !shortOutcome.ended && shortOutcome.error == nil)

        let silent = try ScriptedServer(answer: response("HTTP/1.1 200 OK\nContent-Length: 1000\n\n", body: [1, 2, 3]), stall: true)
        let silentOutcome = await run(silent, file: tmp.sub("d"), to: 1000, stall: .seconds(1))
        #expect(silentOutcome.written == 3 && !silentOutcome.ended)
        #expect((silentOutcome.error as? FetchError)?.message.contains("no byte arrived for 1 s") == true)
    }

    /// The head as parsed, or the error's message.
    func parsed(_ head: String) -> Result<HTTPResponseHead, FetchError> {
        Array(head.utf8).withUnsafeBytes { bytes in
            do { return .success(try DirectBodyReader.parseHead(bytes)) } catch { return .failure(error as! FetchError) }
        }
    }

    @Test("a head that others could frame differently is refused: a field name that is not a token, a folded line, a bare LF or NUL, a status that is not three digits")
    func strictHeads() {
        let ok = parsed("HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\nX-Empty:\r\n\r\n")
        #expect((try? ok.get())?.status.code == 206 && (try? ok.get())?.headers["x-empty"] == [""])
        for bad in [
            "HTTP/1.1 200 OK\r\nContent-Length : 10\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX-A: b\r\n folded: c\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX-A: b\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX-A: b\u{0}c\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX(A): b\r\n\r\n",
        ] {
            guard case .failure(let error) = parsed(bad) else {
                Issue.record("accepted \(bad.debugDescription)")
                continue
            }
            #expect(error.message.contains("malformed header line"), "\(bad.debugDescription): \(error.message)")
        }
        for bad in ["HTTP/1.1 +20 OK\r\n\r\n", "HTTP/1.1 0200 OK\r\n\r\n", "HTTP/1.1 20 OK\r\n\r\n"] {
            guard case .failure(let error) = parsed(bad) else {
                Issue.record("accepted \(bad.debugDescription)")
                continue
            }
            #expect(error.message.contains("not an HTTP/1.1 response"), "\(bad.debugDescription)")
        }
    }

    @Test("Content-Length is one run of digits: the same value repeated is taken, differing or signed values are refused")
    func contentLengths() throws {
        func length(_ fields: [String]) -> Result<Int64?, FetchError> {
            var headers = HTTPHeaders()
            for value in fields { headers.add(name: "Content-Length", value: value) }
            return Result { () throws(FetchError) in try DirectBodyReader.contentLength(headers) }
        }
        #expect(try length([]).get() == nil)
        #expect(try length(["10"]).get() == 10)
        #expect(try length(["10", "10"]).get() == 10)
        #expect(try length(["10, 10"]).get() == 10)
        for bad in [["5", "7"], ["5, 7"], ["+5"], ["-1"], [""], ["0x10"], ["99999999999999999999"]] {
            guard case .failure(let error) = length(bad) else {
                Issue.record("accepted \(bad)")
                continue
            }
            #expect(error.message.contains("not one whole number"), "\(bad)")
        }
    }

    @Test("two different Content-Lengths from a server are a network error before a byte is written")
    func conflictingLengths() async throws {
        let tmp = try TemporaryFolder()
        let server = try ScriptedServer(answer: response("HTTP/1.1 200 OK\nContent-Length: 5\nContent-Length: 10\n\n", body: Array("0123456789".utf8)))
        let outcome = await run(server, file: tmp.sub("a"), to: 10)
        #expect(outcome.status == nil && outcome.written == 0)
        #expect((outcome.error as? FetchError)?.message.contains("Content-Length that is not one whole number ('5, 10')") == true, "\(String(describing: outcome.error))")
    }

    @Test("close() stops a read that waits on a silent server at once")
    func closeStopsRead() async throws {
        let tmp = try TemporaryFolder()
        let server = try ScriptedServer(answer: response("HTTP/1.1 200 OK\nContent-Length: 1000\n\n"), stall: true)
        let fd = try FileDescriptor.open(tmp.sub("e"), .readWrite, options: [.create], permissions: .ownerReadWrite)
        defer { try? fd.close() }
        let reader = DirectBodyReader(fd: fd, window: 1 << 20, limiter: nil, stallTimeout: .seconds(60))
        reader.start(url: server.url, headers: [])
        var iterator = reader.events.makeAsyncIterator()
        guard case .head = try await iterator.next() else {
            Issue.record("no head")
            return
        }
        reader.proceed(.write(from: 0, to: 1000))
        #expect(server.closedConnections == 0)
        reader.close()
        // The reader's thread shuts its socket down although the server never answers and the
        // stall timeout is a minute: the server sees the connection end.
        await waitUntil(.seconds(20)) { server.closedConnections > 0 }
        #expect(server.closedConnections == 1)
    }
}

@Suite("BodyReceiver writing around the page cache (HTTPS, redirects)", .onTestThreads)
struct BodyReceiverUnbufferedTests {
    /// Runs one request through AsyncHTTPClient and a receiver writing `[from, to)` of `file`
    /// around the page cache; pieces are given back four at a time, so that the receiver finds
    /// no free buffer and must wait for one.
    func run(_ server: ScriptedServer, file: String, from: Int64, to: Int64) async throws -> (pieces: [(offset: Int64, bytes: [UInt8])], ended: Bool, error: Error?) {
        let fd = try FileDescriptor.open(file, .readWrite, options: [.create], permissions: .ownerReadWrite)
        defer { try? fd.close() }
        // A pool of its own: the pieces held back below must not wait on other tests' downloads.
        let receiver = BodyReceiver(fd: fd, window: 1 << 20, unbuffered: file, pool: PieceBufferPool(limit: UnbufferedWriter.pieces))
        let client = HTTPClient(eventLoopGroupProvider: .singleton)
        let task = client.execute(request: try HTTPClient.Request(url: server.url), delegate: receiver)
        var pieces: [(offset: Int64, bytes: [UInt8])] = []
        var held: [UnbufferedWriter.Piece] = []
        var ended = false
        var failure: Error?
        do {
            for try await event in receiver.events {
                switch event {
                case .head: receiver.proceed(.write(from: from, to: to))
                case .piece(let piece):
                    pieces.append((piece.offset, Array(piece.bytes)))
                    held.append(piece)
                    if held.count == UnbufferedWriter.pieces {
                        for piece in held { piece.release() }
                        held = []
                    }
                case .body: Issue.record("a body went through the page cache")
                case .end: ended = true
                }
            }
        } catch {
            failure = error
        }
        for piece in held { piece.release() }
        receiver.close()
        _ = try? await task.futureResult.get()
        try await client.shutdown()
        return (pieces, ended, failure)
    }

    @Test("pieces from an unaligned start, in order, each written where it belongs, while the event loop waits for free buffers; a body cut short hands over what came, then fails")
    func pieces() async throws {
        let tmp = try TemporaryFolder(onDisk: ())
        let size = 21_000_000
        let body = (0..<size).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ $0 >> 11) }
        let server = try ScriptedServer(
            answer: Array("HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 1000-\(size + 999)/\(size + 1000)\r\nContent-Length: \(size)\r\n\r\n".utf8) + body)
        let file = tmp.sub("partial")
        try Data(repeating: 0xee, count: 1000).write(to: URL(fileURLWithPath: file))
        let outcome = try await run(server, file: file, from: 1000, to: Int64(size) + 1000)
        #expect(outcome.ended && outcome.error == nil)
        let offsets: [Int64] = [1000, 4 << 20, 8 << 20, 12 << 20, 16 << 20, 20 << 20]
        #expect(outcome.pieces.map(\.offset) == offsets, "six pieces: more than the four buffers")
        #expect(outcome.pieces.flatMap(\.bytes) == body)
        let written = try Data(contentsOf: URL(fileURLWithPath: file))
        #expect(written.count == size + 1000 && written.prefix(1000).allSatisfy { $0 == 0xee } && Array(written[1000...]) == body)

        let short = try ScriptedServer(answer: Array("HTTP/1.1 200 OK\r\nContent-Length: 12000000\r\n\r\n".utf8) + body[0..<10_000_000])
        let cut = try await run(short, file: tmp.sub("short"), from: 0, to: 12_000_000)
        #expect(!cut.ended && cut.error != nil)
        #expect(cut.pieces.flatMap(\.bytes) == Array(body[0..<10_000_000]), "what came is handed over before the error")
        #expect(try Data(contentsOf: URL(fileURLWithPath: tmp.sub("short"))) == Data(body[0..<10_000_000]))
    }
}

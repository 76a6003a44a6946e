import ContentArchive
import Foundation
import IAPProtocol
import IAPTestSupport
import SandboxStore
import Testing

/// Content requests are answered ahead of NIO's HTTP/1 decoder (`ContentFastPath`) until the
/// first request it does not take; these speak raw HTTP/1.1 over a socket to check the seams.
extension HardeningTests {
    static let rawClient = """
        import socket, sys

        port, path, archive = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], 'rb').read()
        failures = []

        def connect():
            s = socket.create_connection(('127.0.0.1', port))
            s.settimeout(10)
            return s, s.makefile('rb')

        def response(f, head_request=False):
            status = f.readline().decode()
            headers = {}
            while True:
                line = f.readline().decode()
                if line in ('\\r\\n', ''):
                    break
                name, _, value = line.partition(':')
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get('content-length', '0'))
            body = b'' if head_request else f.read(length)
            return status.split(' ')[0:2], headers, body

        def check(name, condition, detail=''):
            if not condition:
                failures.append(f'{name}: {detail}')

        def closed(f):
            try:
                return f.read(1) == b''
            except OSError:
                return True

        # Pipelined in one write: two content requests, an API request (hands the connection to
        # the decoder), then a content request answered behind it.
        s, f = connect()
        s.sendall((f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=0-9\\r\\n\\r\\n'
                   f'HEAD {path} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'
                   'GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'
                   f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nrAnGe: bytes=-5\\r\\nConnection: close\\r\\n\\r\\n').encode())
        (v, code), h, body = response(f)
        check('pipelined range', code == '206' and body == archive[0:10], f'{code} {body!r}')
        (v, code), h, body = response(f, head_request=True)
        check('pipelined HEAD', code == '200' and h.get('content-length') == str(len(archive)) and h.get('accept-ranges') == 'bytes', f'{code} {h}')
        (v, code), h, body = response(f)
        check('pipelined API request', code == '200', f'{code} {body!r}')
        (v, code), h, body = response(f)
        check('content after the hand-off', code == '206' and body == archive[-5:], f'{code} {body!r}')
        check('Connection: close', closed(f))
        s.close()

        # A GET with a body is left to the decoder, which reads and drops the body.
        s, f = connect()
        s.sendall((f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=10-19\\r\\nContent-Length: 5\\r\\n\\r\\nhello'
                   f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=20-29\\r\\nConnection: close\\r\\n\\r\\n').encode())
        (v, code), h, body = response(f)
        check('GET with a body', code == '206' and body == archive[10:20], f'{code} {body!r}')
        (v, code), h, body = response(f)
        check('the request after it', code == '206' and body == archive[20:30], f'{code} {body!r}')
        s.close()

        # HTTP/1.0 without keep-alive: answered in 1.0, then closed.
        s, f = connect()
        s.sendall(f'GET {path} HTTP/1.0\\r\\nRange: bytes=0-3\\r\\n\\r\\n'.encode())
        (v, code), h, body = response(f)
        check('HTTP/1.0', v == 'HTTP/1.0' and code == '206' and body == archive[0:4], f'{v} {code} {body!r}')
        check('HTTP/1.0 closes', closed(f))
        s.close()

        # The client closes its side after the request: the whole answer still arrives.
        s, f = connect()
        s.sendall(f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=100-199999\\r\\n\\r\\n'.encode())
        s.shutdown(socket.SHUT_WR)
        (v, code), h, body = response(f)
        check('half-closed client', code == '206' and body == archive[100:200000], f'{code} {len(body)}')
        check('closed after the answer', closed(f))
        s.close()

        # The same with small answers (flushed once the pass over ready connections is done),
        # two pipelined requests and the close arriving together.
        s, f = connect()
        s.sendall((f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=0-9\\r\\n\\r\\n'
                   f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=10-19\\r\\n\\r\\n').encode())
        s.shutdown(socket.SHUT_WR)
        answers = [response(f), response(f)]
        check('half-closed client, small answers', [(c, b) for (_, c), _, b in answers] == [('206', archive[0:10]), ('206', archive[10:20])], f'{answers!r}')
        check('closed after the small answers', closed(f))
        s.close()

        # A head over the limits goes to the decoder, which refuses it.
        s, f = connect()
        s.sendall((f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nX-Big: ' + 'a' * 20000 + '\\r\\n\\r\\n').encode())
        (v, code), h, body = response(f)
        check('oversized head', code in ('400', '431'), f'{code}')
        s.close()

        # Repeated and malformed fields are left to the decoder too, and still answered.
        s, f = connect()
        s.sendall(f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=0-1\\r\\nRange: bytes=2-3\\r\\nConnection: close\\r\\n\\r\\n'.encode())
        (v, code), h, body = response(f)
        check('repeated Range', code in ('200', '206'), f'{code}')
        s.close()

        print('\\n'.join(failures) if failures else 'ok')
        """

    /// Publishes `archive`, buys its product and returns the purchase and the granted download URL.
    /// The upload sends its body at once (no `Expect: 100-continue`, for which curl waits a second):
    /// a server with a short `--idle-timeout` would take that second for a body that stopped.
    func publishAndBuy(_ archive: PackResult, server: ServerProcess, store: SandboxStore, tmp: TemporaryFolder) throws -> (SandboxStore.Purchase, String) {
        let published = try multipart(server, tmp, ["archive=@\(archive.archivePath)"], headers: ["-H", "Expect:"])
        try #require(published.status == 201, "the upload was answered \(published.status): \(published.text) \(published.curlError)")
        let purchase = try store.purchase(productId: product)
        let grant = try postJSON(server.base + "/v1/downloads", ["signedTransaction": purchase.signedTransaction], folder: tmp)
        return (purchase, try #require((grant.json["downloads"] as? [[String: Any]])?.first?["url"] as? String))
    }

    @Test("content requests answered ahead of the decoder: pipelining, hand-off to the API, bodies, HTTP/1.0, half-close, limits")
    func fastPathSeams() throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp)
        let v1 = try pack(tmp, version: "1.0")
        let (_, url) = try publishAndBuy(v1, server: server, store: store, tmp: tmp)
        let path = String(url.dropFirst(server.base.count))
        let script = try tmp.write("raw.py", Self.rawClient)
        let result = try run("python3", [script, String(server.port), path, v1.archivePath])
        #expect(result.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "ok", "\(result.stdout) \(result.stderr)")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200, "the server is still up")
        #expect(server.stop() == 0)
    }

    static let revokedOnTheSameConnection = """
        import json, socket, sys, urllib.request

        port, path, refund = int(sys.argv[1]), sys.argv[2], open(sys.argv[3]).read()
        s = socket.create_connection(('127.0.0.1', port))
        s.settimeout(10)
        f = s.makefile('rb')

        def get():
            s.sendall(f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=0-9\\r\\n\\r\\n'.encode())
            code = f.readline().decode().split(' ')[1]
            length = 0
            while (line := f.readline().decode()) not in ('\\r\\n', ''):
                name, _, value = line.partition(':')
                if name.lower() == 'content-length':
                    length = int(value)
            return code, f.read(length)

        codes = [get()[0], get()[0]]
        request = urllib.request.Request(f'http://127.0.0.1:{port}/v1/notifications', data=json.dumps({'signedPayload': refund}).encode(),
                                         headers={'Content-Type': 'application/json'})
        codes.append(str(urllib.request.urlopen(request).status))
        code, body = get()
        codes.append(code)
        codes.append(json.loads(body)['error']['code'] if code == '403' else '-')
        print(' '.join(codes))
        """

    @Test("a refund cuts a download's kept-alive connection at its very next request")
    func refundOnAnOpenConnection() throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp)
        let v1 = try pack(tmp, version: "1.0")
        let (purchase, url) = try publishAndBuy(v1, server: server, store: store, tmp: tmp)
        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        let payload = try tmp.write("refund.jws", refund.signedPayload)
        let script = try tmp.write("revoked.py", Self.revokedOnTheSameConnection)
        let result = try run("python3", [script, String(server.port), String(url.dropFirst(server.base.count)), payload])
        #expect(result.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "206 206 200 403 revoked", "\(result.stdout) \(result.stderr)")
        #expect(server.stop() == 0)
    }

    @Test("metrics: every response is counted by status and bytes; only those over 64 KiB as transfers")
    func contentMetrics() throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp)
        // Random bytes, stored: an archive larger than the 100,000 bytes asked for below.
        let content = tmp.sub("large")
        try FileManager.default.createDirectory(atPath: content, withIntermediateDirectories: true)
        var generator = SystemRandomNumberGenerator()
        _ = FileManager.default.createFile(atPath: content + "/payload.bin", contents: Data((0..<300_000).map { _ in UInt8.random(in: 0...255, using: &generator) }))
        let v1 = try ArchivePacker.pack(
            folder: content,
            options: .init(productId: try ProductIdentifier(product), contentVersion: try ContentVersion("1.0"), outputDirectory: tmp.sub("out")))
        let (_, url) = try publishAndBuy(v1, server: server, store: store, tmp: tmp)
        #expect(try curl(["-r", "0-9", url], folder: tmp).status == 206)
        #expect(try curl(["-r", "0-99999", url], folder: tmp).status == 206)
        let lines = try curl([server.base + "/metrics"], folder: tmp).text.split(separator: "\n").map(String.init)
        #expect(lines.contains("iap_content_responses_total{status=\"206\"} 2"), "\(lines.filter { $0.hasPrefix("iap_content") })")
        #expect(lines.contains("iap_content_bytes_served_total 100010"))
        #expect(lines.contains("iap_content_transfer_duration_seconds_count 1"))
        #expect(lines.contains("iap_content_active_transfers 0.0") || lines.contains("iap_content_active_transfers 0"))
        #expect(server.stop() == 0)
    }

    @Test("a slow-loris client trickling a content request head is cut off too")
    func slowContentHead() throws {
        let tmp = try TemporaryFolder()
        let (_, server) = try start(tmp, extra: ["--header-timeout", "2"])
        let script = try tmp.write("loris.py", Self.lorisScript(requestLine: "GET /v1/content/some-token"))
        let loris = try run("python3", [script, String(server.port)])
        #expect(loris.stdout.contains("closed"), "\(loris.stdout) \(loris.stderr)")
        #expect(server.stop() == 0)
    }
}

extension HardeningTests {
    /// Python: reads one response from file `f`, returns its status and body (by `Content-Length`).
    static let readResponse = """
        def response(f):
            status = f.readline().decode().split(' ')[1]
            length = 0
            while (line := f.readline().decode()) not in ('\\r\\n', ''):
                name, _, value = line.partition(':')
                if name.lower() == 'content-length':
                    length = int(value)
            return status, f.read(length)
        """

    static let largeBodies = """
        import socket, sys

        port, path, archive = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], 'rb').read()
        failures = []

        \(Self.readResponse)

        # Pipelined in one write: a small answer, the whole archive and a 5 MiB range (each sent
        # from a sending thread), then a small answer that has to wait for them.
        s = socket.create_connection(('127.0.0.1', port))
        s.settimeout(20)
        f = s.makefile('rb')
        end = 100 + (5 << 20) - 1
        s.sendall((f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=0-9\\r\\n\\r\\n'
                   f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'
                   f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=100-{end}\\r\\n\\r\\n'
                   f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=10-19\\r\\nConnection: close\\r\\n\\r\\n').encode())
        expected = [('206', archive[0:10]), ('200', archive), ('206', archive[100:end + 1]), ('206', archive[10:20])]
        for index, (code, body) in enumerate(expected):
            got_code, got_body = response(f)
            if (got_code, got_body) != (code, body):
                failures.append(f'response {index}: {got_code} with {len(got_body)} bytes, not {code} with {len(body)}')
        if f.read(1) != b'':
            failures.append('not closed after Connection: close')
        s.close()

        # A client that goes away with most of the body unread.
        s = socket.create_connection(('127.0.0.1', port))
        s.settimeout(20)
        f = s.makefile('rb')
        s.sendall(f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'.encode())
        f.readline()
        f.read(1 << 20)
        s.close()
        print('\\n'.join(failures) if failures else 'ok')
        """

    /// Ranges of 64 KiB to 2 MiB among small answers: asked for one at a time, each read before
    /// the next is asked (`fits`: the socket has room for each), or pipelined in one write by a
    /// client whose receive buffer is 16 KiB and that reads only once every request is written
    /// (`fills`: the kernel's buffers fill during a body, and the rest of it goes through NIO or
    /// a sending thread); then a multipart answer of 16 parts. Prints `ok` or what differed.
    static let middleRanges = """
        import socket, sys

        port, path, archive, mode = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], 'rb').read(), sys.argv[4]

        \(Self.readResponse)

        if mode == 'fits':
            ranges = [(0, 9), (0, (1 << 20) - 1), (1000, 301_000), (5, (2 << 20) + 4), (70_000, 70_000 + (64 << 10)), (10, 19)]
        else:
            ranges = [(100, (2 << 20) + 99), (7, 7 + (3 << 19)), (0, 9), (3, 400_003), ((1 << 20) + 1, (3 << 20)), (10, 19)]
        s = socket.socket()
        if mode == 'fills':
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        s.connect(('127.0.0.1', port))
        s.settimeout(20)
        f = s.makefile('rb')
        requests = [f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes={a}-{b}\\r\\n'
                    + ('Connection: close\\r\\n' if i == len(ranges) - 1 else '') + '\\r\\n' for i, (a, b) in enumerate(ranges)]
        if mode == 'fills':
            s.sendall(''.join(requests).encode())
        failures = []
        for index, (a, b) in enumerate(ranges):
            if mode == 'fits':
                s.sendall(requests[index].encode())
            code, body = response(f)
            if (code, body) != ('206', archive[a:b + 1]):
                failures.append(f'range {index} ({a}-{b}): {code} with {len(body)} bytes, not 206 with {b + 1 - a}')
        if f.read(1) != b'':
            failures.append('not closed after Connection: close')

        # A multipart answer of 16 parts of 64 KiB, whole and in order.
        s = socket.create_connection(('127.0.0.1', port))
        s.settimeout(20)
        f = s.makefile('rb')
        parts = [(i * 150_000, i * 150_000 + 65_535) for i in range(16)]
        s.sendall((f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=' + ','.join(f'{a}-{b}' for a, b in parts)
                   + '\\r\\nConnection: close\\r\\n\\r\\n').encode())
        code, body = response(f)
        at = 0
        for a, b in parts:
            found = body.find(archive[a:b + 1], at)
            if found < 0:
                failures.append(f'multipart: part {a}-{b} missing or out of order')
                break
            at = found + b + 1 - a
        if code != '206' or not body.rstrip().endswith(b'--'):
            failures.append(f'multipart: {code} with {len(body)} bytes')
        print('\\n'.join(failures) if failures else 'ok')
        """

    /// Packs `size` random bytes, stored, as the product's version 1.0, publishes it and buys it:
    /// the archive and its download URL.
    func publishNoise(_ size: Int, server: ServerProcess, store: SandboxStore, tmp: TemporaryFolder) throws -> (PackResult, String) {
        let noise = try #require(FileHandle(forReadingAtPath: "/dev/urandom")?.readData(ofLength: size))
        _ = try tmp.write("noise/noise.bin", noise)
        let archive = try ArchivePacker.pack(
            folder: tmp.sub("noise"),
            options: .init(productId: try ProductIdentifier(product), contentVersion: try ContentVersion("1.0"), outputDirectory: tmp.sub("out"), level: 0))
        let (_, url) = try publishAndBuy(archive, server: server, store: store, tmp: tmp)
        return (archive, url)
    }

    /// Where the descriptors of process `pid` lead (`socket:[inode]`, file paths).
    static func descriptorLinks(_ pid: Int32) -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/fd")) ?? []).map {
            (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/\(pid)/fd/\($0)")) ?? ""
        }
    }

    /// Connections `server` holds open on its port (TCP sockets of its own, not listening).
    static func connections(of server: ServerProcess) -> Int {
        let pid = server.process.processIdentifier
        let inodes = Set(descriptorLinks(pid).filter { $0.hasPrefix("socket:[") }.map { String($0.dropFirst(8).dropLast()) })
        let table = (try? String(contentsOfFile: "/proc/\(pid)/net/tcp", encoding: .utf8)) ?? ""
        let local = String(format: ":%04X", server.port)
        var count = 0
        for line in table.split(separator: "\n").dropFirst() {
            let fields = line.split(separator: " ")
            guard fields.count > 9, fields[1].hasSuffix(local), fields[3] != "0A" else { continue }
            if inodes.contains(String(fields[9])) { count += 1 }
        }
        return count
    }

    /// A sample of `server`'s /metrics without labels, or nil when it has none.
    func metric(_ name: String, of server: ServerProcess, tmp: TemporaryFolder) throws -> Double? {
        try curl([server.base + "/metrics"], folder: tmp).text.split(separator: "\n").first { $0.hasPrefix(name + " ") }
            .flatMap { Double($0.split(separator: " ").last ?? "") }
    }

    /// Two connections that each send three requests in one write and read nothing: one answered
    /// by the fast path, one in absolute form, which the fast path hands to NIO's decoder. Each
    /// asks for three ranges of 1,000,000 bytes: a multipart answer of about 3 MB, more than the
    /// kernel's buffers take, which NIO sends (the sending threads take single ranges only).
    static let stoppedReaders = """
        import socket, sys, time

        port, path = int(sys.argv[1]), sys.argv[2]
        held = []
        for target in (path, f'http://x{path}'):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(('127.0.0.1', port))
            s.sendall(f'GET {target} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes=0-999999,1100000-2099999,2200000-3199999\\r\\n\\r\\n'.encode() * 3)
            held.append(s)
        time.sleep(120)
        """

    /// A client that reads 48 KiB every tenth of a second: slower than the server sends, never
    /// still for an idle timeout. It asks for eight pipelined ranges of 1,000,000 bytes (under the
    /// sending threads' 1 MiB), more than the kernel's buffers hold, so that the later ones wait in
    /// NIO for seconds while they drain, and prints the statuses and whether the bodies are the
    /// archive's bytes.
    static let slowReader = """
        import socket, sys, time

        port, path, archive = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], 'rb').read()
        part, parts = 1000000, 8
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.connect(('127.0.0.1', port))
        s.sendall(''.join(f'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nRange: bytes={i * part}-{(i + 1) * part - 1}\\r\\n'
                          + ('Connection: close\\r\\n' if i == parts - 1 else '') + '\\r\\n' for i in range(parts)).encode())
        got = b''
        while True:
            data = s.recv(49152)
            if not data:
                break
            got += data
            time.sleep(0.1)
        statuses, bodies = [], b''
        while got:
            head, _, got = got.partition(b'\\r\\n\\r\\n')
            statuses.append(head.split(b' ')[1].decode())
            bodies, got = bodies + got[:part], got[part:]
        print(' '.join(statuses), bodies == archive[:parts * part])
        """

    @Test("a client that stops reading an answer NIO sends (multipart, or under 1 MiB), on either request path, has its connection closed after the idle timeout; one that reads slowly keeps it")
    func stoppedReadersAreCut() async throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp, extra: ["--idle-timeout", "2"])
        let (archive, url) = try publishNoise(8 << 20, server: server, store: store, tmp: tmp)
        let path = String(url.dropFirst(server.base.count))
        let transfers = try metric("iap_content_transfer_duration_seconds_count", of: server, tmp: tmp) ?? 0
        let served = try metric("iap_content_bytes_served_total", of: server, tmp: tmp) ?? 0

        let stopped = try launch("python3", [try tmp.write("stopped.py", Self.stoppedReaders), String(server.port), path])
        defer { forceStop(stopped) }
        // Takes 16 s or more, through eight idle timeouts, while the stopped readers are cut.
        let slow = try run("python3", [try tmp.write("slow.py", Self.slowReader), String(server.port), path, archive.archivePath])
        #expect(slow.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "206 206 206 206 206 206 206 206 True", "\(slow.stdout) \(slow.stderr)")

        // The answers in flight on the stopped connections end, unserved, when their connections
        // are closed (at least one on each); the slow reader's eight are the ones served.
        let cut = try await waitUntil(.seconds(30)) {
            try metric("iap_content_transfer_duration_seconds_count", of: server, tmp: tmp) ?? 0 >= transfers + 10 && Self.connections(of: server) == 0
        }
        #expect(cut != nil, "the server still holds \(Self.connections(of: server)) connections of clients that read nothing")
        #expect(try metric("iap_content_bytes_served_total", of: server, tmp: tmp) == served + 8_000_000)
        #expect(stopped.isRunning, "the stopped readers went away by themselves")
        #expect(server.stop() == 0)
    }

    @Test("told to stop, the server drains for --drain-timeout, then closes what is left and exits: clients that stopped reading, on either request path, do not hold it up")
    func drainRunsOut() async throws {
        let tmp = try TemporaryFolder()
        // The idle timeout (60 s) would cut the stopped readers long after the drain's 2 s.
        let (store, server) = try start(tmp, extra: ["--drain-timeout", "2"])
        let (_, url) = try publishNoise(8 << 20, server: server, store: store, tmp: tmp)
        // The stopped readers, told to say when the server has answered on both connections (or
        // to fail after 20 s). Asked of the client: /proc/<pid>/net/tcp, listed a page per read,
        // can miss connections while other tests' come and go.
        let said = Pipe()
        let script = Self.stoppedReaders.replacingOccurrences(
            of: "time.sleep(120)", with: "for s in held: s.settimeout(20); s.recv(1, socket.MSG_PEEK)\nprint('held', flush=True)\ntime.sleep(120)")
        let stopped = try launch("python3", [try tmp.write("stopped.py", script), String(server.port), String(url.dropFirst(server.base.count))], stdout: said)
        defer { forceStop(stopped) }
        // Read to the line's end: print() may reach the pipe in more than one write.
        var saying = Data()
        while !saying.contains(UInt8(ascii: "\n")) {
            let chunk = said.fileHandleForReading.availableData
            if chunk.isEmpty { break }
            saying.append(chunk)
        }
        let held = String(decoding: saying, as: UTF8.self)
        try #require(held == "held\n", "the stopped readers said '\(held)'")

        kill(server.process.processIdentifier, SIGTERM)
        // Two seconds of drain, then the connections are closed and the server exits by itself
        // (stop() would SIGKILL a server still running after 20 s: status 9).
        let exited = await waitUntil(.seconds(30)) { !server.process.isRunning }
        #expect(exited != nil, "the server still runs, holding \(Self.connections(of: server)) connections")
        #expect(server.stop() == 0)
        #expect(stopped.isRunning, "the stopped readers went away by themselves")
    }

    @Test(
        "answers of 64 KiB to 2 MiB, single ranges or multipart, leave from the event loop, in order among pipelined answers, none from the sending threads; when the client's buffers fill during one, the rest goes the usual ways"
    )
    func middleRangesFromTheEventLoop() async throws {
        let tmp = try TemporaryFolder()
        let (store, server) = try start(tmp)
        let (archive, url) = try publishNoise(4 << 20, server: server, store: store, tmp: tmp)
        let path = String(url.dropFirst(server.base.count))
        let script = try tmp.write("middle.py", Self.middleRanges)
        let pid = server.process.processIdentifier

        let before = try Self.sendingThreadsWrote(pid)
        let fits = try run("python3", [script, String(server.port), path, archive.archivePath, "fits"])
        #expect(fits.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "ok", "\(fits.stdout) \(fits.stderr)")
        // 1 MiB and 2 MiB: without the event loop's own send they would be the sending threads'.
        #expect(try Self.sendingThreadsWrote(pid) == before, "the sending threads sent some of the ranges")

        let fills = try run("python3", [script, String(server.port), path, archive.archivePath, "fills"])
        #expect(fills.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "ok", "\(fills.stdout) \(fills.stderr)")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200)
        #expect(server.stop() == 0)
    }

    /// What the server's sending threads have written (a thread's `wchar` counts what its
    /// sendfile calls sent).
    static func sendingThreadsWrote(_ pid: Int32) throws -> Int {
        let tasks = try FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")
        var sent = 0
        for task in tasks where ((try? String(contentsOfFile: "/proc/\(pid)/task/\(task)/comm", encoding: .utf8)) ?? "").hasPrefix("iap-send-") {
            let io = try String(contentsOfFile: "/proc/\(pid)/task/\(task)/io", encoding: .utf8)
            sent += io.split(separator: "\n").first { $0.hasPrefix("wchar:") }.flatMap { Int($0.dropFirst(6).trimmingCharacters(in: .whitespaces)) } ?? 0
        }
        return sent
    }

    @Test("archive bodies of 1 MiB or more leave from the sending threads: in order among pipelined answers; a client that goes away, or stops reading for --idle-timeout, frees its connection")
    func largeBodiesFromSendingThreads() async throws {
        let tmp = try TemporaryFolder()
        // One event loop: the server keeps an archive open once per loop.
        let (store, server) = try start(tmp, extra: ["--event-loops", "1", "--idle-timeout", "3"])
        let (archive, url) = try publishNoise(12 << 20, server: server, store: store, tmp: tmp)
        let pid = server.process.processIdentifier
        let links = { Self.descriptorLinks(pid) }
        let connections = { Self.connections(of: server) }
        // Once the archive has been served, the server keeps it open.
        #expect(try curl(["-r", "0-9", url], folder: tmp).status == 206)
        let archivesOpen = { links().filter { $0.hasSuffix(".zip") }.count }
        let before = archivesOpen()

        let script = try tmp.write("large.py", Self.largeBodies)
        let result = try run("python3", [script, String(server.port), String(url.dropFirst(server.base.count)), archive.archivePath])
        #expect(result.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "ok", "\(result.stdout) \(result.stderr)")

        let sent = try Self.sendingThreadsWrote(pid)
        let size = try #require(FileManager.default.attributesOfItem(atPath: archive.archivePath)[.size] as? Int)
        #expect(sent >= size + 5 << 20, "the sending threads wrote \(sent) bytes of the \(size + 5 << 20) asked for")
        #expect(sent < 2 * size + 5 << 20, "the sending threads wrote \(sent) bytes")

        // The connection that went away mid-body is closed, and the duplicates made for its send.
        let freed = await waitUntil(.seconds(10)) { connections() == 0 && archivesOpen() <= before }
        #expect(freed != nil, "\(connections()) connections and \(archivesOpen()) archives open, \(before) before")

        // A client that asks for the archive and reads nothing, its connection kept open: closed
        // by the server once it has taken no byte for the idle timeout, as nginx's send_timeout.
        // The transfer's end is counted (its duration recorded, its bytes not served) while the
        // client still runs and has read nothing.
        let metric = { (name: String) in try self.metric(name, of: server, tmp: tmp) }
        let transfers = try metric("iap_content_transfer_duration_seconds_count") ?? 0
        let served = try metric("iap_content_bytes_served_total") ?? 0
        let path = String(url.dropFirst(server.base.count))
        let stalled = try launch(
            "python3",
            [
                "-c",
                "import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
                    + "s.sendall(f'GET {sys.argv[2]} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'.encode()); time.sleep(120)",
                String(server.port), path,
            ])
        defer { forceStop(stalled) }
        let cut = try await waitUntil(.seconds(30)) { try metric("iap_content_transfer_duration_seconds_count") == transfers + 1 && connections() == 0 }
        #expect(cut != nil, "the server still holds the connection of a client that reads nothing: \(connections()) open")
        #expect(try metric("iap_content_bytes_served_total") == served, "the cut transfer was counted as served")
        #expect(stalled.isRunning, "the client went away by itself")
        #expect(try curl([server.base + "/healthz"], folder: tmp).status == 200)
        #expect(server.stop() == 0)
    }
}

import Foundation
import IAPProtocol
import IAPTestSupport
import NIOCore
import NIOEmbedded
import NIOHTTP1
import Testing

@testable import ContentDelivery

/// The fast path's parser on byte fixtures: what it takes, what it waits for, and everything it
/// must leave to NIO's decoder.
@Suite(.onTestThreads) struct RequestHeadParserTests {
    let parser = RequestHeadParser(prefix: "/v1/content/")

    func parse(_ text: String) -> RequestHeadParser.Parsed {
        parser.parse(ByteBuffer(string: text))
    }

    func request(_ text: String) -> (head: RequestHeadParser.Head, length: Int)? {
        guard case .request(let head, let length) = parse(text) else { return nil }
        return (head, length)
    }

    @Test func aPlainRangeRequest() throws {
        let text = "GET /v1/content/tok/p-1.0.zip HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\nIf-Range: \"abc\"\r\n\r\n"
        let parsed = try #require(request(text))
        #expect(parsed.length == text.utf8.count)
        #expect(parsed.head.http10 == false)
        #expect(
            parsed.head.content
                == ContentRequest(
                    method: .GET, uri: "/v1/content/tok/p-1.0.zip", keepAlive: true,
                    range: "bytes=0-9", ifRange: "\"abc\"", ifNoneMatch: nil))
    }

    @Test("the connection's last target is taken as the request's only when the bytes spell it")
    func knownTarget() throws {
        let known = "/v1/content/tok/p-1.0.zip?x=1"
        func uri(_ target: String) throws -> String {
            guard case .request(let head, _) = parser.parse(ByteBuffer(string: "GET \(target) HTTP/1.1\r\n\r\n"), knownURI: known) else {
                throw ParseFailed()
            }
            return head.content.uri
        }
        #expect(try uri(known) == known)
        // Same length, one byte different; a prefix of it; longer.
        #expect(try uri("/v1/content/tok/p-1.0.zip?x=2") == "/v1/content/tok/p-1.0.zip?x=2")
        #expect(try uri("/v1/content/tok/p-1.0.zip") == "/v1/content/tok/p-1.0.zip")
        #expect(try uri(known + "0") == known + "0")
    }

    struct ParseFailed: Error {}

    @Test("the Date field is formatted once per second per connection, and changes with the second")
    func dateMemory() {
        var memory = ResponseMemory()
        #expect(memory.date(Date(timeIntervalSince1970: 0.2)) == "Thu, 01 Jan 1970 00:00:00 GMT")
        #expect(memory.date(Date(timeIntervalSince1970: 0.9)) == "Thu, 01 Jan 1970 00:00:00 GMT")
        #expect(memory.date(Date(timeIntervalSince1970: 1_795_530_672)) == HTTPDate.format(Date(timeIntervalSince1970: 1_795_530_672)))
        #expect(memory.date(Date(timeIntervalSince1970: 1)) == "Thu, 01 Jan 1970 00:00:01 GMT")
    }

    @Test func fieldNamesAnyCaseValuesTrimmed() throws {
        let parsed = try #require(request("HEAD /v1/content/t HTTP/1.1\r\nrAnGe:\t bytes=-5 \t\r\nIF-NONE-MATCH: \"e\"\r\n\r\n"))
        #expect(parsed.head.content.method == .HEAD)
        #expect(parsed.head.content.range == "bytes=-5")
        #expect(parsed.head.content.ifNoneMatch == "\"e\"")
    }

    @Test func preconditionFieldsAreRead() throws {
        let parsed = try #require(
            request("GET /v1/content/t HTTP/1.1\r\nif-match: \"a\", \"b\"\r\nIf-Unmodified-Since: Sun, 06 Nov 1994 08:49:37 GMT\r\n\r\n"))
        #expect(parsed.head.content.ifMatch == "\"a\", \"b\"")
        #expect(parsed.head.content.ifUnmodifiedSince == "Sun, 06 Nov 1994 08:49:37 GMT")
        // Twice: NIO's decoder combines the list.
        #expect(request("GET /v1/content/t HTTP/1.1\r\nIf-Match: \"a\"\r\nIf-Match: \"b\"\r\n\r\n") == nil)
    }

    @Test func pipelinedRequestsAreReadOneHeadAtATime() throws {
        let first = "GET /v1/content/a HTTP/1.1\r\n\r\n"
        let both = first + "GET /v1/content/b HTTP/1.1\r\n\r\n"
        let parsed = try #require(request(both))
        #expect(parsed.length == first.utf8.count && parsed.head.content.uri == "/v1/content/a")
    }

    @Test func keepAliveFollowsTheVersionAndConnection() throws {
        #expect(try #require(request("GET /v1/content/a HTTP/1.0\r\n\r\n")).head.content.keepAlive == false)
        #expect(try #require(request("GET /v1/content/a HTTP/1.0\r\n\r\n")).head.http10)
        #expect(try #require(request("GET /v1/content/a HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")).head.content.keepAlive)
        #expect(try #require(request("GET /v1/content/a HTTP/1.1\r\nConnection: foo, close\r\n\r\n")).head.content.keepAlive == false)
        #expect(try #require(request("GET /v1/content/a HTTP/1.1\r\nContent-Length: 0\r\n\r\n")).head.content.keepAlive)
    }

    @Test(arguments: [
        "G", "GET /v1/con", "HEAD /v1/content/a HTTP/1.1\r\n", "GET /v1/content/a HTTP/1.1\r\nRange: bytes=0-1\r\n",
        "GET /v1/content/a HTTP/1.1\r\n\r",
    ])
    func anUnfinishedHeadWaitsForMore(_ text: String) {
        #expect(parse(text) == .incomplete)
    }

    @Test(arguments: [
        // Not ours: other paths, methods and versions.
        "GET /healthz HTTP/1.1\r\n\r\n", "POST /v1/content/a HTTP/1.1\r\n\r\n", "get /v1/content/a HTTP/1.1\r\n\r\n",
        "GET /v1/content/a HTTP/2.0\r\n\r\n", "GET /v1/content/a\r\n\r\n", "PUT",
        // Bodies and protocol switches: the decoder knows them.
        "GET /v1/content/a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
        "GET /v1/content/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nConnection: Upgrade\r\n\r\n",
        // What parsers read differently: repeated fields, obs-fold, bare LF, spaces before the colon, controls.
        "GET /v1/content/a HTTP/1.1\r\nRange: bytes=0-1\r\nRange: bytes=5-6\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nIf-Range: \"a\"\r\nif-range: \"b\"\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\nRange: bytes=0-1\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nRange : bytes=0-1\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\n: empty name\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nX: a\u{1}b\r\n\r\n",
        "GET /v1/content/a HTTP/1.1\r\nX: a\u{7F}\r\n\r\n",
        "GET /v1/content/a b HTTP/1.1\r\n\r\n",
        "GET /v1/content/\u{E9} HTTP/1.1\r\n\r\n",
    ])
    func whatItIsNotSureOfGoesToTheDecoder(_ text: String) {
        #expect(parse(text) == .handOff)
    }

    @Test func headsOverTheLimitsGoToTheDecoder() {
        let manyLines = "GET /v1/content/a HTTP/1.1\r\n" + String(repeating: "X: y\r\n", count: RequestHeadParser.maxHeaderLines + 1) + "\r\n"
        #expect(parse(manyLines) == .handOff)
        let atTheLimit = "GET /v1/content/a HTTP/1.1\r\n" + String(repeating: "X: y\r\n", count: RequestHeadParser.maxHeaderLines) + "\r\n"
        #expect(request(atTheLimit) != nil)
        let huge = "GET /v1/content/a HTTP/1.1\r\nX: " + String(repeating: "a", count: RequestHeadParser.maxHead)
        #expect(parse(huge) == .handOff)
    }

    /// Differential, on hostile bytes: seeded random mutations of request heads, read by the fast
    /// path and by NIO's decoder. Whatever the fast path answers itself, NIO must read the same
    /// way: method, target, version, keep-alive, the values of the fields the fast path uses, and
    /// the head ending at the same byte, where a pipelined request begins. A difference would let
    /// a request mean one thing to the fast path and another to NIO or a proxy in front
    /// (request smuggling).
    @Test func whatItAnswersNIOReadsTheSameWay() throws {
        let seeds = [
            "GET /v1/content/k1.abc/x.zip HTTP/1.1\r\nHost: a\r\nRange: bytes=0-4095\r\n\r\n",
            "HEAD /v1/content/t/x.zip HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
            "GET /v1/content/t/x.zip HTTP/1.1\r\nIf-Range: \"abc\"\r\nRange: bytes=5-,7-9\r\nConnection: close\r\n\r\n",
            "GET /v1/content/t/x.zip HTTP/1.1\r\nIf-None-Match: \"e\"\r\nIf-Modified-Since: Tue, 24 Nov 2026 10:00:00 GMT\r\nContent-Length: 0\r\n\r\n",
            "GET /v1/content/t/x.zip?a=b HTTP/1.1\r\nUser-Agent: x/1\r\nAccept: */*\r\nConnection: keep-alive, x\r\n\r\n",
            "GET /v1/content/t/x.zip HTTP/1.1\r\nIf-Match: \"e\"\r\nIf-Unmodified-Since: Tue, 24 Nov 2026 10:00:00 GMT\r\nRange: bytes=0-9\r\n\r\n",
        ].map { Array($0.utf8) }
        let alphabet = Array("\r\n \t:,;=\"-aZ0/%".utf8) + [0x00, 0x0B, 0x7F, 0x80, 0xFF]
        let next = Array("GET /v1/content/next HTTP/1.1\r\n\r\n".utf8)
        var random = SplitMix64(seed: 19)
        var answered = 0
        for round in 0..<20_000 {
            var bytes = seeds[Int(random.next() % UInt64(seeds.count))]
            for _ in 0...(random.next() % 3) { mutate(&bytes, alphabet: alphabet, random: &random) }
            guard case .request(let head, let length) = parser.parse(ByteBuffer(bytes: bytes)) else { continue }
            answered += 1
            let shown = String(decoding: bytes[..<length], as: UTF8.self).debugDescription
            // Another request follows on a connection kept alive (NIO refuses bytes after a
            // request that closes it, and the fast path closes it).
            let follows = head.content.keepAlive ? next : []
            let heads = try decodedByNIO(Array(bytes[..<length]) + follows)
            try #require(heads != nil, "round \(round): NIO refused what the fast path answered: \(shown)")
            let expected = follows.isEmpty ? 1 : 2
            try #require(
                heads!.count == expected && (follows.isEmpty || heads![1].uri == "/v1/content/next"),
                "round \(round): the head ends elsewhere for NIO: \(shown)")
            let nio = heads![0]
            #expect(nio.method == head.content.method && nio.uri == head.content.uri, "round \(round): \(shown)")
            #expect((nio.version == .http1_0) == head.http10 && nio.isKeepAlive == head.content.keepAlive, "round \(round): \(shown)")
            let fields = [
                ("range", head.content.range), ("if-range", head.content.ifRange),
                ("if-none-match", head.content.ifNoneMatch), ("if-modified-since", head.content.ifModifiedSince),
                ("if-match", head.content.ifMatch), ("if-unmodified-since", head.content.ifUnmodifiedSince),
            ]
            // NIO keeps a value's trailing spaces and tabs, which RFC 9110 §5.5 says are not part of
            // it; the fast path drops them, and the range code trims what NIO hands it.
            for (name, value) in fields {
                let nioValues = nio.headers[name].map { String($0.trimmingCharacters(in: CharacterSet(charactersIn: " \t"))) }
                #expect(nioValues == (value.map { [$0] } ?? []), "round \(round): \(name) differs: \(shown)")
            }
        }
        // Enough mutated heads must still be answered for the comparison to mean something.
        #expect(answered > 2_000, "only \(answered) of 20,000 mutated heads were answered by the fast path")
    }

    /// The request heads NIO's decoder reads from `bytes`, or nil when it refuses them.
    func decodedByNIO(_ bytes: [UInt8]) throws -> [HTTPRequestHead]? {
        let channel = EmbeddedChannel()
        defer { _ = try? channel.finish() }
        try channel.pipeline.syncOperations.addHandler(ByteToMessageHandler(HTTPRequestDecoder(leftOverBytesStrategy: .forwardBytes)))
        do { try channel.writeInbound(ByteBuffer(bytes: bytes)) } catch { return nil }
        var heads: [HTTPRequestHead] = []
        while let part = try channel.readInbound(as: HTTPServerRequestPart.self) {
            if case .head(let head) = part { heads.append(head) }
        }
        return heads
    }

    /// One random edit: a byte inserted, removed or replaced, a run of bytes repeated elsewhere
    /// (a repeated line or field), or a letter's case flipped.
    func mutate(_ bytes: inout [UInt8], alphabet: [UInt8], random: inout SplitMix64) {
        guard !bytes.isEmpty else { return }
        let at = Int(random.next() % UInt64(bytes.count))
        let byte = alphabet[Int(random.next() % UInt64(alphabet.count))]
        switch random.next() % 5 {
        case 0: bytes.insert(byte, at: at)
        case 1: bytes.remove(at: at)
        case 2: bytes[at] = byte
        case 3:
            let end = min(bytes.count, at + 1 + Int(random.next() % 24))
            bytes.insert(contentsOf: bytes[at..<end], at: Int(random.next() % UInt64(bytes.count)))
        default:
            if (UInt8(ascii: "a")...UInt8(ascii: "z")).contains(bytes[at] | 0x20) { bytes[at] ^= 0x20 }
        }
    }
}

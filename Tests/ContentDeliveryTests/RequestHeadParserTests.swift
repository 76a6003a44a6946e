import Foundation
import NIOCore
import NIOHTTP1
import Testing

@testable import ContentDelivery

/// The fast path's parser on byte fixtures: what it takes, what it waits for, and everything it
/// must leave to NIO's decoder.
@Suite struct RequestHeadParserTests {
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
}

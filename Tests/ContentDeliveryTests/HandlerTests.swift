import Foundation
import IAPProtocol
import IAPTestSupport
import NIOCore
import NIOEmbedded
import NIOHTTP1
import NIOPosix
import Testing

@testable import ContentDelivery

/// A resolver over one real file on disk: `ok/...` serves it, `gone/...` is refused.
final class OneFileResolver: ContentResolver {
    let file: ServedFile
    let bytes: [UInt8]

    init(size: Int) throws {
        let path = NSTemporaryDirectory() + "delivery-\(UUID().uuidString).zip"
        bytes = [UInt8](pseudoRandomBytes(size, seed: UInt64(size)))
        guard FileManager.default.createFile(atPath: path, contents: Data(bytes)) else { throw CocoaError(.fileWriteUnknown) }
        // Served from the open descriptor only: unlinked now, nothing is left in /tmp even when
        // a channel keeps the resolver alive past the test.
        defer { unlink(path) }
        file = ServedFile(
            handle: try NIOFileHandle(_deprecatedPath: path), size: UInt64(size), etag: "\"abc\"",
            modified: Date(timeIntervalSince1970: 784_111_777))
    }

    deinit { try? file.handle.close() }

    func resolve(key: Substring, name: Substring, on eventLoop: any EventLoop) -> ContentResolution {
        key == "ok" ? .file(file, fileName: "p-1.0.zip", freshFor: 900) : .refuse(.forbidden, APIError(.revoked, "refunded"))
    }
}

/// Records what the handlers report, as the server's metrics do.
final class RecordingObserver: ContentObserver, @unchecked Sendable {
    // Touched only on the embedded channel's loop, which is the test's thread.
    var started: [HTTPResponseStatus] = []
    var finished: [(HTTPResponseStatus, UInt64, Bool)] = []
    func responseStarted(status: HTTPResponseStatus, bytes: UInt64) { started.append(status) }
    func responseFinished(status: HTTPResponseStatus, bytes: UInt64, duration: Duration, succeeded: Bool) {
        finished.append((status, bytes, succeeded))
    }
}

/// Reads a response that the fast path wrote as raw bytes and file regions.
func rawResponse(_ channel: EmbeddedChannel, file: OneFileResolver) throws -> (head: String, body: [UInt8]) {
    var bytes: [UInt8] = []
    while let part = try channel.readOutbound(as: IOData.self) {
        switch part {
        case .byteBuffer(let buffer): bytes += buffer.readableBytesView
        case .fileRegion(let region): bytes += file.bytes[region.readerIndex..<region.endIndex]
        }
    }
    let text = String(decoding: bytes, as: UTF8.self)
    guard let split = bytes.firstRange(of: Array("\r\n\r\n".utf8)) else { return (text, []) }
    return (String(decoding: bytes[..<split.lowerBound], as: UTF8.self), Array(bytes[split.upperBound...]))
}

@Suite struct ContentFastPathTests {
    @Test func answersARangeWithHeadAndBodyInOneWrite() throws {
        let file = try OneFileResolver(size: 100_000)
        let observer = RecordingObserver()
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file, observer: observer))
        try channel.writeInboundAndRun(ByteBuffer(string: "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\nRange: bytes=10-19\r\n\r\n"))
        let first = try #require(try channel.readOutbound(as: IOData.self))
        guard case .byteBuffer(let buffer) = first else { Issue.record("expected one buffer, got \(first)"); return }
        let text = String(decoding: buffer.readableBytesView, as: UTF8.self)
        #expect(text.hasPrefix("HTTP/1.1 206 Partial Content\r\n"))
        #expect(text.contains("Content-Range: bytes 10-19/100000\r\n"))
        #expect(Array(buffer.readableBytesView.suffix(10)) == Array(file.bytes[10..<20]))
        #expect(try channel.readOutbound(as: IOData.self) == nil)
        #expect(observer.finished.count == 1 && observer.finished[0].0 == .partialContent && observer.finished[0].2)
        #expect(try channel.readInbound(as: ByteBuffer.self) == nil, "nothing was handed to the decoder")
        _ = try channel.finish()
    }

    @Test func sendsLargeBodiesAsFileRegions() throws {
        let file = try OneFileResolver(size: 300_000)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file))
        try channel.writeInboundAndRun(ByteBuffer(string: "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\n\r\n"))
        _ = try #require(try channel.readOutbound(as: IOData.self))
        guard case .fileRegion(let region) = try #require(try channel.readOutbound(as: IOData.self)) else {
            Issue.record("the body should be a file region (sendfile)")
            return
        }
        #expect(region.readerIndex == 0 && region.endIndex == 300_000)
        _ = try channel.finish()
    }

    @Test func aRefusalIsTheErrorEnvelope() throws {
        let file = try OneFileResolver(size: 10)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file))
        try channel.writeInboundAndRun(ByteBuffer(string: "GET /v1/content/gone/p-1.0.zip HTTP/1.1\r\n\r\n"))
        let response = try rawResponse(channel, file: file)
        #expect(response.head.hasPrefix("HTTP/1.1 403 Forbidden"))
        #expect(ErrorEnvelope.read(response.body).code() == .revoked)
        _ = try channel.finish()
    }

    @Test func handsTheConnectionToTheDecoderAtTheFirstRequestItDoesNotTake() throws {
        let file = try OneFileResolver(size: 100)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file))
        let request = "GET /v1/content/ok/x HTTP/1.1\r\nRange: bytes=0-3\r\n\r\n"
        let rest = "POST /v1/downloads HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}" + request
        try channel.writeInboundAndRun(ByteBuffer(string: request + rest))
        let answered = try rawResponse(channel, file: file)
        #expect(answered.head.hasPrefix("HTTP/1.1 206") && answered.body == Array(file.bytes[0..<4]))
        // Everything from the POST on, the later content request included, goes to the decoder.
        let passed = try #require(try channel.readInbound(as: ByteBuffer.self))
        #expect(String(buffer: passed) == rest)
        try channel.writeInboundAndRun(ByteBuffer(string: request))
        #expect(try channel.readInbound(as: ByteBuffer.self).map { String(buffer: $0) } == request)
        _ = try channel.finish()
    }

    @Test func aHeadSplitOverReadsIsAnsweredOnceWhole() throws {
        let file = try OneFileResolver(size: 100)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file))
        try channel.writeInboundAndRun(ByteBuffer(string: "GET /v1/content/ok/x HTTP/1.1\r\nRan"))
        #expect(try channel.readOutbound(as: IOData.self) == nil)
        try channel.writeInboundAndRun(ByteBuffer(string: "ge: bytes=5-6\r\n\r\n"))
        let response = try rawResponse(channel, file: file)
        #expect(response.head.hasPrefix("HTTP/1.1 206") && response.body == Array(file.bytes[5..<7]))
        _ = try channel.finish()
    }

    @Test("a connection idle between requests is closed; after a hand-off the handlers behind decide")
    func readIdleClosesBetweenRequests() throws {
        let file = try OneFileResolver(size: 100)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file))
        try channel.connect(to: SocketAddress(ipAddress: "127.0.0.1", port: 8080)).wait()
        try channel.writeInboundAndRun(ByteBuffer(string: "GET /v1/content/ok/x HTTP/1.1\r\nRange: bytes=0-3\r\n\r\n"))
        _ = try rawResponse(channel, file: file)
        #expect(channel.isActive)
        channel.pipeline.fireUserInboundEventTriggered(IdleStateHandler.IdleStateEvent.read)
        #expect(!channel.isActive)

        var installed = 0
        let handedOff = EmbeddedChannel(
            handler: ContentFastPath(prefix: "/v1/content/", resolver: file, installDecoder: { _ in installed += 1 }))
        try handedOff.connect(to: SocketAddress(ipAddress: "127.0.0.1", port: 8080)).wait()
        try handedOff.writeInboundAndRun(ByteBuffer(string: "POST /v1/downloads HTTP/1.1\r\nContent-Length: 0\r\n\r\n"))
        #expect(installed == 1, "the decoder is installed at the first request the fast path does not take")
        _ = try handedOff.readInbound(as: ByteBuffer.self)
        handedOff.pipeline.fireUserInboundEventTriggered(IdleStateHandler.IdleStateEvent.read)
        #expect(handedOff.isActive, "after the hand-off the idle event is the HTTP handlers' to act on")
        _ = try handedOff.finish()
    }

    @Test func connectionCloseClosesAfterTheResponse() throws {
        let file = try OneFileResolver(size: 100)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file))
        try channel.connect(to: SocketAddress(ipAddress: "127.0.0.1", port: 8080)).wait()
        try channel.writeInboundAndRun(ByteBuffer(string: "HEAD /v1/content/ok/x HTTP/1.1\r\nConnection: close\r\n\r\n"))
        let response = try rawResponse(channel, file: file)
        #expect(response.head.contains("Connection: close") && response.body.isEmpty)
        #expect(!channel.isActive)
    }
}

@Suite struct ContentChannelHandlerTests {
    func head(_ uri: String, _ headers: [(String, String)] = [], method: HTTPMethod = .GET) -> HTTPServerRequestPart {
        .head(HTTPRequestHead(version: .http1_1, method: method, uri: uri, headers: HTTPHeaders(headers)))
    }

    @Test func servesAContentRequestAndReportsItOnce() throws {
        let file = try OneFileResolver(size: 200_000)
        let observer = RecordingObserver()
        let channel = EmbeddedChannel(handler: ContentChannelHandler(prefix: "/v1/content/", resolver: file, observer: observer))
        try channel.writeInbound(head("/v1/content/ok/p-1.0.zip", [("Range", "bytes=100-199999")]))
        try channel.writeInbound(HTTPServerRequestPart.end(nil))
        guard case .head(let response) = try #require(try channel.readOutbound(as: HTTPServerResponsePart.self)) else {
            Issue.record("expected a head")
            return
        }
        #expect(response.status == .partialContent)
        #expect(response.headers["Content-Range"] == ["bytes 100-199999/200000"])
        #expect(response.headers["ETag"] == ["\"abc\""])
        #expect(response.headers["Last-Modified"] == ["Sun, 06 Nov 1994 08:49:37 GMT"])
        guard case .body(.fileRegion(let region)) = try #require(try channel.readOutbound(as: HTTPServerResponsePart.self)) else {
            Issue.record("expected a file region")
            return
        }
        #expect(region.readerIndex == 100 && region.endIndex == 200_000)
        guard case .end = try #require(try channel.readOutbound(as: HTTPServerResponsePart.self)) else {
            Issue.record("expected the end")
            return
        }
        #expect(observer.started == [.partialContent])
        #expect(observer.finished.count == 1 && observer.finished[0].1 == 199_900)
        #expect(try channel.readInbound(as: HTTPServerRequestPart.self) == nil)
        _ = try channel.finish()
    }

    @Test("a target in absolute form (http://host/path) is served as its path; other forms pass on")
    func absoluteForm() throws {
        let file = try OneFileResolver(size: 10)
        let channel = EmbeddedChannel(handler: ContentChannelHandler(prefix: "/v1/content/", resolver: file))
        try channel.writeInbound(head("HTTP://127.0.0.1:8080/v1/content/ok/p-1.0.zip"))
        try channel.writeInbound(HTTPServerRequestPart.end(nil))
        guard case .head(let response) = try #require(try channel.readOutbound(as: HTTPServerResponsePart.self)) else {
            Issue.record("expected a head")
            return
        }
        #expect(response.status == .ok)
        _ = try channel.finish()
        #expect(ContentChannelHandler.originForm("https://h/v1/content/t?x=1") == "/v1/content/t?x=1")
        #expect(ContentChannelHandler.originForm("http://h") == "/")
        #expect(ContentChannelHandler.originForm("*") == nil && ContentChannelHandler.originForm("h:443") == nil)
        #expect(ContentChannelHandler.originForm("ftp://h/v1/content/t") == nil)
    }

    @Test func passesOtherRequestsOn() throws {
        let file = try OneFileResolver(size: 10)
        let channel = EmbeddedChannel(handler: ContentChannelHandler(prefix: "/v1/content/", resolver: file))
        try channel.writeInbound(head("/v1/downloads", method: .POST))
        guard case .head(let passed) = try #require(try channel.readInbound(as: HTTPServerRequestPart.self)) else {
            Issue.record("the head should pass on")
            return
        }
        #expect(passed.uri == "/v1/downloads")
        #expect(try channel.readOutbound(as: HTTPServerResponsePart.self) == nil)
        _ = try channel.finish()
    }

    @Test func answersOtherMethodsOnContentWith405() throws {
        let file = try OneFileResolver(size: 10)
        let channel = EmbeddedChannel(handler: ContentChannelHandler(prefix: "/v1/content/", resolver: file))
        try channel.writeInbound(head("/v1/content/ok/x", method: .DELETE))
        try channel.writeInbound(HTTPServerRequestPart.end(nil))
        guard case .head(let response) = try #require(try channel.readOutbound(as: HTTPServerResponsePart.self)) else {
            Issue.record("expected a head")
            return
        }
        #expect(response.status == .methodNotAllowed && response.headers["Allow"] == ["GET, HEAD"])
        _ = try channel.finish()
    }

    @Test("If-Match on several lines is one list, and a failed precondition is 412 on both paths")
    func preconditions() throws {
        let file = try OneFileResolver(size: 10)
        func status(_ headers: [(String, String)]) throws -> HTTPResponseStatus? {
            let channel = EmbeddedChannel(handler: ContentChannelHandler(prefix: "/v1/content/", resolver: file))
            defer { _ = try? channel.finish() }
            try channel.writeInbound(head("/v1/content/ok/x", headers))
            try channel.writeInbound(HTTPServerRequestPart.end(nil))
            guard case .head(let response) = try channel.readOutbound(as: HTTPServerResponsePart.self) else { return nil }
            return response.status
        }
        #expect(try status([("If-Match", "\"x\""), ("If-Match", "\"abc\"")]) == .ok)
        #expect(try status([("If-Match", "\"x\""), ("If-Match", "\"y\"")]) == .preconditionFailed)
        #expect(try status([("If-Unmodified-Since", "Sat, 05 Nov 1994 08:49:37 GMT")]) == .preconditionFailed)

        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: file))
        try channel.writeInboundAndRun(ByteBuffer(string: "GET /v1/content/ok/x HTTP/1.1\r\nIf-Match: \"x\"\r\nRange: bytes=0-1\r\n\r\n"))
        let response = try rawResponse(channel, file: file)
        #expect(response.head.hasPrefix("HTTP/1.1 412 Precondition Failed"))
        #expect(response.head.contains("Cache-Control: no-store"))
        #expect(ErrorEnvelope.read(response.body).code() == .preconditionFailed)
        _ = try channel.finish()
    }
}

/// A resolver whose resolutions may be reused, counting how often it is asked.
final class StampedResolver: ContentResolver, @unchecked Sendable {
    // Touched only on the embedded channel's loop, which is the test's thread.
    let inner: OneFileResolver
    var stamp: UInt64 = 1
    var freshFor: Int64 = 900
    var calls = 0

    init(size: Int) throws { inner = try OneFileResolver(size: size) }

    func resolve(key: Substring, name: Substring, on eventLoop: any EventLoop) -> ContentResolution {
        calls += 1
        guard key == "ok" else { return .refuse(.forbidden, APIError(.revoked, "refunded")) }
        return .file(inner.file, fileName: "p-1.0.zip", freshFor: freshFor)
    }

    var reuseStamp: UInt64? { stamp }
}

@Suite struct ResolutionReuseTests {
    func get(_ channel: EmbeddedChannel, _ path: String, file: OneFileResolver) throws -> String {
        try channel.writeInboundAndRun(ByteBuffer(string: "GET /v1/content/\(path) HTTP/1.1\r\nRange: bytes=0-9\r\n\r\n"))
        return try rawResponse(channel, file: file).head
    }

    @Test("a connection reuses its last resolution for the same path while the stamp holds and it is fresh")
    func reuse() throws {
        let resolver = try StampedResolver(size: 100)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: resolver))
        #expect(try get(channel, "ok/p-1.0.zip", file: resolver.inner).hasPrefix("HTTP/1.1 206"))
        #expect(try get(channel, "ok/p-1.0.zip", file: resolver.inner).contains("Cache-Control: private, max-age=9"))
        #expect(resolver.calls == 1, "the second request was answered from the first one's resolution")
        // Another path on the same connection is resolved.
        _ = try get(channel, "ok/other.zip", file: resolver.inner)
        #expect(resolver.calls == 2)
        // A revocation (the stamp moves) is seen by the very next request.
        resolver.stamp += 1
        _ = try get(channel, "ok/other.zip", file: resolver.inner)
        #expect(resolver.calls == 3)
        // A resolution that is no longer fresh is never reused.
        resolver.freshFor = 0
        resolver.stamp += 1
        _ = try get(channel, "ok/other.zip", file: resolver.inner)
        _ = try get(channel, "ok/other.zip", file: resolver.inner)
        #expect(resolver.calls == 5)
        _ = try channel.finish()
    }

    @Test("refusals are never reused")
    func refusalsAreAskedAgain() throws {
        let resolver = try StampedResolver(size: 100)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: resolver))
        #expect(try get(channel, "gone/p-1.0.zip", file: resolver.inner).hasPrefix("HTTP/1.1 403"))
        #expect(try get(channel, "gone/p-1.0.zip", file: resolver.inner).hasPrefix("HTTP/1.1 403"))
        #expect(resolver.calls == 2)
        _ = try channel.finish()
    }

    @Test("the fast path's bytes and NIO's headers carry the same fields in the same order")
    func bothRenderingsAgree() throws {
        let resolver = try OneFileResolver(size: 10)
        var fields = ResponseFields(date: "Sun, 06 Nov 1994 08:49:37 GMT", close: true)
        fields.caching = .privateImmutable(maxAge: 1234)
        fields.validators = resolver.file
        fields.contentType = .multipart(boundary: "b0undary")
        fields.attachment = "p-1.0.zip"
        fields.contentRange = .bytes(ByteRange(first: 0, last: 18_446_744_073_709_551_614), size: 18_446_744_073_709_551_615)
        fields.contentLength = 0
        let bytes = RawHeadWriter.bytes(within: fields.renderedSizeBound) { fields.render(into: &$0) }
        let lines = String(decoding: bytes, as: UTF8.self).split(separator: "\r\n").map(String.init)
        #expect(lines == fields.httpHeaders.map { "\($0.name): \($0.value)" })
        #expect(lines.contains("Content-Range: bytes 0-18446744073709551614/18446744073709551615"))
        #expect(lines.contains("Content-Length: 0") && lines.contains("Cache-Control: private, max-age=1234, immutable, no-transform"))

        // Again with every field there is and the largest numbers, within the size reserved.
        fields.allow = true
        fields.location = "https://edge.example.com/v1/content/" + String(repeating: "k", count: 300) + "/p-1.0.zip"
        fields.challenge = "Bearer realm=\"iap-server\""
        fields.caching = .privateImmutable(maxAge: .max)
        fields.contentLength = .max
        let bound = fields.renderedSizeBound
        let raw = RawHeadWriter.bytes(within: bound) { fields.render(into: &$0) }
        #expect(String(decoding: raw, as: UTF8.self).split(separator: "\r\n").map(String.init) == fields.httpHeaders.map { "\($0.name): \($0.value)" })
        #expect(raw.count <= bound)
    }
}

extension EmbeddedChannel {
    /// Writes `buffer` in, then runs what the event loop was given to do after the read: the
    /// fast path flushes small responses once the loop has read every ready connection.
    func writeInboundAndRun(_ buffer: ByteBuffer) throws {
        try writeInbound(buffer)
        embeddedEventLoop.run()
    }
}

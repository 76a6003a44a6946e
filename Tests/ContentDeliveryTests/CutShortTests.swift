import Foundation
import IAPProtocol
import IAPTestSupport
import NIOCore
import NIOEmbedded
import NIOPosix
import Synchronization
import Testing

@testable import ContentDelivery

/// A file served from a handle opened once, then cut short on disk behind the server's back.
final class CutShortResolver: ContentResolver {
    let path = NSTemporaryDirectory() + "delivery-short-\(UUID().uuidString).zip"
    let file: ServedFile

    init(size: Int) throws {
        guard FileManager.default.createFile(atPath: path, contents: pseudoRandomBytes(size, seed: 3)) else { throw CocoaError(.fileWriteUnknown) }
        file = ServedFile(handle: try NIOFileHandle(_deprecatedPath: path), size: UInt64(size), etag: "\"abc\"", modified: Date())
    }

    deinit {
        try? file.handle.close()
        unlink(path)
    }

    func resolve(key: Substring, name: Substring, on eventLoop: any EventLoop) -> ContentResolution {
        resolutions.withLock { $0 += 1 }
        return .file(file, fileName: "p-1.0.zip", freshFor: 900)
    }

    /// How many times `resolve` was asked, and `fileCutShort` told.
    let resolutions = Mutex(0)
    let cutShort = Mutex(0)
    func fileCutShort(_ file: ServedFile) { cutShort.withLock { $0 += 1 } }
}

@Suite struct CutShortTests {
    @Test(
        "a file cut short on disk after it was opened is answered 503 archive-damaged, never handed to sendfile (which spun the event loop past the end)",
        arguments: ["", "Range: bytes=100000-299999\r\n", "Range: bytes=200000-200009\r\n", "Range: bytes=0-9,200000-299999\r\n"])
    func cutShortFileIsRefused(range: String) throws {
        let resolver = try CutShortResolver(size: 300_000)
        let channel = EmbeddedChannel(handler: ContentFastPath(prefix: "/v1/content/", resolver: resolver))
        let request = "GET /v1/content/ok/p-1.0.zip HTTP/1.1\r\n\(range)\r\n"
        try channel.writeInboundAndRun(ByteBuffer(string: request))
        var served = false
        while let part = try channel.readOutbound(as: IOData.self) { if case .fileRegion = part { served = true } }
        #expect(served || range.contains("200000-200009"), "served from the file while it was whole")

        #expect(truncate(resolver.path, 150_000) == 0)
        try channel.writeInboundAndRun(ByteBuffer(string: request))
        var bytes: [UInt8] = []
        while let part = try channel.readOutbound(as: IOData.self) {
            guard case .byteBuffer(let buffer) = part else {
                Issue.record("a file region of the cut-short file was written")
                continue
            }
            bytes += buffer.readableBytesView
        }
        let text = String(decoding: bytes, as: UTF8.self)
        #expect(text.hasPrefix("HTTP/1.1 503 Service Unavailable\r\n"), "\(text.prefix(200))")
        #expect(text.contains("\"archive-damaged\""))
        // Told, and asked once more (the second answer was the same short file): twice per request.
        #expect(resolver.cutShort.withLock { $0 } == 2 && resolver.resolutions.withLock { $0 } == 3)
        _ = try channel.finish()
    }
}

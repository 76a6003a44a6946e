import Foundation
import Testing
@testable import ContentArchive

@Suite("Joining DEFLATE streams")
struct DeflateJoinTests {
    /// Inputs that make libdeflate choose each kind of block: stored (noise), fixed and dynamic
    /// Huffman, several blocks per stream (text then noise then text), long matches (zeros), and
    /// the smallest inputs.
    static let inputs: [(String, [UInt8])] = {
        let text = Array(logText(lines: 6_000, seed: 11).utf8)
        let noise = Array(pseudoRandomBytes(300_000, seed: 5))
        return [
            ("one byte", [0x41]),
            ("short text", Array("hello hello hello, content pack".utf8)),
            ("zeros", [UInt8](repeating: 0, count: 700_000)),
            ("noise", noise),
            ("text", text),
            ("text, noise, text", Array(text.prefix(200_000)) + noise + Array(text.suffix(200_000))),
            ("floats", (0..<200_000).flatMap { i -> [UInt8] in
                withUnsafeBytes(of: Float(sin(Double(i) * 0.001) * 100).bitPattern.littleEndian, Array.init)
            }),
        ]
    }()

    @Test("the block walker finds the final block exactly where zlib's decompression does, at every level")
    func walkerAgreesWithZlib() throws {
        for level in 1...12 {
            let compressor = DeflateCompressor(level: level)
            for (name, input) in Self.inputs {
                let stream = try #require(input.withUnsafeBytes { compressor.compress($0, limit: .max) })
                let walked = stream.withUnsafeBytes { DeflateBlockWalker.finalBlock(of: $0) }
                let inflated = try DeflateJoin.finalBlockByInflating(stream)
                #expect(walked == inflated, "level \(level), \(name)")
            }
        }
    }

    @Test("the walker refuses truncated or damaged streams instead of guessing")
    func walkerRefusesDamage() throws {
        let compressor = DeflateCompressor(level: 6)
        let input = Array(logText(lines: 3_000, seed: 2).utf8)
        let stream = try #require(input.withUnsafeBytes { compressor.compress($0, limit: .max) })
        for cut in [1, stream.count / 2, stream.count - 1] {
            let truncated = Array(stream.prefix(cut))
            #expect(truncated.withUnsafeBytes { DeflateBlockWalker.finalBlock(of: $0) } == nil, "cut at \(cut)")
        }
        var reserved = stream
        reserved[0] |= 0b110   // block type 3 is reserved
        #expect(reserved.withUnsafeBytes { DeflateBlockWalker.finalBlock(of: $0) } == nil)
        #expect([UInt8]().withUnsafeBytes { DeflateBlockWalker.finalBlock(of: $0) } == nil)
    }

    @Test("streams joined after the walker's rewrite inflate to the concatenated input")
    func joinedStreamsInflate() throws {
        let compressor = DeflateCompressor(level: 6)
        var joined: [UInt8] = []
        var expected: [UInt8] = []
        for (index, (_, input)) in Self.inputs.enumerated() {
            var stream = try #require(input.withUnsafeBytes { compressor.compress($0, limit: .max) })
            if index < Self.inputs.count - 1 { try DeflateJoin.makeContinuable(&stream) }
            joined += stream
            expected += input
        }
        let inflater = try Inflater()
        var output: [UInt8] = []
        var scratch = [UInt8](repeating: 0, count: 1 << 16)
        let consumed = try joined.withUnsafeBytes { input in
            try scratch.withUnsafeMutableBytes { buffer in
                try inflater.feed(input, into: buffer) { output += $0 }
            }
        }
        #expect(inflater.isFinished)
        #expect(consumed == joined.count)
        #expect(output == expected)
    }
}

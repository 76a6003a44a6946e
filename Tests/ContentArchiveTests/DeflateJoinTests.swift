import Foundation
import Testing
@testable import ContentArchive
import CZlib

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

@Suite("Choosing a level per file")
struct LevelChoiceTests {
    static let floats: [UInt8] = (0..<16_384).flatMap { i -> [UInt8] in
        let value = (sin(Double(i) * 0.001) * 100 * 100).rounded() / 100
        return withUnsafeBytes(of: Float(value).bitPattern.littleEndian, Array.init)
    }

    /// The sample compressed at `level` by libdeflate, and by zlib at `zlibLevel`.
    func sizes(_ sample: [UInt8], level: Int, zlibLevel: Int) throws -> (Int, Int) {
        let ours = try #require(sample.withUnsafeBytes { DeflateCompressor(level: level).compress($0, limit: .max) })
        let zlib = sample.withUnsafeBytes { czlibSize($0, zlibLevel) }
        return (ours.count, zlib)
    }

    @Test("each sample gets the fastest level that is no larger than zlib's at the asked level")
    func fastestLevelNoLargerThanZlib() throws {
        let text = Array(logText(lines: 900, seed: 4).utf8.prefix(64 << 10))
        for (name, sample) in [("floats", Self.floats), ("logs", text)] {
            for asked in [1, 4, 6, 9] {
                let choice = sample.withUnsafeBytes { LevelChoice(sample: $0, level: asked) }
                #expect(choice.compressible, "\(name)")
                #expect((1...asked).contains(choice.level), "\(name) at \(asked)")
                let (ours, zlib) = try sizes(sample, level: choice.level, zlibLevel: asked)
                // The asked level itself is the fallback when no faster one is small enough.
                if choice.level < asked { #expect(ours <= zlib, "\(name) at \(asked): level \(choice.level)") }
                for faster in 1..<choice.level {
                    let (size, _) = try sizes(sample, level: faster, zlibLevel: asked)
                    #expect(size > zlib, "\(name) at \(asked): level \(faster) was small enough")
                }
            }
        }
        // Float arrays compress as well at libdeflate's level 2 as at zlib's 6.
        #expect(Self.floats.withUnsafeBytes { LevelChoice(sample: $0, level: 6) }.level < 6)
    }

    @Test("noise is stored; levels 10 to 12 are kept as asked")
    func noiseAndHighLevels() {
        let noise = Array(pseudoRandomBytes(64 << 10, seed: 9))
        #expect(!noise.withUnsafeBytes { LevelChoice(sample: $0, level: 6) }.compressible)
        for level in 10...12 {
            #expect(Self.floats.withUnsafeBytes { LevelChoice(sample: $0, level: level) }.level == level)
        }
    }

    func czlibSize(_ buffer: UnsafeRawBufferPointer, _ level: Int) -> Int {
        czlib_deflated_size(buffer.baseAddress, buffer.count, Int32(level))
    }
}

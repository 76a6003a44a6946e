import CZlib
import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

@Suite("Joining DEFLATE streams", .onTestThreads)
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
            (
                "floats",
                (0..<200_000).flatMap { i -> [UInt8] in
                    withUnsafeBytes(of: Float(sin(Double(i) * 0.001) * 100).bitPattern.littleEndian, Array.init)
                }
            ),
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
        reserved[0] |= 0b110  // block type 3 is reserved
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

@Suite("Choosing compression levels", .onTestThreads)
struct LevelBudgetTests {
    static let floats: [UInt8] = (0..<16_384).flatMap { i -> [UInt8] in
        let value = (sin(Double(i) * 0.001) * 100 * 100).rounded() / 100
        return withUnsafeBytes(of: Float(value).bitPattern.littleEndian, Array.init)
    }
    static let logs = Array(logText(lines: 900, seed: 4).utf8.prefix(64 << 10))
    /// Prose from a small vocabulary, the kind of text on which libdeflate trails zlib.
    static let prose: [UInt8] = {
        let words = "the of and to in is was for on that with as by at from ship engine orbit signal harbour lantern winter river copper".split(separator: " ")
        var state: UInt64 = 7
        var text = ""
        while text.utf8.count < 64 << 10 {
            state = state &* 6364136223846793005 &+ 1442695040888963407
            text += words[Int(state >> 33) % words.count] + " "
        }
        return Array(text.utf8.prefix(64 << 10))
    }()

    func sample(_ bytes: [UInt8], _ level: Int) -> LevelSample {
        bytes.withUnsafeBytes { LevelSample(sample: $0, level: level) }
    }

    /// What the groups come to at `levels`, and what zlib would make of them.
    func estimate(_ groups: [(weight: UInt64, sample: LevelSample)], _ levels: [Int]) -> (ours: Double, zlib: Double) {
        var ours = 0.0, zlib = 0.0
        for (group, level) in zip(groups, levels) {
            let perByte = Double(group.weight) / Double(group.sample.count)
            ours += perByte * Double(group.sample.sizes[level - 1])
            zlib += perByte * Double(group.sample.zlibSize)
        }
        return (ours, zlib)
    }

    /// The budget is met, and no group could take a faster level without breaking it.
    func expectTightWithinBudget(_ groups: [(weight: UInt64, sample: LevelSample)], _ levels: [Int], requested: Int, _ name: String) {
        let (ours, zlib) = estimate(groups, levels)
        #expect(ours <= zlib, "\(name): \(levels)")
        for (index, level) in levels.enumerated() {
            #expect((1...requested).contains(level), "\(name): \(levels)")
            for faster in 1..<level {
                var lowered = levels
                lowered[index] = faster
                #expect(estimate(groups, lowered).ours > zlib, "\(name): group \(index) could take level \(faster) in \(levels)")
            }
        }
    }

    @Test("one kind of content gets the fastest level no larger than zlib's at the asked level")
    func fastestLevelNoLargerThanZlib() throws {
        for (name, bytes) in [("floats", Self.floats), ("logs", Self.logs)] {
            for asked in [1, 4, 6, 9] {
                let measured = sample(bytes, asked)
                #expect(measured.compressible, "\(name)")
                let levels = LevelBudget.choose([(1 << 20, measured)], requested: asked)
                let level = try #require(levels.first)
                let zlib = bytes.withUnsafeBytes { czlib_deflated_size($0.baseAddress, $0.count, Int32(asked)) }
                let ours = try #require(bytes.withUnsafeBytes { DeflateCompressor(level: level).compress($0, limit: .max) }).count
                if measured.sizes.min()! <= zlib {
                    #expect(ours <= zlib, "\(name) at \(asked): level \(level)")
                    for faster in 1..<level {
                        let size = try #require(bytes.withUnsafeBytes { DeflateCompressor(level: faster).compress($0, limit: .max) }).count
                        #expect(size > zlib, "\(name) at \(asked): level \(faster) was small enough")
                    }
                } else {
                    // None is small enough: the smallest output there is.
                    #expect(ours == measured.sizes.min()!, "\(name) at \(asked)")
                }
            }
        }
        // Float arrays compress as well at libdeflate's level 2 as at zlib's 6.
        #expect(LevelBudget.choose([(1 << 20, sample(Self.floats, 6))], requested: 6) == [2])
    }

    @Test("levels are chosen over the whole archive: what one kind saves pays for another")
    func budgetOverTheArchive() {
        let groups: [(weight: UInt64, sample: LevelSample)] = [
            (8 << 20, sample(Self.floats, 6)), (8 << 20, sample(Self.logs, 6)), (8 << 20, sample(Self.prose, 6)),
        ]
        let levels = LevelBudget.choose(groups, requested: 6)
        expectTightWithinBudget(groups, levels, requested: 6, "floats, logs, prose")
        // Each kind held to zlib's size on its own spends at least as much time.
        let alone = groups.map { LevelBudget.choose([$0], requested: 6)[0] }
        let cost = { (levels: [Int]) in levels.reduce(0.0) { $0 + LevelBudget.relativeCost[$1 - 1] } }
        #expect(cost(levels) <= cost(alone), "\(levels) vs \(alone)")
    }

    @Test("on many made-up archives the budget is met and no kind could be faster")
    func madeUpArchives() {
        var state: UInt64 = 42
        func next(_ bound: Int) -> Int {
            state = state &* 6364136223846793005 &+ 1442695040888963407
            return Int(state >> 33) % bound
        }
        for round in 0..<300 {
            let requested = 2 + next(8)
            let groups: [(weight: UInt64, sample: LevelSample)] = (0..<(1 + next(6))).map { _ in
                // Sizes mostly falling with the level, as compressors' do, with ties and reversals.
                var size = 30_000 + next(20_000)
                let sizes = (1...requested).map { _ in
                    size -= next(3_000) - 300
                    return size
                }
                let zlib = sizes[requested - 1] + next(4_000) - 2_000
                return (UInt64(1 + next(100)) << 20, LevelSample(compressible: true, count: 65_536, sizes: sizes, zlibSize: zlib))
            }
            let levels = LevelBudget.choose(groups, requested: requested)
            let best = groups.map { $0.sample.sizes.firstIndex(of: $0.sample.sizes.min()!)! + 1 }
            if estimate(groups, best).ours <= estimate(groups, best).zlib {
                expectTightWithinBudget(groups, levels, requested: requested, "round \(round)")
            } else {
                #expect(estimate(groups, levels).ours == estimate(groups, best).ours, "round \(round): not the smallest when over budget")
            }
        }
    }

    @Test("noise is stored; levels 10 to 12 are kept as asked")
    func noiseAndHighLevels() {
        let noise = Array(pseudoRandomBytes(64 << 10, seed: 9))
        #expect(!sample(noise, 6).compressible)
        #expect(!noise.withUnsafeBytes { DeflateCompressor(level: 1).looksCompressible($0) })
        for level in 10...12 {
            #expect(LevelBudget.choose([(1 << 20, sample(Self.floats, level))], requested: level) == [level])
        }
    }
}

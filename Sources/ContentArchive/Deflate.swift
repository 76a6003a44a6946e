import CLibDeflate
import CZlib

/// CRC-32 (ISO-HDLC, as ZIP uses) through libdeflate's carry-less-multiply implementation.
@inline(__always)
func crc32(_ crc: UInt32, _ buffer: UnsafeRawBufferPointer) -> UInt32 {
    guard let base = buffer.baseAddress, !buffer.isEmpty else { return crc }
    return libdeflate_crc32(crc, base, buffer.count)
}

/// A libdeflate compressor for one thread. libdeflate compresses whole buffers only, which is why
/// large files are cut into independent chunks and joined by ``DeflateJoin``.
final class DeflateCompressor {
    private let handle: OpaquePointer
    let level: Int32
    private var scratch: [UInt8] = []

    init(level: Int) {
        self.level = Int32(level)
        // Allocation fails only when memory is exhausted; there is no sensible recovery then.
        guard let handle = libdeflate_alloc_compressor(Int32(level)) else {
            fatalError("libdeflate could not allocate a compressor for level \(level)")
        }
        self.handle = handle
    }

    deinit { libdeflate_free_compressor(handle) }

    /// Compresses `input` into a complete raw DEFLATE stream, or returns nil when the result
    /// would not be smaller than `limit` bytes. The result is copied out of a reused scratch
    /// buffer at its exact size: results wait in the pipeline's window, and arrays sized for the
    /// worst case doubled the packer's memory.
    func compress(_ input: UnsafeRawBufferPointer, limit: Int) -> [UInt8]? {
        let bound = libdeflate_deflate_compress_bound(handle, input.count)
        if scratch.count < bound { scratch = [UInt8](repeating: 0, count: bound) }
        // The whole bound even under a limit: libdeflate keeps a few bytes of slack and would
        // fail some outputs that fit the limit exactly.
        let written = scratch.withUnsafeMutableBytes { out in
            libdeflate_deflate_compress(handle, input.baseAddress, input.count, out.baseAddress, bound)
        }
        guard written > 0, written < limit else { return nil }
        return Array(scratch[0..<written])
    }

    /// Whether the first bytes of a file shrink enough to be worth deflating at all; incompressible
    /// data (media, already-compressed assets) is stored, which saves the compression time.
    func looksCompressible(_ sample: UnsafeRawBufferPointer) -> Bool {
        guard sample.count >= 64 else { return true }
        guard let compressed = compress(sample, limit: sample.count) else { return false }
        return compressed.count < sample.count - sample.count / 32
    }
}

/// What a sample of some content compresses to: what the level choice works from.
struct LevelSample: Sendable {
    /// False when the sample barely shrinks (by less than 1/32): such content is stored, which
    /// saves the time.
    let compressible: Bool
    /// The sample's size in bytes.
    let count: Int
    /// libdeflate's output at levels 1...requested (index level - 1); empty for levels 10 to 12,
    /// which are asked for size and kept, and for content that is stored.
    let sizes: [Int]
    /// zlib's output at the requested level.
    let zlibSize: Int
}

extension LevelSample {
    /// As the hash cache keeps it: "compressible count zlibSize size1,size2,...".
    var encoded: String {
        "\(compressible ? 1 : 0) \(count) \(zlibSize) \(sizes.map(String.init).joined(separator: ","))"
    }

    /// Decodes ``encoded``; nil for anything else.
    init?(encoded: String) {
        let fields = encoded.split(separator: " ", omittingEmptySubsequences: false)
        guard fields.count == 4, fields[0] == "0" || fields[0] == "1", let count = Int(fields[1]), let zlibSize = Int(fields[2]) else { return nil }
        let sizes = fields[3].isEmpty ? [] : fields[3].split(separator: ",", omittingEmptySubsequences: false).map { Int($0) }
        guard sizes.count <= 9, !sizes.contains(nil) else { return nil }
        self.init(compressible: fields[0] == "1", count: count, sizes: sizes.map { $0! }, zlibSize: zlibSize)
    }

    /// Measures `sample` (in an extension, so that the memberwise initializer stays).
    init(sample: UnsafeRawBufferPointer, level requested: Int) {
        count = sample.count
        guard requested <= 9, sample.count >= 64 else {
            compressible = DeflateCompressor(level: requested).looksCompressible(sample)
            sizes = []
            zlibSize = 0
            return
        }
        let sizes = (1...requested).map { DeflateCompressor(level: $0).compress(sample, limit: .max)?.count ?? Int.max }
        compressible = sizes.min()! < sample.count - sample.count / 32
        self.sizes = compressible ? sizes : []
        zlibSize = compressible ? czlib_deflated_size(sample.baseAddress, sample.count, Int32(requested)) : 0
    }
}

/// Chooses the libdeflate level of each group of content (a large file, or a kind of small files)
/// so that the archive as a whole is no larger than zlib would make it at the requested level,
/// at the least compression time.
///
/// Why a budget over the whole archive rather than a level per file: libdeflate's levels trade
/// differently on different data. On logs and JSON its level 5 is smaller than zlib's 6; on
/// float arrays level 2 is; on plain text no level up to 6 is, and level 6 costs 1.6x level 4's
/// time for 4% of the text's size. Matching zlib file by file spends that time on the text;
/// matching it over the archive spends the bytes the other kinds save.
enum LevelBudget {
    /// libdeflate 1.14's time per input byte at levels 1 to 9 relative to level 1, measured on
    /// logs, JSON and text on x86-64. Fixed rather than timed so that the choice, and so the
    /// archive's bytes, depend only on the content.
    static let relativeCost: [Double] = [1.0, 1.46, 1.69, 1.93, 2.35, 3.1, 4.66, 7.7, 12.9]

    /// Raising one group to `level`: the bytes it saves and the time it costs.
    private struct Step {
        var group: Int
        var level: Int
        var saving: Double
        var cost: Double
        var rate: Double { saving / cost }
    }

    /// The level for each group, weighted by the bytes it stands for. Groups that are stored, or
    /// asked at levels 10 to 12, keep `requested`.
    static func choose(_ groups: [(weight: UInt64, sample: LevelSample)], requested: Int) -> [Int] {
        var levels = [Int](repeating: requested, count: groups.count)
        guard (1...9).contains(requested) else { return levels }
        let eligible = groups.indices.filter {
            let sample = groups[$0].sample
            return sample.compressible && sample.sizes.count == requested && sample.count > 0 && groups[$0].weight > 0
        }
        func estimate(_ group: Int, _ level: Int) -> Double {
            let (weight, sample) = groups[group]
            return Double(weight) * Double(sample.sizes[level - 1]) / Double(sample.count)
        }
        let budget = eligible.reduce(0.0) { total, group in
            let (weight, sample) = groups[group]
            return total + Double(weight) * Double(sample.zlibSize) / Double(sample.count)
        }
        for group in eligible { levels[group] = 1 }
        var total = eligible.reduce(0.0) { $0 + estimate($1, 1) }
        while total > budget {
            // Each step raises one group's level. When one step is enough, the cheapest such step;
            // otherwise the step that saves the most bytes per unit of time.
            var steepest: Step?
            var finishing: Step?
            for group in eligible where levels[group] < requested {
                let from = levels[group]
                for level in (from + 1)...requested {
                    let saving = estimate(group, from) - estimate(group, level)
                    guard saving > 0 else { continue }
                    let cost = Double(groups[group].weight) * (relativeCost[level - 1] - relativeCost[from - 1])
                    let step = Step(group: group, level: level, saving: saving, cost: cost)
                    if total - saving <= budget, finishing.map({ cost < $0.cost }) ?? true {
                        finishing = step
                    }
                    if steepest.map({ step.rate > $0.rate }) ?? true {
                        steepest = step
                    }
                }
            }
            guard let step = finishing ?? steepest else { break }
            levels[step.group] = step.level
            total -= step.saving
        }
        // The steep steps may have overshot: lower any group whose bytes are no longer needed.
        var lowered = total <= budget
        while lowered {
            lowered = false
            for group in eligible {
                for level in 1..<levels[group] {
                    let growth = estimate(group, level) - estimate(group, levels[group])
                    if total + growth <= budget {
                        levels[group] = level
                        total += growth
                        lowered = true
                        break
                    }
                }
            }
        }
        return levels
    }
}

/// Joins independently compressed DEFLATE streams into one, the way zlib's `examples/gzjoin.c`
/// does: clear the final-block bit of every stream but the last, then byte-align with an empty
/// stored block. This is what lets both cores compress one large file while libdeflate, which has
/// no flush, does the compressing.
enum DeflateJoin {
    /// Rewrites `stream` (a complete raw DEFLATE stream) so that another stream may follow it.
    static func makeContinuable(_ stream: inout [UInt8]) throws(ArchiveError) {
        let walked = stream.withUnsafeBytes { DeflateBlockWalker.finalBlock(of: $0) }
        let final: FinalBlock
        if let walked { final = walked } else { final = try finalBlockByInflating(stream) }
        stream[final.headerByte] &= ~(UInt8(1) << UInt8(final.headerBit))
        // Zero the padding after the last code, then append an empty stored block (3 header bits
        // of zero, padding, LEN=0, NLEN=0xFFFF) so the next stream starts on a byte boundary.
        if final.unusedBitsAtEnd > 0 {
            stream[stream.count - 1] &= UInt8((1 << (8 - final.unusedBitsAtEnd)) - 1)
        }
        if final.unusedBitsAtEnd < 3 { stream.append(0) }
        stream.append(contentsOf: [0x00, 0x00, 0xFF, 0xFF])
    }

    /// The final block's position found by decompressing with zlib: the slow reference that
    /// ``DeflateBlockWalker`` is tested against, and its fallback.
    static func finalBlockByInflating(_ stream: [UInt8]) throws(ArchiveError) -> FinalBlock {
        var stream = stream
        var z = z_stream()
        guard czlib_inflate_init_raw(&z) == Z_OK else {
            throw .io("zlib could not start a decompressor (out of memory?)")
        }
        defer { inflateEnd(&z) }
        var scratch = [UInt8](repeating: 0, count: 64 * 1024)
        // Bit position (byte index, bit index) of the header of the block being decoded.
        var header = (byte: 0, bit: 0)
        var unusedBitsAtEnd = 0
        let total = stream.count
        let status: Int32 = stream.withUnsafeMutableBufferPointer { input in
            z.next_in = input.baseAddress
            z.avail_in = UInt32(input.count)
            return scratch.withUnsafeMutableBufferPointer { out in
                while true {
                    z.next_out = out.baseAddress
                    z.avail_out = UInt32(out.count)
                    let result = inflate(&z, Z_BLOCK)
                    guard result == Z_OK || result == Z_BUF_ERROR || result == Z_STREAM_END else { return result }
                    // Bit 128: stopped at a block boundary; bit 64: the block just decoded was the last.
                    if z.data_type & 128 != 0 || result == Z_STREAM_END {
                        let consumed = total - Int(z.avail_in)
                        let unused = Int(z.data_type & 7)
                        if z.data_type & 64 != 0 || result == Z_STREAM_END {
                            unusedBitsAtEnd = unused
                            return Z_STREAM_END
                        }
                        // The next block's header starts right after the bits consumed so far.
                        header = unused == 0 ? (consumed, 0) : (consumed - 1, 8 - unused)
                    }
                    if z.avail_in == 0 && z.avail_out != 0 { return Z_DATA_ERROR }
                }
            }
        }
        guard status == Z_STREAM_END, z.avail_in == 0 else {
            throw .io("internal error: a compressed chunk did not decode back (zlib status \(status)); please report this")
        }
        return FinalBlock(headerByte: header.byte, headerBit: header.bit, unusedBitsAtEnd: unusedBitsAtEnd)
    }
}

/// Streaming raw-DEFLATE decompression with zlib, so memory stays flat whatever the entry size.
final class Inflater {
    private var stream = z_stream()
    private var finished = false

    init() throws(ArchiveError) {
        guard czlib_inflate_init_raw(&stream) == Z_OK else {
            throw .io("zlib could not start a decompressor (out of memory?)")
        }
    }

    deinit { inflateEnd(&stream) }

    var isFinished: Bool { finished }

    /// Feeds compressed bytes; calls `emit` with each piece of output. Returns the number of
    /// input bytes consumed (less than all only once the stream has ended).
    func feed(
        _ input: UnsafeRawBufferPointer, into output: UnsafeMutableRawBufferPointer,
        emit: (UnsafeRawBufferPointer) throws(ArchiveError) -> Void
    ) throws(ArchiveError) -> Int {
        guard !finished, let base = input.baseAddress, !input.isEmpty else { return 0 }
        stream.next_in = UnsafeMutablePointer(mutating: base.assumingMemoryBound(to: UInt8.self))
        stream.avail_in = UInt32(input.count)
        while true {
            stream.next_out = output.baseAddress!.assumingMemoryBound(to: UInt8.self)
            stream.avail_out = UInt32(output.count)
            let result = inflate(&stream, Z_NO_FLUSH)
            let produced = output.count - Int(stream.avail_out)
            if produced > 0 { try emit(UnsafeRawBufferPointer(rebasing: output[0..<produced])) }
            switch result {
            case Z_STREAM_END:
                finished = true
                return input.count - Int(stream.avail_in)
            case Z_OK, Z_BUF_ERROR:
                if stream.avail_in == 0 && stream.avail_out != 0 { return input.count }
                if result == Z_BUF_ERROR && produced == 0 {
                    throw .corrupt("compressed data is damaged (it cannot make progress)")
                }
            default:
                throw .corrupt("compressed data is damaged (zlib: \(stream.msg.map { String(cString: $0) } ?? String(cString: zError(result))))")
            }
        }
    }
}

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

/// What to do with one large file, judged from a sample of its first bytes.
struct LevelChoice: Sendable {
    /// False when the sample barely shrinks: the file is then stored, which saves the time.
    let compressible: Bool
    /// The libdeflate level to compress it with.
    private(set) var level: Int

    /// For levels 1 to 9, the fastest libdeflate level whose output on the sample is no larger
    /// than zlib's at `requested` (libdeflate's lower levels often match zlib's higher ones: on
    /// float arrays level 2 matches zlib's 6, on logs and JSON level 5 does, at 1.3-1.4x the
    /// speed); `requested` itself when none does. Levels 10 to 12 are asked for size and kept.
    init(sample: UnsafeRawBufferPointer, level requested: Int) {
        let atRequested = DeflateCompressor(level: requested)
        compressible = atRequested.looksCompressible(sample)
        level = requested
        guard compressible, requested <= 9, sample.count >= 64 else { return }
        let zlibSize = czlib_deflated_size(sample.baseAddress, sample.count, Int32(requested))
        guard zlibSize > 0 else { return }
        for candidate in 1..<requested {
            if DeflateCompressor(level: candidate).compress(sample, limit: zlibSize + 1) != nil {
                level = candidate
                return
            }
        }
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
    func feed(_ input: UnsafeRawBufferPointer, into output: UnsafeMutableRawBufferPointer,
              emit: (UnsafeRawBufferPointer) throws(ArchiveError) -> Void) throws(ArchiveError) -> Int {
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

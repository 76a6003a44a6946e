/// Where the last block of a raw DEFLATE stream begins and how many padding bits its last byte has.
struct FinalBlock: Equatable, Sendable {
    /// Position of the final block's BFINAL bit.
    var headerByte: Int
    var headerBit: Int
    /// Unused (padding) bits at the top of the stream's last byte, 0...7.
    var unusedBitsAtEnd: Int
}

/// Walks the blocks of a complete raw DEFLATE stream, decoding Huffman symbols without producing
/// any output, to find the final block's header.
///
/// Why our own: joining libdeflate's chunk streams needs that one bit position, and neither
/// libdeflate nor zlib reports it without a full decompression; zlib's `inflate` was a tenth of
/// the packer's CPU. Walking symbols without writing the output is several times cheaper. The
/// input is our own compressor's output, but the walker still checks every bound: on anything
/// unexpected it returns nil and the caller falls back to zlib.
enum DeflateBlockWalker {
    static func finalBlock(of stream: UnsafeRawBufferPointer) -> FinalBlock? {
        guard let base = stream.baseAddress?.assumingMemoryBound(to: UInt8.self), stream.count > 0 else { return nil }
        var reader = BitReader(base: base, count: stream.count)
        var litlen = HuffmanTable()
        var distance = HuffmanTable()
        var lengths = [UInt8](repeating: 0, count: 288 + 32)
        while true {
            reader.refill()
            let header = reader.consumedBits
            let isFinal = reader.take(1) == 1
            switch reader.take(2) {
            case 0:
                guard reader.skipStoredBlock() else { return nil }
            case 1:
                guard walkSymbols(&reader, litlen: Fixed.litlen, distance: Fixed.distance) else { return nil }
            case 2:
                guard readDynamicHeader(&reader, lengths: &lengths, litlen: &litlen, distance: &distance),
                    walkSymbols(&reader, litlen: litlen, distance: distance)
                else { return nil }
            default:
                return nil
            }
            guard reader.consumedBits <= stream.count * 8 else { return nil }
            if isFinal {
                let end = reader.consumedBits
                guard (end + 7) / 8 == stream.count else { return nil }
                return FinalBlock(headerByte: header / 8, headerBit: header % 8, unusedBitsAtEnd: stream.count * 8 - end)
            }
        }
    }

    /// Decodes symbols up to the end-of-block code. Every iteration refills first: one literal or
    /// match takes at most 15 + 5 + 15 + 13 = 48 bits, and a refill leaves at least 56.
    private static func walkSymbols(_ reader: inout BitReader, litlen: HuffmanTable, distance: HuffmanTable) -> Bool {
        // A local copy stays in registers; through the inout every bit operation went to memory.
        var bits = reader
        defer { reader = bits }
        let limit = bits.count &* 8
        while true {
            bits.refill()
            // Each decode also drops the symbol's extra bits: a walker needs no length or distance.
            guard bits.consumedBits <= limit, let symbol = litlen.decode(&bits) else { return false }
            if symbol < 256 { continue }
            if symbol == 256 { return true }
            guard symbol < 286, let d = distance.decode(&bits), d < 30 else { return false }
        }
    }

    /// Extra bits after a length symbol (257-285) and after a distance symbol (RFC 1951 §3.2.5).
    static func lengthExtraBits(_ symbol: Int) -> Int {
        let s = symbol - 257
        return s >= 8 && s < 28 ? (s - 4) >> 2 : 0
    }

    static func distanceExtraBits(_ symbol: Int) -> Int {
        symbol >= 4 && symbol < 30 ? (symbol - 2) >> 1 : 0
    }

    private static let codeLengthOrder = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15]

    private static func readDynamicHeader(
        _ reader: inout BitReader, lengths: inout [UInt8],
        litlen: inout HuffmanTable, distance: inout HuffmanTable
    ) -> Bool {
        reader.refill()
        let literalCount = reader.take(5) + 257
        let distanceCount = reader.take(5) + 1
        let codeLengthCount = reader.take(4) + 4
        guard literalCount <= 286, distanceCount <= 30 else { return false }
        var codeLengthLengths = [UInt8](repeating: 0, count: 19)
        for i in 0..<codeLengthCount {
            reader.refill()
            codeLengthLengths[codeLengthOrder[i]] = UInt8(reader.take(3))
        }
        var codeLengths = HuffmanTable()
        guard codeLengths.build(codeLengthLengths[...]) else { return false }
        let total = literalCount + distanceCount
        var i = 0
        while i < total {
            reader.refill()
            guard let symbol = codeLengths.decode(&reader) else { return false }
            var repeatValue: UInt8 = 0
            var repeatCount: Int
            switch symbol {
            case 0...15:
                lengths[i] = UInt8(symbol)
                i += 1
                continue
            case 16:
                guard i > 0 else { return false }
                repeatValue = lengths[i - 1]
                repeatCount = 3 + reader.take(2)
            case 17:
                repeatCount = 3 + reader.take(3)
            default:
                repeatCount = 11 + reader.take(7)
            }
            guard i + repeatCount <= total else { return false }
            for j in i..<(i + repeatCount) { lengths[j] = repeatValue }
            i += repeatCount
        }
        guard lengths[256] != 0 else { return false }
        return litlen.build(lengths[0..<literalCount], extraBits: lengthExtraBits)
            && distance.build(lengths[literalCount..<total], extraBits: distanceExtraBits)
    }

    private enum Fixed {
        static let litlen: HuffmanTable = {
            var lengths = [UInt8](repeating: 8, count: 288)
            for i in 144..<256 { lengths[i] = 9 }
            for i in 256..<280 { lengths[i] = 7 }
            var table = HuffmanTable()
            _ = table.build(lengths[...], extraBits: lengthExtraBits)
            return table
        }()
        static let distance: HuffmanTable = {
            var table = HuffmanTable()
            _ = table.build([UInt8](repeating: 5, count: 32)[...], extraBits: distanceExtraBits)
            return table
        }()
    }
}

/// LSB-first bit reader over a buffer; reads past the end yield zero bits, which the walker
/// detects by comparing `consumedBits` with the buffer's size.
private struct BitReader {
    let base: UnsafePointer<UInt8>
    let count: Int
    private var position = 0
    private var buffer: UInt64 = 0
    private var available = 0

    init(base: UnsafePointer<UInt8>, count: Int) {
        self.base = base
        self.count = count
    }

    var consumedBits: Int { position &* 8 &- available }

    /// Fills the buffer to at least 56 bits.
    @inline(__always) mutating func refill() {
        if position &+ 8 <= count {
            let word = UInt64(littleEndian: UnsafeRawPointer(base + position).loadUnaligned(as: UInt64.self))
            buffer |= word &<< UInt64(available)
            let bytes = (63 &- available) >> 3
            position &+= bytes
            available &+= bytes &* 8
        } else {
            while available <= 56 {
                let byte: UInt64 = position < count ? UInt64(base[position]) : 0
                buffer |= byte &<< UInt64(available)
                position &+= 1
                available &+= 8
            }
        }
    }

    @inline(__always) func peek(_ n: Int) -> Int { Int(truncatingIfNeeded: buffer & ((1 &<< UInt64(n)) &- 1)) }

    @inline(__always) mutating func drop(_ n: Int) {
        buffer &>>= UInt64(n)
        available &-= n
    }

    @inline(__always) mutating func take(_ n: Int) -> Int {
        let value = peek(n)
        drop(n)
        return value
    }

    /// Skips a stored block whose 3 header bits were just read.
    mutating func skipStoredBlock() -> Bool {
        drop(available & 7)
        refill()
        let length = take(16)
        let complement = take(16)
        guard length ^ complement == 0xFFFF else { return false }
        let next = consumedBits / 8 + length
        guard next <= count else { return false }
        position = next
        buffer = 0
        available = 0
        return true
    }
}

/// A canonical Huffman decoding table: indexed by the next (at most) 10 input bits, each entry
/// holds symbol << 6 | (code length + the symbol's extra bits); 0 marks a bit pattern no code
/// uses and `longCode` one that starts a code longer than the table. Ten bits keep both tables of a block in the L1 cache (a
/// full 15-bit table made every lookup a cache miss); the rare longer codes are decoded bit by bit.
private struct HuffmanTable {
    private static let primaryBits = 10
    private static let longCode: UInt16 = 0xFFC0
    private var entries = [UInt16](repeating: 0, count: 1 << primaryBits)
    private var bits = 0
    /// For the bit-by-bit path: codes per length and the symbols in canonical order.
    private var counts = [Int](repeating: 0, count: 16)
    private var sorted = [UInt16](repeating: 0, count: 288)
    private var extraBits: @Sendable (Int) -> Int = { _ in 0 }

    /// Incomplete codes are accepted (a pattern no code uses decodes to nil); over-full ones are not.
    mutating func build(_ lengths: ArraySlice<UInt8>, extraBits: @escaping @Sendable (Int) -> Int = { _ in 0 }) -> Bool {
        self.extraBits = extraBits
        for i in 0..<16 { counts[i] = 0 }
        for length in lengths { counts[Int(length)] += 1 }
        counts[0] = 0
        guard let longest = counts.lastIndex(where: { $0 > 0 }) else {
            // No codes at all (a block with literals only may have no distance code).
            bits = 0
            entries[0] = 0
            return true
        }
        var left = 1
        for length in 1...15 {
            left = left * 2 - counts[length]
            guard left >= 0 else { return false }
        }
        bits = min(longest, Self.primaryBits)
        let size = 1 << bits
        var offsets = [Int](repeating: 0, count: 16)
        for length in 1..<15 { offsets[length + 1] = offsets[length] + counts[length] }
        var next = [Int](repeating: 0, count: 16)
        var code = 0
        for length in 1...15 {
            code = (code + counts[length - 1]) << 1
            next[length] = code
        }
        let primary = bits
        entries.withUnsafeMutableBufferPointer { table in
            for i in 0..<size { table[i] = 0 }
            for (offset, length) in lengths.enumerated() where length > 0 {
                let len = Int(length)
                sorted[offsets[len]] = UInt16(offset)
                offsets[len] += 1
                let canonical = next[len]
                next[len] += 1
                var reversed = 0
                for b in 0..<len where canonical & (1 << b) != 0 { reversed |= 1 << (len - 1 - b) }
                if len > primary {
                    table[reversed & (size - 1)] = Self.longCode
                    continue
                }
                let entry = UInt16(offset << 6 | (len + extraBits(offset)))
                var index = reversed
                while index < size {
                    table[index] = entry
                    index += 1 << len
                }
            }
        }
        return true
    }

    @inline(__always) func decode(_ reader: inout BitReader) -> Int? {
        let entry = entries.withUnsafeBufferPointer { $0[reader.peek(bits)] }
        let length = Int(entry & 63)
        if length > 0 {
            reader.drop(length)
            return Int(entry >> 6)
        }
        guard entry == Self.longCode, let (symbol, length) = decodeLong(reader.peek(15)) else { return nil }
        reader.drop(length + extraBits(symbol))
        return symbol
    }

    /// Canonical decoding one bit at a time (as zlib's `puff.c` does), for codes over 10 bits:
    /// the symbol and its code length.
    private func decodeLong(_ input: Int) -> (Int, Int)? {
        var code = 0, first = 0, index = 0
        for length in 1...15 {
            code |= (input >> (length - 1)) & 1
            let count = counts[length]
            if code - first < count {
                return (Int(sorted[index + code - first]), length)
            }
            index += count
            first = (first + count) << 1
            code <<= 1
        }
        return nil
    }
}

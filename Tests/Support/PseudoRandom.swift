import Foundation

/// A seeded pseudo-random generator (SplitMix64), so that tests need no fixtures and a failing
/// round can be run again.
public struct SplitMix64: RandomNumberGenerator, Sendable {
    private var state: UInt64

    public init(seed: UInt64) { state = seed }

    public mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}

/// Deterministic pseudo-random bytes (SplitMix64), so tests need no fixtures.
public func pseudoRandomBytes(_ count: Int, seed: UInt64) -> Data {
    var random = SplitMix64(seed: seed)
    var data = Data(count: count)
    data.withUnsafeMutableBytes { raw in
        let bytes = raw.bindMemory(to: UInt8.self)
        var i = 0
        while i < count {
            let z = random.next()
            for b in 0..<8 where i < count {
                bytes[i] = UInt8(truncatingIfNeeded: z >> (8 * UInt64(b)))
                i += 1
            }
        }
    }
    return data
}

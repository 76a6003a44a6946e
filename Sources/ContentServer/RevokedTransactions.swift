/// The revoked transaction ids the content path checks on every request, kept compact.
///
/// Why not a `Set<String>`: the ledger keeps every refund an app ever had, and App Store
/// transaction ids are 16-digit decimals, one byte past what a Swift string holds inline, so each
/// was a heap object of its own: a million revocations took about 100 MiB of a replica's memory.
/// As numbers they take 8 bytes each, and a lookup hashes one word. Ids that are not a plain
/// decimal (a leading zero, letters, over 19 digits) stay strings, so every id maps back exactly.
struct RevokedTransactions: Equatable, Sendable {
    private var numbers = Set<UInt64>()
    private var others = Set<String>()

    init() {}

    init<S: Collection>(_ ids: S) where S.Element == String {
        numbers.reserveCapacity(ids.count)
        for id in ids { insert(id) }
    }

    var count: Int { numbers.count + others.count }

    func contains(_ id: String) -> Bool {
        if let number = Self.number(id) { return numbers.contains(number) }
        return others.contains(id)
    }

    /// Whether `id` was not there before.
    @discardableResult
    mutating func insert(_ id: String) -> Bool {
        if let number = Self.number(id) { return numbers.insert(number).inserted }
        return others.insert(id).inserted
    }

    mutating func remove(_ id: String) {
        if let number = Self.number(id) { numbers.remove(number) } else { others.remove(id) }
    }

    /// `id` as a number when it is the number's only spelling: 1 to 19 decimal digits, no
    /// leading zero (10^19 - 1 fits a UInt64).
    static func number(_ id: String) -> UInt64? {
        var id = id
        return id.withUTF8 { bytes -> UInt64? in
            guard !bytes.isEmpty, bytes.count <= 19, bytes[0] != UInt8(ascii: "0") || bytes.count == 1 else { return nil }
            var value: UInt64 = 0
            for byte in bytes {
                guard byte &- UInt8(ascii: "0") < 10 else { return nil }
                value = value &* 10 &+ UInt64(byte &- UInt8(ascii: "0"))
            }
            return value
        }
    }
}

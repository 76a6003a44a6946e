import IAPProtocol

/// A content version: integers separated by periods (`1.0`, `1.2.3`), as Apple's hosted content used.
///
/// Versions order numerically component by component, missing components counting as zero,
/// so `1.10` is newer than `1.9` and `1.0` sorts with `1.0.0`.
public struct ContentVersion: Sendable, Hashable, Comparable, CustomStringConvertible, Codable {
    /// The version exactly as written.
    public let string: String
    /// The numeric components.
    public let components: [UInt32]

    /// Parses a version, or explains why it is not one.
    public init(_ string: String) throws(ArchiveError) {
        let parts = string.split(separator: ".", omittingEmptySubsequences: false)
        guard !string.isEmpty, parts.count <= 8 else {
            throw .invalid("content version '\(string)' is not valid: use one to eight integers separated by periods, such as 1.0 or 2.3.1")
        }
        var numbers: [UInt32] = []
        for part in parts {
            guard !part.isEmpty, part.count <= 9, part.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }),
                let value = UInt32(part)
            else {
                throw .invalid("content version '\(string)' is not valid: every part must be a whole number of at most 9 digits separated by single periods, such as 1.0 or 2.3.1")
            }
            numbers.append(value)
        }
        self.string = string
        self.components = numbers
    }

    public var description: String { string }

    public static func < (lhs: ContentVersion, rhs: ContentVersion) -> Bool {
        let count = max(lhs.components.count, rhs.components.count)
        for index in 0..<count {
            let l = index < lhs.components.count ? lhs.components[index] : 0
            let r = index < rhs.components.count ? rhs.components[index] : 0
            if l != r { return l < r }
        }
        // Numerically equal spellings ("1.0" and "1.0.0") still need a total order.
        return lhs.string < rhs.string
    }

    /// Whether two versions are numerically the same (`1.0` and `1.0.0`).
    public func isNumericallyEqual(to other: ContentVersion) -> Bool {
        components.trimmingZeros == other.components.trimmingZeros
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        let raw = try container.decode(String.self)
        do { try self.init(raw) } catch {
            throw DecodingError.dataCorruptedError(in: container, debugDescription: error.message)
        }
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.singleValueContainer()
        try container.encode(string)
    }
}

extension Array where Element == UInt32 {
    fileprivate var trimmingZeros: [UInt32] {
        var copy = self
        while copy.last == 0 { copy.removeLast() }
        return copy
    }
}

/// A product identifier: reverse-DNS style, ASCII letters, digits, `.`, `-` and `_`.
public struct ProductIdentifier: Sendable, Hashable, Comparable, CustomStringConvertible, Codable {
    public let rawValue: String

    /// Validates an identifier, or explains what is wrong with it.
    public init(_ rawValue: String) throws(ArchiveError) {
        if let problem = ProductIdentifierRule.problem(rawValue) {
            throw .invalid("product identifier '\(rawValue)' \(problem): \(ProductIdentifierRule.fix)")
        }
        self.rawValue = rawValue
    }

    public var description: String { rawValue }
    public static func < (lhs: Self, rhs: Self) -> Bool { lhs.rawValue < rhs.rawValue }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        let raw = try container.decode(String.self)
        do { try self.init(raw) } catch {
            throw DecodingError.dataCorruptedError(in: container, debugDescription: error.message)
        }
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.singleValueContainer()
        try container.encode(rawValue)
    }
}

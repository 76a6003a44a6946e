/// What a product identifier may hold, for every tool that takes one: the packer (the
/// `IAPProductIdentifier` of an archive) and the sandbox store (what it sells). One rule, so a
/// product the sandbox sells can be packed and served, and a name that could climb out of a
/// folder (`../x`) or split a command line (`a b`) is refused where it enters.
public enum ProductIdentifierRule {
    /// How to write one, for messages.
    public static let fix = "use ASCII letters, digits, '.', '-' and '_' in reverse-DNS style, such as com.example.levels.pack1"

    /// What is wrong with `id`, worded to follow "product identifier '<id>'", or nil when it is
    /// one: 1 to 255 ASCII letters, digits, `.`, `-` and `_`, not starting with `.` or `-`, not
    /// ending with `.`, without `..`.
    public static func problem(_ id: String) -> String? {
        guard !id.isEmpty, id.utf8.count <= 255 else { return "must be 1 to 255 characters long" }
        let allowed = id.utf8.allSatisfy { byte in
            (byte >= 0x30 && byte <= 0x39) || (byte >= 0x41 && byte <= 0x5A) || (byte >= 0x61 && byte <= 0x7A)
                || byte == UInt8(ascii: ".") || byte == UInt8(ascii: "-") || byte == UInt8(ascii: "_")
        }
        guard allowed else { return "has a character that is not allowed" }
        guard let first = id.utf8.first, first != UInt8(ascii: "."), first != UInt8(ascii: "-"), id.utf8.last != UInt8(ascii: "."), !id.contains("..") else {
            return "must not start with '.' or '-', end with '.', or contain '..'"
        }
        return nil
    }
}

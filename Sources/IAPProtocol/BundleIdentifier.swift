/// The app's bundle identifier (`CFBundleIdentifier`) as the tools take it from a flag or the
/// environment. Checked where it enters: a server started with a typo in it (an empty value, a
/// stray space from an environment file) otherwise starts, and then refuses every purchase as
/// another app's.
public enum BundleIdentifier {
    /// What is wrong with `id` as a bundle identifier, or nil when it is one: 1 to 255 ASCII
    /// letters, digits, `-` and `.` (and `_`, which some older apps carry), with no empty part
    /// between periods.
    public static func problem(_ id: String) -> String? {
        if id.isEmpty { return "it is empty" }
        if id.utf8.count > 255 { return "it is \(id.utf8.count) characters long; a bundle identifier has at most 255" }
        for scalar in id.unicodeScalars {
            switch scalar {
            case "a"..."z", "A"..."Z", "0"..."9", "-", ".", "_": continue
            case " ", "\t", "\n", "\r": return "it holds whitespace (a stray space or newline from a file or the environment?)"
            default: return "it holds '\(scalar.escaped(asASCII: true))', which a bundle identifier cannot"
            }
        }
        if id.split(separator: ".", omittingEmptySubsequences: false).contains(where: \.isEmpty) {
            return "it has an empty part between periods"
        }
        return nil
    }

    /// The message a tool gives for a refused `id` from `source` (`--bundle-id`, say), or nil.
    public static func refusal(_ id: String, from source: String) -> String? {
        problem(id).map {
            "\(source) '\(id)' is not a bundle identifier: \($0); use the app's CFBundleIdentifier, such as com.example.app"
        }
    }
}

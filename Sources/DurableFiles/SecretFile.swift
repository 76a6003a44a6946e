#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Files that hold secrets (grant keys, the admin token, an API key): who else may read them.
public enum SecretFile {
    /// A warning when users other than the owner may read `path` (as ssh and libpq warn of a key
    /// file), naming `what` it holds and the fix; nil when only its owner may, or it is missing.
    public static func exposure(_ path: String, holding what: String) -> String? {
        var info = stat()
        guard stat(path, &info) == 0 else { return nil }
        let mode = info.st_mode & 0o777
        let readers = [(mode & 0o044 == 0o044, "its group and every user"), (mode & 0o004 != 0, "every user"), (mode & 0o040 != 0, "its group")]
            .first { $0.0 }?.1
        guard let readers else { return nil }
        return "\(path) holds \(what) and may be read by \(readers) (mode \(String(mode, radix: 8))): chmod 600 \(path)"
    }
}

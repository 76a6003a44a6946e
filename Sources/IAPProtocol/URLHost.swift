/// A host as a URL names it and as a socket takes it: an IPv6 literal is bracketed in a URL
/// (`http://[::1]:8080`) and bare for binding and resolving, and either form is taken from a
/// user (`--host [::1]`). Foundation may keep the brackets in a parsed URL's host, too.
public enum URLHost {
    /// For binding or resolving: `[::1]` → `::1`; anything else as given.
    public static func bare(_ host: String) -> String {
        host.hasPrefix("[") && host.hasSuffix("]") ? String(host.dropFirst().dropLast()) : host
    }

    /// For a URL's authority or a message: `::1` → `[::1]`; a name or IPv4 address as given.
    public static func inURL(_ host: String) -> String {
        let bare = bare(host)
        return bare.contains(":") ? "[\(bare)]" : bare
    }
}

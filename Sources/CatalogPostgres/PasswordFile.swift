import Foundation

/// libpq's password file (`~/.pgpass`, `PGPASSFILE`, or the URL's `passfile`), so that a
/// password need not sit in a URL on the command line, where `ps` shows it to every user.
/// Lines are `host:port:database:user:password`, `*` matching anything, `\:` and `\\` escaping,
/// `#` starting a comment; the first line that matches wins.
struct PasswordFile {
    let path: String

    /// The file libpq would read: `passfile` (in the URL, else `PGPASSFILE`), else `~/.pgpass`.
    static func path(query: [String: String], environment: [String: String]) -> String? {
        query["passfile"] ?? environment["HOME"].map { $0 + "/.pgpass" }
    }

    /// The password for the connection, or nil when the file is missing, matches nothing, or may
    /// be read by others (libpq ignores such a file, with a warning, which `warn` receives).
    func password(host: String, port: Int, database: String, user: String, warn: (String) -> Void) -> String? {
        var status = stat()
        guard stat(path, &status) == 0, status.st_mode & S_IFMT == S_IFREG else { return nil }
        guard status.st_mode & 0o077 == 0 else {
            warn("the password file \(path) may be read by others, so it is not used (as libpq does): chmod 600 it")
            return nil
        }
        guard let text = try? String(contentsOfFile: path, encoding: .utf8) else { return nil }
        // A socket in the default folder is "localhost" to libpq.
        let host = host == "/var/run/postgresql" || host == "/run/postgresql" ? "localhost" : host
        let wanted = [host, String(port), database, user]
        for line in text.split(whereSeparator: \.isNewline) where !line.hasPrefix("#") {
            let fields = Self.fields(line)
            guard fields.count >= 5 else { continue }
            if zip(fields.prefix(4), wanted).allSatisfy({ $0 == "*" || $0 == $1 }) { return fields[4] }
        }
        return nil
    }

    /// The line's fields, split at unescaped colons, with `\` escapes removed.
    private static func fields(_ line: Substring) -> [String] {
        var fields: [String] = [], current = "", escaped = false
        for character in line {
            if escaped {
                current.append(character)
                escaped = false
            } else if character == "\\" {
                escaped = true
            } else if character == ":" && fields.count < 4 {
                fields.append(current)
                current = ""
            } else {
                current.append(character)
            }
        }
        fields.append(current)
        return fields
    }
}

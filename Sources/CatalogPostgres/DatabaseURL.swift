import ContentCatalog
import Foundation
import IAPProtocol
import Logging

/// A `postgres://` URL read as libpq (psql) reads it, so that the URL an operator checked with
/// psql means the same here: the parts, the query parameters libpq knows (`host`, `port`,
/// `user`, `password` and `dbname` among them, which win over the URL's parts), the password
/// from the environment or the password file, and TLS (``DatabaseTLS``).
///
/// A parameter libpq does not know is refused, as psql refuses it: a misspelt `sslmode` must not
/// quietly become the default. One libpq knows that has no meaning here is ignored with a warning.
struct DatabaseURL {
    /// A host name or address, or the folder of a Unix socket.
    let host: String
    let isSocket: Bool
    let port: Int
    let user: String
    let password: String?
    /// nil: the user's name, as the server defaults it.
    let database: String?
    let tls: DatabaseTLS
    let connectTimeout: Duration?
    /// Sent when each connection starts (`application_name`, `options`).
    let startupParameters: [(String, String)]
    /// pgx's `pool_max_conns`, the one parameter libpq does not know that is taken.
    let poolLimit: Int?

    static let hint = "give --database as postgres://user@host:5432/database"

    /// libpq's parameters that are honoured.
    static let honoured: Set = [
        "host", "port", "user", "password", "dbname", "passfile", "sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout",
        "application_name", "options",
    ]
    /// The rest of libpq's (PostgreSQL 17): accepted, without effect here.
    static let ignored: Set = [
        "hostaddr", "channel_binding", "client_encoding", "fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval",
        "keepalives_count", "tcp_user_timeout", "replication", "gssencmode", "requiressl", "sslcompression", "sslpassword", "sslcrl", "sslcrldir",
        "sslsni", "requirepeer", "ssl_min_protocol_version", "ssl_max_protocol_version", "krbsrvname", "gsslib", "gssdelegation", "service",
        "target_session_attrs", "load_balance_hosts", "sslcertmode", "require_auth", "sslnegotiation",
    ]

    /// Where Debian's PostgreSQL puts its socket, libpq's default there.
    static let defaultSocketFolder = "/var/run/postgresql"

    /// The name this process's user logs in with, libpq's default database user.
    static func loginName() -> String? {
        guard let entry = getpwuid(geteuid()), let name = entry.pointee.pw_name else { return nil }
        return String(cString: name)
    }

    /// libpq's environment variables, each the default of a parameter the URL leaves out.
    static let environmentDefaults: [(parameter: String, variable: String)] = [
        ("host", "PGHOST"), ("port", "PGPORT"), ("dbname", "PGDATABASE"), ("user", "PGUSER"), ("password", "PGPASSWORD"),
        ("passfile", "PGPASSFILE"), ("sslmode", "PGSSLMODE"), ("sslrootcert", "PGSSLROOTCERT"), ("sslcert", "PGSSLCERT"), ("sslkey", "PGSSLKEY"),
        ("connect_timeout", "PGCONNECT_TIMEOUT"), ("application_name", "PGAPPNAME"), ("options", "PGOPTIONS"),
    ]

    init(_ url: String, environment: [String: String], logger: Logger) throws(CatalogError) {
        // The URL may hold a password: messages name its parts, never the URL itself.
        guard let parts = URLComponents(string: url), let scheme = parts.scheme, ["postgres", "postgresql"].contains(scheme) else {
            if url.hasPrefix("postgres://") || url.hasPrefix("postgresql://") {
                let authority = url.split(separator: "/", maxSplits: 3, omittingEmptySubsequences: false).dropFirst(2).first ?? ""
                if authority.split(separator: "@").last?.contains(",") == true {
                    throw CatalogError(
                        .storage,
                        "the database URL names several hosts, which iap-server does not take: give one, the primary's or a proxy's in front of the cluster (pgbouncer, HAProxy)"
                    )
                }
                throw CatalogError(.storage, "the database URL does not parse: percent-encode @ : / and spaces in the user and password (%40 %3A %2F %20)")
            }
            let scheme = URLComponents(string: url)?.scheme.map { "'\($0):'" } ?? "no scheme"
            throw CatalogError(.storage, "the database URL (\(scheme)) is not a PostgreSQL URL: \(Self.hint)")
        }
        var query = Dictionary((parts.queryItems ?? []).map { ($0.name, $0.value ?? "") }, uniquingKeysWith: { $1 })
        try Self.checkNames(query, logger: logger)
        // What the URL leaves out, the environment gives, as for psql: query, then the URL's parts, then PG*.
        let inParts: [String: Bool] = [
            "host": parts.host.map { !$0.isEmpty } ?? false, "port": parts.port != nil, "user": parts.user.map { !$0.isEmpty } ?? false,
            "dbname": parts.path.count > 1, "password": parts.password != nil,
        ]
        var fromEnvironment: [String] = []
        for (parameter, variable) in Self.environmentDefaults where query[parameter] == nil && inParts[parameter] != true {
            guard let value = environment[variable], !value.isEmpty else { continue }
            query[parameter] = value
            if parameter != "password" { fromEnvironment.append("\(variable)=\(value)") }
        }
        do {
            try self.init(parts, query, environment: environment, logger: logger)
        } catch {
            guard !fromEnvironment.isEmpty else { throw error }
            throw CatalogError(error.code, error.message + " (from the environment: \(fromEnvironment.joined(separator: ", ")))")
        }
    }

    /// A name libpq does not know is refused; one it knows that has no meaning here is warned of.
    private static func checkNames(_ query: [String: String], logger: Logger) throws(CatalogError) {
        for name in query.keys.sorted() where !Self.honoured.contains(name) && name != "pool_max_conns" {
            guard Self.ignored.contains(name) else {
                throw CatalogError(
                    .storage,
                    "\(name) in the database URL is not a parameter PostgreSQL clients know (psql refuses it too): check its spelling, e.g. sslmode, sslrootcert, connect_timeout, pool_max_conns"
                )
            }
            logger.warning("\(name) in the database URL has no effect here: iap-server does not implement it")
        }
    }

    private init(_ parts: URLComponents, _ query: [String: String], environment: [String: String], logger: Logger) throws(CatalogError) {
        // libpq's defaults for what neither the URL nor the environment gives: the user's own
        // login name, and the server's Unix socket in Debian's folder.
        guard let user = query["user"] ?? parts.user.flatMap({ $0.isEmpty ? nil : $0 }) ?? Self.loginName() else {
            throw CatalogError(.storage, "the database URL names no user, and this process has no login name: \(Self.hint)")
        }
        self.user = user
        let path = parts.path.hasPrefix("/") ? String(parts.path.dropFirst()) : parts.path
        database = query["dbname"] ?? (path.isEmpty ? nil : path)
        // postgres://iap@[::1]/iap: the socket wants the address bare.
        let host = (query["host"] ?? parts.host.flatMap { $0.isEmpty ? nil : $0 }).map(URLHost.bare) ?? Self.defaultSocketFolder
        // A folder is a Unix socket's, as libpq takes it (postgres://user@/db?host=/run/postgresql).
        self.host = host
        isSocket = host.hasPrefix("/")
        if let text = query["port"] {
            guard let port = Int(text), (1...65535).contains(port) else { throw CatalogError(.storage, "port=\(text) in the database URL is not a port number") }
            self.port = port
        } else {
            port = parts.port ?? 5432
        }
        tls = try DatabaseTLS(query: query, home: environment["HOME"])
        // Where psql finds it when the URL holds none: PGPASSWORD, then the password file.
        let (server, port, named) = (self.host, self.port, self.database ?? user)
        password =
            query["password"] ?? parts.password
            ?? PasswordFile.path(query: query, environment: environment).flatMap {
                PasswordFile(path: $0).password(host: server, port: port, database: named, user: user) { logger.warning("\($0)") }
            }
        if let text = query["connect_timeout"] {
            // libpq's rule: 0 or none is no limit (here: the library's own), and at least 2 s.
            guard let seconds = Int(text), seconds >= 0 else {
                throw CatalogError(.storage, "connect_timeout=\(text) in the database URL is not a number of seconds")
            }
            connectTimeout = seconds == 0 ? nil : .seconds(max(seconds, 2))
        } else {
            connectTimeout = nil
        }
        startupParameters = ["application_name", "options"].compactMap { name in query[name].map { (name, $0) } }
        if let text = query["pool_max_conns"] {
            guard let limit = Int(text), (2...1000).contains(limit) else {
                throw CatalogError(
                    .storage,
                    "pool_max_conns=\(text) in the database URL is not a number from 2 to 1000 (one connection listens for refunds, the others answer requests): give, say, pool_max_conns=10"
                )
            }
            poolLimit = limit
        } else {
            poolLimit = nil
        }
    }
}

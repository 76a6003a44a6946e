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

    init(_ url: String, environment: [String: String], logger: Logger) throws(CatalogError) {
        let hint = Self.hint
        // The URL may hold a password: messages name its parts, never the URL itself.
        guard let parts = URLComponents(string: url), let scheme = parts.scheme, ["postgres", "postgresql"].contains(scheme) else {
            let scheme = URLComponents(string: url)?.scheme.map { "'\($0):'" } ?? "no scheme"
            throw CatalogError(.storage, "the database URL (\(scheme)) is not a PostgreSQL URL: \(hint)")
        }
        let query = Dictionary((parts.queryItems ?? []).map { ($0.name, $0.value ?? "") }, uniquingKeysWith: { $1 })
        for name in query.keys.sorted() where !Self.honoured.contains(name) && name != "pool_max_conns" {
            guard Self.ignored.contains(name) else {
                throw CatalogError(
                    .storage,
                    "\(name) in the database URL is not a parameter PostgreSQL clients know (psql refuses it too): check its spelling, e.g. sslmode, sslrootcert, connect_timeout, pool_max_conns"
                )
            }
            logger.warning("\(name) in the database URL has no effect here: iap-server does not implement it")
        }
        guard let user = query["user"] ?? parts.user.flatMap({ $0.isEmpty ? nil : $0 }) else {
            throw CatalogError(.storage, "the database URL names no user: \(hint)")
        }
        self.user = user
        let path = parts.path.hasPrefix("/") ? String(parts.path.dropFirst()) : parts.path
        database = query["dbname"] ?? (path.isEmpty ? nil : path)
        // postgres://iap@[::1]/iap: the socket wants the address bare.
        let host = (query["host"] ?? parts.host.flatMap { $0.isEmpty ? nil : $0 }).map(URLHost.bare)
        guard let host, !host.isEmpty else { throw CatalogError(.storage, "the database URL names no host: \(hint)") }
        // A folder in `host` is a Unix socket's, as libpq takes it (postgres://user@/db?host=/run/postgresql).
        let socket = query["host"].flatMap { $0.hasPrefix("/") ? $0 : nil }
        self.host = socket ?? host
        isSocket = socket != nil
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
            query["password"] ?? parts.password ?? environment["PGPASSWORD"]
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

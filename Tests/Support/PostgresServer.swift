import CatalogPostgres
import ContentCatalog
import Foundation

/// A real PostgreSQL server from Debian's packages (`tools/install-deps.sh` installs them), in a
/// temporary folder on a free loopback port, with trust authentication for user `iap`. As root,
/// it runs as the `postgres` user (PostgreSQL refuses root). A watchdog shell removes it when the
/// test process exits, however it exits: it waits for the end of a pipe only this process holds.
public final class PostgresServer: @unchecked Sendable {
    public let port: Int
    public let folder: String
    private let bin: String
    private let asPostgres: [String]
    private let watchdog: Process
    private let watchdogInput = Pipe()
    /// `-c` settings the server starts with, beyond port, socket folder and address.
    private let settings: [String]

    /// A server that takes TCP connections only over TLS (`hostssl` alone in pg_hba.conf), so a
    /// client that connects at all has encrypted.
    public struct TLS: Sendable {
        /// The server's certificate and key (PEM).
        public var certificate: String, key: String
        /// When set, clients log in with a certificate this authority signed, whose common name
        /// is the user (`cert` authentication), instead of by trust.
        public var clientAuthority: String?

        public init(certificate: String, key: String, clientAuthority: String? = nil) {
            (self.certificate, self.key, self.clientAuthority) = (certificate, key, clientAuthority)
        }
    }

    private actor Shared {
        var starting: Task<PostgresServer, any Error>?
        func server() -> Task<PostgresServer, any Error> {
            if let starting { return starting }
            let task = Task { try await offThread { try PostgresServer() } }
            starting = task
            return task
        }
    }

    private static let sharedServer = Shared()

    /// One server for the whole test process, started on first use; tests take a database each.
    public static func shared() async throws -> PostgresServer { try await sharedServer.server().value }

    /// A server of its own (for a test that stops and restarts it, or one that needs TLS). With
    /// `passwords`, TCP logins need the role's password (`scram-sha-256`), as Debian's default
    /// `pg_hba.conf` asks.
    public static func start(tls: TLS? = nil, passwords: Bool = false) async throws -> PostgresServer {
        try await offThread { try PostgresServer(tls: tls, passwords: passwords) }
    }

    private init(tls: TLS? = nil, passwords: Bool = false) throws {
        let versions = ((try? FileManager.default.contentsOfDirectory(atPath: "/usr/lib/postgresql")) ?? []).sorted { $0.compare($1, options: .numeric) == .orderedDescending }
        guard let version = versions.first(where: { FileManager.default.isExecutableFile(atPath: "/usr/lib/postgresql/\($0)/bin/postgres") }) else {
            throw ServerError(description: "PostgreSQL is not installed: run tools/install-deps.sh (Debian: apt-get install postgresql)")
        }
        bin = "/usr/lib/postgresql/\(version)/bin"
        folder = FileManager.default.temporaryDirectory.path + "/iap-pg-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        asPostgres = getuid() == 0 ? ["/usr/bin/setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"] : []
        if getuid() == 0 { try Self.check(run("/bin/chown", ["postgres:postgres", folder]), "chown") }
        port = try freePort()
        // Only this process may hold the watchdog's pipe open: no child (pg_ctl, postgres) inherits it.
        _ = fcntl(watchdogInput.fileHandleForWriting.fileDescriptor, F_SETFD, FD_CLOEXEC)
        try Self.check(
            run(
                asPostgres.first ?? bin + "/initdb",
                Array(asPostgres.dropFirst()) + (asPostgres.isEmpty ? [] : [bin + "/initdb"]) + ["-D", folder + "/db", "-U", "iap", "--auth=trust", "-E", "UTF8", "--no-sync"]),
            "initdb")
        // The access rules and TLS files a variant asks for, written as PostgreSQL's own user reads them.
        var hba: String?
        var settings: [String] = []
        if let tls {
            // PostgreSQL refuses a key that others may read.
            let key = folder + "/db/server.key", certificate = folder + "/db/server.crt"
            try FileManager.default.copyItem(atPath: tls.key, toPath: key)
            try FileManager.default.copyItem(atPath: tls.certificate, toPath: certificate)
            try FileManager.default.setAttributes([.posixPermissions: 0o600], ofItemAtPath: key)
            settings = ["ssl=on", "ssl_cert_file=\(certificate)", "ssl_key_file=\(key)"]
            if let authority = tls.clientAuthority {
                try FileManager.default.copyItem(atPath: authority, toPath: folder + "/db/client-ca.pem")
                settings.append("ssl_ca_file=\(folder)/db/client-ca.pem")
            }
            hba = "local all all trust\nhostssl all all 127.0.0.1/32 \(tls.clientAuthority == nil ? "trust" : "cert")\n"
        } else if passwords {
            hba = "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
        }
        if let hba {
            try hba.write(toFile: folder + "/db/pg_hba.conf", atomically: true, encoding: .utf8)
            if getuid() == 0 { try Self.check(run("/bin/chown", ["-R", "postgres:postgres", folder + "/db"]), "chown") }
        }
        self.settings = settings
        watchdog = try launch(
            "/bin/sh", ["-c", "read _; \(asPostgres.joined(separator: " ")) \(bin)/pg_ctl -D '\(folder)/db' -m immediate -w stop >/dev/null 2>&1; rm -rf '\(folder)'"],
            stdin: watchdogInput)
        try startBlocking()
    }

    /// Starts the server again after ``stop(mode:)`` and waits until it accepts connections.
    public func restart() async throws { try await offThread { try self.startBlocking() } }

    private func startBlocking() throws {
        // IPv6 loopback too, for database URLs that name [::1].
        let options = ["-p \(port) -k \(folder) -c listen_addresses='127.0.0.1,::1'"] + settings.map { "-c " + $0 }
        try pgCtl(["-l", folder + "/server.log", "-w", "-t", "30", "-o", options.joined(separator: " "), "start"])
    }

    /// Sends `signal` to the server and its backends: `SIGSTOP` freezes it as a hung host would
    /// (connections stay open, nothing answers), `SIGCONT` thaws it.
    public func signal(_ signal: Int32) throws {
        guard let text = try? String(contentsOfFile: folder + "/db/postmaster.pid", encoding: .utf8),
            let first = text.split(separator: "\n").first, let postmaster = Int32(first)
        else { throw ServerError(description: "no postmaster.pid in \(folder)/db: is the server running?") }
        let children = try run("/usr/bin/pgrep", ["-P", String(postmaster)]).stdout.split(separator: "\n").compactMap { Int32($0) }
        for pid in [postmaster] + children { kill(pid, signal) }
    }

    /// Stops the server: `fast` disconnects clients and shuts down cleanly, `immediate` is a crash.
    public func stop(mode: String = "fast") async throws {
        try await offThread { try self.pgCtl(["-m", mode, "-w", "stop"]) }
    }

    /// pg_ctl through bash that first closes every descriptor above 2: Foundation learns that a
    /// child ended when a socket the child inherited closes, and the server pg_ctl leaves running
    /// would otherwise hold it open, so that `run` never returned.
    private func pgCtl(_ arguments: [String]) throws {
        let closeInherited = #"for fd in /proc/$$/fd/*; do n=${fd##*/}; [ "$n" -gt 2 ] && { eval "exec $n>&-"; } 2>/dev/null; done; exec "$@""#
        let command = asPostgres + [bin + "/pg_ctl", "-D", folder + "/db"] + arguments
        try Self.check(run("/bin/bash", ["-c", closeInherited, "pg_ctl"] + command), "pg_ctl \(arguments.last!)")
    }

    /// A new, empty database; its URL for `--database`.
    public func createDatabase() async throws -> String {
        try await offThread { try self.createDatabaseBlocking() }
    }

    private func createDatabaseBlocking() throws -> String {
        let name = "t_" + UUID().uuidString.replacingOccurrences(of: "-", with: "").lowercased()
        try Self.check(run(bin + "/psql", ["-h", folder, "-p", String(port), "-U", "iap", "-d", "postgres", "-q", "-c", "CREATE DATABASE \(name)"]), "CREATE DATABASE")
        return "postgres://iap@127.0.0.1:\(port)/\(name)?sslmode=disable"
    }

    /// Runs SQL with psql and returns what it prints (unaligned, tuples only).
    public func psql(_ url: String, _ sql: String) async throws -> String {
        try await offThread { try self.psqlBlocking(url, sql) }
    }

    private func psqlBlocking(_ url: String, _ sql: String) throws -> String {
        let database = String(url.split(separator: "/").last!.split(separator: "?").first!)
        let result = try run(bin + "/psql", ["-h", folder, "-p", String(port), "-U", "iap", "-d", database, "-At", "-c", sql])
        try Self.check(result, "psql")
        return result.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
    }

    /// Whether `psql` connects with `url` (libpq's reading of it, the reference for ours), and
    /// what it said.
    public func psqlConnects(_ url: String, environment: [String: String] = [:]) async throws -> (connected: Bool, output: String) {
        try await offThread {
            // -w: no password prompt; without a password from the URL or environment, it fails.
            let result = try run(self.bin + "/psql", [url, "-w", "-At", "-c", "SELECT 1"], environment: environment)
            return (result.status == 0, result.stderr + result.stdout)
        }
    }

    deinit { try? watchdogInput.fileHandleForWriting.close() }

    private static func check(_ result: ProcessResult, _ what: String) throws {
        guard result.status == 0 else { throw ServerError(description: "\(what) failed (\(result.status)): \(result.stderr)\(result.stdout)") }
    }
}

/// Runs blocking work (waiting for child processes) on a thread of its own. Tests run in
/// parallel on Swift's small cooperative pool (two threads here); when every one of them waits
/// for a child, Foundation cannot deliver the child's exit and all of them wait forever.
public func offThread<T: Sendable>(_ work: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        Thread { continuation.resume(with: Result { try work() }) }.start()
    }
}

/// The catalog on `url`, for a test process. Other tests here hold the shared threads for
/// seconds at a time, so each PostgreSQL operation gets a minute, not the server's ten seconds.
public func testCatalog(_ url: String) async throws -> PostgresCatalog {
    try await PostgresCatalog(url: url, operationTimeout: .seconds(60))
}

/// The store in `dir`, with its catalog on `databaseURL` (PostgreSQL) or in `dir`'s SQLite file when nil.
public func openStore(_ dir: String, databaseURL: String?) async throws -> ContentStore {
    guard let databaseURL else { return try ContentStore(dataDirectory: dir) }
    return try ContentStore(dataDirectory: dir, database: try await testCatalog(databaseURL))
}

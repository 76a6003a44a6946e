import ContentCatalog
import Foundation
import IAPProtocol
import Logging
import NIOSSL
import PostgresNIO

/// The catalog, grants ledger, revocations and notifications in PostgreSQL (PostgresNIO), so
/// that several `iap-server` replicas share one state. Migrations run on open under an advisory
/// lock, so replicas starting together migrate once. Revocations are announced with
/// `NOTIFY iap_changes` in the transaction that writes them, so every replica hears of a
/// refund when it commits (``watchRevocations(_:)``).
public final class PostgresCatalog: CatalogDatabase {
    public let location: String
    private let pool: PoolKeeper
    private let keeper: Task<Void, Never>
    private let logger: Logger

    /// The channel changes are announced on; the payload is `+<transactionId>` (revoked),
    /// `-<transactionId>` (restored) or `*<sha256>` (a version was published or removed).
    static let channel = "iap_changes"

    /// Connects to `url` (`postgres://user:password@host:port/database`, with libpq's TLS
    /// parameters (``DatabaseTLS``) and optionally `pool_max_conns=N`: at most N connections, 20
    /// by default) and brings the schema up to date.
    /// `operationTimeout` bounds each operation, waiting for a connection included (PostgresNIO
    /// waits as long as the server is away): a grant request gets its 503 after that long.
    /// `environment` is where libpq's variables (`PGHOST`, `PGPASSWORD`, `PGSSLMODE`, …, see
    /// ``DatabaseURL``) and `HOME` (for `~/.pgpass` and `~/.postgresql`) are read.
    public init(
        url: String, operationTimeout: Duration = .seconds(10), environment: [String: String] = ProcessInfo.processInfo.environment,
        logger: Logger = Logger(label: "iap.catalog.postgres")
    ) async throws(CatalogError) {
        self.operationTimeout = operationTimeout
        let (configuration, probe, tls) = try Self.configuration(url, environment: environment, logger: logger)
        let host = configuration.host.map(URLHost.inURL)
        location = "PostgreSQL at \(host ?? configuration.unixSocketPath ?? "?")\(configuration.port.map { ":\($0)" } ?? "")/\(configuration.database ?? configuration.username)"
        // PostgresNIO logs each failed connection attempt at info; an operator needs the warnings.
        let catalogLogger = logger
        var logger = logger
        if logger.logLevel < .warning { logger.logLevel = .warning }
        self.logger = logger
        // One connection first, so that a wrong address, user or password fails now with the
        // server's reason; the pool would keep retrying it quietly.
        do {
            let connection = try await PostgresConnection.connect(configuration: probe, id: 0, logger: logger)
            try? await connection.close()
        } catch {
            if let refusal = (error as? PSQLError)?.underlying.flatMap({ tls.refusal($0, host: configuration.host ?? "?", port: configuration.port ?? 5432) }) {
                throw CatalogError(.storage, "cannot connect to \(location): \(refusal)")
            }
            throw CatalogError(
                .storage, "cannot connect to \(location): \(Self.describe(error)); check that it runs and that --database is right")
        }
        let pool = await PoolKeeper(configuration: configuration, probe: probe, location: location, poolLogger: logger, logger: catalogLogger)
        self.pool = pool
        keeper = Task { await pool.watch() }
        do {
            try await migrate()
        } catch {
            await close()
            throw error
        }
    }

    /// How many times the pool was found waiting out PostgresNIO's backoff after the database
    /// came back, and replaced (``PoolKeeper``).
    public var poolReplacements: Int { pool.replacements }

    /// False while the database does not answer, as the pool's keeper last found it (it looks
    /// each second while no request holds a connection).
    public var isAnswering: Bool { pool.answering }

    /// The client configuration for a `postgres://` URL, or an error naming what is wrong with it.
    static func configuration(
        _ url: String, environment: [String: String], logger: Logger
    ) throws(CatalogError) -> (PostgresClient.Configuration, PostgresConnection.Configuration, DatabaseTLS) {
        let url = try DatabaseURL(url, environment: environment, logger: logger)
        let probeTLS: PostgresConnection.Configuration.TLS
        do {
            probeTLS = try url.tls.connection()
        } catch {
            throw CatalogError(.storage, "cannot set up TLS for the database with these certificates: \(error)")
        }
        var configuration: PostgresClient.Configuration
        var probe: PostgresConnection.Configuration
        if url.isSocket {
            let path = url.host + "/.s.PGSQL.\(url.port)"
            configuration = .init(unixSocketPath: path, username: url.user, password: url.password, database: url.database)
            probe = .init(unixSocketPath: path, username: url.user, password: url.password, database: url.database)
        } else {
            configuration = .init(host: url.host, port: url.port, username: url.user, password: url.password, database: url.database, tls: url.tls.client)
            probe = .init(host: url.host, port: url.port, username: url.user, password: url.password, database: url.database, tls: probeTLS)
        }
        // A replica that lost the database answers 503 soon rather than holding grant requests.
        configuration.options.connectTimeout = url.connectTimeout ?? .seconds(3)
        if let timeout = url.connectTimeout { probe.options.connectTimeout = .seconds(timeout.components.seconds) }
        configuration.options.additionalStartupParameters = url.startupParameters
        probe.options.additionalStartupParameters = url.startupParameters
        // pgx's name for it: replicas times this must stay under the server's max_connections.
        if let limit = url.poolLimit { configuration.options.maximumConnections = limit }
        return (configuration, probe, url.tls)
    }

    // MARK: Schema

    /// Each migration runs once, in order, in one transaction with the schema version.
    private static let migrations: [[String]] = [
        [
            """
            CREATE TABLE versions (
                product_id TEXT NOT NULL, content_version TEXT NOT NULL, sha256 TEXT NOT NULL,
                size BIGINT NOT NULL, content_length BIGINT NOT NULL, published_at TIMESTAMPTZ NOT NULL,
                manifest_sha256 TEXT, rollout_percent BIGINT, rolled_back_at TIMESTAMPTZ,
                PRIMARY KEY (product_id, content_version))
            """,
            """
            CREATE TABLE grants (
                transaction_id TEXT PRIMARY KEY, original_transaction_id TEXT, product_id TEXT NOT NULL,
                environment TEXT, first_granted_at TIMESTAMPTZ NOT NULL, last_granted_at TIMESTAMPTZ NOT NULL)
            """,
            "CREATE TABLE revocations (transaction_id TEXT PRIMARY KEY, revoked_at TIMESTAMPTZ NOT NULL, notification_uuid TEXT)",
            """
            CREATE TABLE notifications (
                uuid TEXT PRIMARY KEY, type TEXT NOT NULL, subtype TEXT, transaction_id TEXT,
                received_at TIMESTAMPTZ NOT NULL, signed_payload TEXT NOT NULL)
            """,
        ],
        ["ALTER TABLE versions ADD COLUMN origin_url TEXT"],
        ["ALTER TABLE versions ADD COLUMN removed_at TIMESTAMPTZ"],
        [
            // Raised by every statement that writes the table each counts, whoever runs it
            // (ChangeCounter); the row lock orders concurrent writers, so a counter follows commit order.
            "CREATE TABLE change_counters (name TEXT PRIMARY KEY, version BIGINT NOT NULL)",
            "INSERT INTO change_counters (name, version) VALUES ('revocations', 0), ('versions', 0)",
            """
            CREATE FUNCTION iap_count_change() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN UPDATE change_counters SET version = version + 1 WHERE name = TG_TABLE_NAME; RETURN NULL; END $$
            """,
            """
            CREATE TRIGGER revocations_counted AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON revocations
            FOR EACH STATEMENT EXECUTE FUNCTION iap_count_change()
            """,
            """
            CREATE TRIGGER versions_counted AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON versions
            FOR EACH STATEMENT EXECUTE FUNCTION iap_count_change()
            """,
        ],
        // Pruning by age (NotificationPruner) finds old rows without reading the table.
        ["CREATE INDEX notifications_received_at ON notifications (received_at)"],
        [
            // Each revocation written carries the counter value its statement raised it to, so a
            // reader adds the rows after its own position (RevocationSnapshot); deletions raise a
            // counter of their own and send readers back to the whole set. The counter is raised
            // before the statement's rows now: its row lock, held to commit, is taken before any
            // row is stamped, so stamps follow commit order as the counter does, and a reader that
            // saw the counter at N finds every row stamped up to N committed.
            "ALTER TABLE revocations ADD COLUMN changed BIGINT",
            "CREATE INDEX revocations_changed ON revocations (changed)",
            "INSERT INTO change_counters (name, version) VALUES ('revocationRemovals', 0)",
            "DROP TRIGGER revocations_counted ON revocations",
            """
            CREATE TRIGGER revocations_counted BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON revocations
            FOR EACH STATEMENT EXECUTE FUNCTION iap_count_change()
            """,
            """
            CREATE FUNCTION iap_stamp_revocation() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN SELECT version INTO NEW.changed FROM change_counters WHERE name = 'revocations'; RETURN NEW; END $$
            """,
            """
            CREATE TRIGGER revocations_stamped BEFORE INSERT OR UPDATE ON revocations
            FOR EACH ROW EXECUTE FUNCTION iap_stamp_revocation()
            """,
            """
            CREATE FUNCTION iap_count_removal() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN UPDATE change_counters SET version = version + 1 WHERE name = 'revocationRemovals'; RETURN NULL; END $$
            """,
            """
            CREATE TRIGGER revocations_removed AFTER DELETE OR TRUNCATE ON revocations
            FOR EACH STATEMENT EXECUTE FUNCTION iap_count_removal()
            """,
        ],
    ]

    private func migrate() async throws(CatalogError) {
        try await run(timeout: Self.openTimeout) { connection, logger in
            try await connection.withTransaction(logger: logger) { connection in
                // Replicas starting together wait here for the first one's migration.
                try await connection.query("SELECT pg_advisory_xact_lock(7291530001)", logger: logger)
                try await connection.query("CREATE TABLE IF NOT EXISTS iap_schema (version BIGINT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())", logger: logger)
                var current = 0
                for try await version in try await connection.query("SELECT COALESCE(MAX(version), 0) FROM iap_schema", logger: logger).decode(Int.self) {
                    current = version
                }
                for (index, statements) in Self.migrations.enumerated() where index + 1 > current {
                    for statement in statements { try await connection.query(PostgresQuery(unsafeSQL: statement), logger: logger) }
                    try await connection.query("INSERT INTO iap_schema (version) VALUES (\(index + 1))", logger: logger)
                }
            }
        }
    }

    // MARK: CatalogDatabase

    public func versions(productId: String?) async throws(CatalogError) -> [PublishedVersion] {
        try await run { connection, logger in
            try await Self.versions(productId: productId, on: connection, logger: logger)
        }
    }

    private static let versionColumns = "product_id, content_version, sha256, size, content_length, published_at, manifest_sha256, rollout_percent, rolled_back_at, origin_url, removed_at"

    private static func versions(productId: String?, on connection: PostgresConnection, logger: Logger) async throws -> [PublishedVersion] {
        var query: PostgresQuery = "SELECT \(unescaped: versionColumns) FROM versions"
        if let productId { query = "SELECT \(unescaped: versionColumns) FROM versions WHERE product_id = \(productId)" }
        var result: [PublishedVersion] = []
        let rows = try await connection.query(query, logger: logger)
        for try await (product, version, sha, size, length, published, manifest, rollout, rolledBack, origin, removed) in rows.decode(
            (String, String, String, Int64, Int64, Date, String?, Int?, Date?, String?, Date?).self)
        {
            result.append(
                PublishedVersion(
                    productId: product, contentVersion: version, sha256: sha, size: size, contentLength: length, publishedAt: published,
                    manifestSHA256: manifest, rolloutPercent: rollout, rolledBackAt: rolledBack, originURL: origin, removedAt: removed))
        }
        return result
    }

    public func insert(
        _ version: PublishedVersion, unless decide: @escaping @Sendable ([PublishedVersion]) throws(CatalogError) -> PublishedVersion?
    ) async throws(CatalogError) -> PublishOutcome {
        try await run { connection, logger in
            try await connection.withTransaction(logger: logger) { connection -> PublishOutcome in
                // One publisher of a product at a time, across replicas: the lock is the product's.
                try await connection.query("SELECT pg_advisory_xact_lock(hashtext(\(version.productId)))", logger: logger)
                let existing = try await Self.versions(productId: version.productId, on: connection, logger: logger)
                if let same = try decide(existing) { return .unchanged(same) }
                try await connection.query(
                    """
                    INSERT INTO versions (product_id, content_version, sha256, size, content_length, published_at, manifest_sha256, rollout_percent, rolled_back_at, origin_url)
                    VALUES (\(version.productId), \(version.contentVersion), \(version.sha256), \(version.size), \(version.contentLength), \(version.publishedAt),
                            \(version.manifestSHA256), \(version.rolloutPercent), \(version.rolledBackAt), \(version.originURL))
                    """, logger: logger)
                try await connection.query("SELECT pg_notify(\(Self.channel), \("*" + version.sha256))", logger: logger)
                return .published(version)
            }
        }
    }

    public func update(
        productId: String, contentVersion: String, _ change: @escaping @Sendable (inout PublishedVersion) -> Void
    ) async throws(CatalogError) -> PublishedVersion {
        try await run { connection, logger in
            try await connection.withTransaction(logger: logger) { connection -> PublishedVersion in
                try await connection.query("SELECT pg_advisory_xact_lock(hashtext(\(productId)))", logger: logger)
                let existing = try await Self.versions(productId: productId, on: connection, logger: logger)
                guard var version = existing.first(where: { $0.contentVersion == contentVersion }) else { throw CatalogError.unpublished(productId, contentVersion) }
                change(&version)
                try await connection.query(
                    """
                    UPDATE versions SET rollout_percent = \(version.rolloutPercent), rolled_back_at = \(version.rolledBackAt), removed_at = \(version.removedAt)
                    WHERE product_id = \(productId) AND content_version = \(contentVersion)
                    """, logger: logger)
                // Replicas read the catalog again at once, to delete the archive and close its handles.
                if version.removedAt != nil { try await connection.query("SELECT pg_notify(\(Self.channel), \("*" + version.sha256))", logger: logger) }
                return version
            }
        }
    }

    public func recordGrant(_ grant: GrantRecord) async throws(CatalogError) {
        try await run { connection, logger in
            try await connection.query(
                """
                INSERT INTO grants (transaction_id, original_transaction_id, product_id, environment, first_granted_at, last_granted_at)
                VALUES (\(grant.transactionId), \(grant.originalTransactionId), \(grant.productId), \(grant.environment), \(grant.grantedAt), \(grant.grantedAt))
                ON CONFLICT (transaction_id) DO UPDATE SET last_granted_at = excluded.last_granted_at
                """, logger: logger)
        }
    }

    public func grantCount() async throws(CatalogError) -> Int {
        try await count("SELECT COUNT(*) FROM grants")
    }

    public func isRevoked(transactionId: String) async throws(CatalogError) -> Bool {
        try await run { connection, logger in
            for try await _ in try await connection.query("SELECT 1 FROM revocations WHERE transaction_id = \(transactionId)", logger: logger) { return true }
            return false
        }
    }

    public func revocations(changedSince known: RevocationPosition?) async throws(CatalogError) -> RevocationSnapshot? {
        try await run { connection, logger in
            // The counters (one statement, one snapshot) before the ids: a write committing in
            // between is in the ids and raises a counter past the one kept, so the next look
            // reads it again; never the other way.
            var version: Int64 = 0, removals: Int64 = 0
            let counters = try await connection.query(
                "SELECT name, version FROM change_counters WHERE name IN (\(ChangeCounter.revocations.rawValue), \(ChangeCounter.revocationRemovals.rawValue))",
                logger: logger)
            for try await (name, value) in counters.decode((String, Int64).self) {
                if name == ChangeCounter.revocations.rawValue { version = value } else { removals = value }
            }
            let now = RevocationPosition(version: version, removals: removals)
            if now == known { return nil }
            var ids = Set<String>()
            if let known, RevocationSnapshot.canAdd(from: known, to: now) {
                for try await id in try await connection.query("SELECT transaction_id FROM revocations WHERE changed > \(known.version)", logger: logger).decode(String.self) {
                    ids.insert(id)
                }
                return RevocationSnapshot(position: now, transactionIds: ids, isComplete: false)
            }
            for try await id in try await connection.query("SELECT transaction_id FROM revocations", logger: logger).decode(String.self) { ids.insert(id) }
            return RevocationSnapshot(position: now, transactionIds: ids, isComplete: true)
        }
    }

    public func changeCounter(_ counter: ChangeCounter) async throws(CatalogError) -> Int64 {
        try await run { connection, logger in try await Self.counter(counter, on: connection, logger: logger) }
    }

    private static func counter(_ counter: ChangeCounter, on connection: PostgresConnection, logger: Logger) async throws -> Int64 {
        for try await value in try await connection.query("SELECT version FROM change_counters WHERE name = \(counter.rawValue)", logger: logger).decode(Int64.self) {
            return value
        }
        return 0
    }

    public func apply(_ n: NotificationRecord) async throws(CatalogError) -> NotificationOutcome {
        try await run { connection, logger in
            try await connection.withTransaction(logger: logger) { connection -> NotificationOutcome in
                // The primary key decides between two replicas given the same notification at once.
                var inserted = false
                for try await _ in try await connection.query(
                    """
                    INSERT INTO notifications (uuid, type, subtype, transaction_id, received_at, signed_payload)
                    VALUES (\(n.uuid), \(n.type), \(n.subtype), \(n.transactionId), \(n.receivedAt), \(n.signedPayload))
                    ON CONFLICT (uuid) DO NOTHING RETURNING 1
                    """, logger: logger)
                {
                    inserted = true
                }
                guard inserted else { return .duplicate }
                if let transactionId = n.transactionId, let revoke = n.revoke {
                    if revoke {
                        try await connection.query(
                            """
                            INSERT INTO revocations (transaction_id, revoked_at, notification_uuid) VALUES (\(transactionId), \(n.revokedAt), \(n.uuid))
                            ON CONFLICT (transaction_id) DO UPDATE SET revoked_at = excluded.revoked_at, notification_uuid = excluded.notification_uuid
                            """, logger: logger)
                    } else {
                        try await connection.query("DELETE FROM revocations WHERE transaction_id = \(transactionId)", logger: logger)
                    }
                    // Delivered to every listener when (and only if) this transaction commits.
                    let payload = (revoke ? "+" : "-") + transactionId
                    try await connection.query("SELECT pg_notify(\(Self.channel), \(payload))", logger: logger)
                }
                return .applied
            }
        }
    }

    public func notificationCount() async throws(CatalogError) -> Int {
        try await count("SELECT COUNT(*) FROM notifications")
    }

    public func pruneNotifications(receivedBefore date: Date, limit: Int) async throws(CatalogError) -> Int {
        try await run { connection, logger in
            var deleted = 0
            let rows = try await connection.query(
                "DELETE FROM notifications WHERE ctid IN (SELECT ctid FROM notifications WHERE received_at < \(date) LIMIT \(limit)) RETURNING 1", logger: logger)
            for try await _ in rows { deleted += 1 }
            return deleted
        }
    }

    /// Listens on `iap_revocations` until cancelled. After every (re)connection it asks for a
    /// resynchronization first, since notifications sent while no connection listened are lost.
    public func watchRevocations(_ onChange: @escaping @Sendable (RevocationChange) -> Void) async -> Bool {
        while !Task.isCancelled {
            do {
                try await pool.withConnection(counted: false) { connection in
                    try await connection.listen(on: Self.channel) { notifications in
                        onChange(.resynchronize)
                        for try await notification in notifications {
                            let value = String(notification.payload.dropFirst())
                            switch notification.payload.first {
                            case "+": onChange(.revoked(transactionId: value))
                            case "-": onChange(.restored(transactionId: value))
                            case "*": onChange(.published(sha256: value))
                            default: onChange(.resynchronize)
                            }
                        }
                    }
                }
            } catch {
                if Task.isCancelled { break }
                logger.warning("listening for revocations failed, listening again", metadata: ["error": "\(Self.describe(error))"])
                // Back off a little while the database is away; the periodic refresh covers the gap.
                try? await Task.sleep(for: .milliseconds(250))
            }
        }
        return true
    }

    public func close() async {
        keeper.cancel()
        await keeper.value
        await pool.close()
    }

    // MARK: Helpers

    private func count(_ sql: String) async throws(CatalogError) -> Int {
        try await run { connection, logger in
            for try await value in try await connection.query(PostgresQuery(unsafeSQL: sql), logger: logger).decode(Int.self) { return value }
            return 0
        }
    }

    private let operationTimeout: Duration
    /// Opening waits longer: replicas starting together queue for the migration lock.
    static let openTimeout: Duration = .seconds(60)
    /// How long an operation waits while the pool's keeper knows the database away, instead of
    /// the operation timeout: each of a request's questions waited that out (a grant's 503 came
    /// after 30 s). Any lease ends the outage (``PoolKeeper``), so a database back is used at once.
    static let awayTimeout: Duration = .seconds(1)

    @discardableResult
    private func run<T: Sendable>(
        timeout: Duration? = nil, _ body: @escaping @Sendable (PostgresConnection, Logger) async throws -> T
    ) async throws(CatalogError) -> T {
        let logger = logger, away = !pool.answering
        let timeout = away ? min(timeout ?? operationTimeout, Self.awayTimeout) : timeout ?? operationTimeout
        do {
            return try await pool.withConnection(deadline: timeout) { connection in try await body(connection, logger) }
        } catch let error as CatalogError {
            throw error
        } catch let error as PostgresTransactionError where error.closureError is CatalogError {
            // A decision inside the transaction (a conflict, an unknown version), rolled back.
            throw error.closureError as! CatalogError
        } catch is PoolKeeper.DeadlinePassed {
            let waited = away ? "does not answer (asked for \(timeout) while it is away)" : "did not answer within \(timeout)"
            throw CatalogError(.storage, "\(location) \(waited): check that it runs and that --database is right")
        } catch {
            // The server's own refusal needs no guess about whether it runs.
            let answered = Self.serverInfo(error) != nil
            throw CatalogError(.storage, "\(location) failed: \(Self.describe(error))" + (answered ? "" : "; check that it runs and that --database is right"))
        }
    }

    /// The server's error fields, when the server itself refused (not the network or the client).
    static func serverInfo(_ error: any Error) -> PSQLError.ServerInfo? {
        if let error = error as? PostgresTransactionError {
            return (error.closureError ?? error.beginError ?? error.commitError ?? error.rollbackError).flatMap(serverInfo)
        }
        return (error as? PSQLError)?.serverInfo
    }

    /// PSQLError's own description hides the server's message (it may hold data); ours names
    /// what an operator needs: the server's message and SQL state, or the connection problem.
    static func describe(_ error: any Error) -> String {
        if let error = error as? PostgresTransactionError {
            guard let cause = error.closureError ?? error.beginError ?? error.commitError ?? error.rollbackError else { return "a transaction failed" }
            return describe(cause)
        }
        guard let error = error as? PSQLError else { return "\(error)" }
        switch error.code {
        case .authMechanismRequiresPassword:
            return "the server asks for a password and the database URL gives none: postgres://user:password@host:5432/database (percent-encode @ : / in it), or PGPASSWORD or ~/.pgpass as for psql"
        case .sslUnsupported:
            return "the server does not offer TLS, which the database URL's sslmode asks for: turn ssl on in postgresql.conf, or use sslmode=prefer"
        case .unsupportedAuthMechanism:
            let method = error.underlying.map { "\($0)" } ?? "see the server's pg_hba.conf"
            return "the server asks for an authentication method this client does not speak (\(method)): use scram-sha-256 or md5 in pg_hba.conf"
        default:
            break
        }
        if let info = error.serverInfo, let message = info[.message] {
            let state = info[.sqlState]
            // PostgreSQL 15 lets only the database's owner create tables in its public schema.
            let fix =
                state == "42501"
                ? ": the database user lacks a privilege the catalog needs; make it the database's owner (ALTER DATABASE <database> OWNER TO <user>, or createdb -O <user>)"
                : ""
            return message + (state.map { " (SQLSTATE \($0))" } ?? "") + fix
        }
        if let underlying = error.underlying {
            // NIO's connection errors list every address tried; the reason is what helps.
            let text = "\(underlying)"
            for (needle, reason) in [("Connection refused", "connection refused"), ("timed out", "connection timed out"), ("No route to host", "no route to host")]
            where text.contains(needle) {
                return reason
            }
            return "\(error.code): \(text)"
        }
        return "\(error.code)"
    }
}

import CatalogPostgres
import ContentCatalog
import Foundation
import IAPTestSupport
import Testing

/// The database URL read as libpq (psql) reads it: an operator's URL that works with psql works
/// with --database. The TLS servers here take TCP connections over TLS only (`hostssl` alone in
/// pg_hba.conf), so a connection that opens at all was encrypted.
@Suite("The database URL, read as libpq reads it")
struct DatabaseURLTests {
    @Test("every sslmode, with and without sslrootcert, connects exactly where psql does")
    func agreesWithPsql() async throws {
        let folder = try TemporaryFolder()
        let authority = try TestCertificates(folder: folder.sub("ca"))
        let stranger = try TestCertificates(folder: folder.sub("stranger"))
        let (certificate, key) = try authority.server("db", names: ["IP:127.0.0.1", "DNS:localhost"])
        let server = try await PostgresServer.start(tls: .init(certificate: certificate, key: key))
        let database = try Self.databaseName(try await server.createDatabase())
        let trusted = "sslrootcert=" + authority.authority, untrusted = "sslrootcert=" + stranger.authority
        let cases: [(host: String, query: String, connects: Bool)] = [
            // prefer (the default), allow and require encrypt without checking, as libpq does:
            // the authority here is the test's own, which no system trusts.
            ("127.0.0.1", "", true),
            ("127.0.0.1", "sslmode=prefer", true),
            ("127.0.0.1", "sslmode=allow", true),
            ("127.0.0.1", "sslmode=require", true),
            // The server takes no unencrypted connection.
            ("127.0.0.1", "sslmode=disable", false),
            // With an authority named, every mode checks against it.
            ("127.0.0.1", "sslmode=require&\(trusted)", true),
            ("127.0.0.1", "sslmode=require&\(untrusted)", false),
            ("127.0.0.1", "sslmode=prefer&\(untrusted)", false),
            ("127.0.0.1", "sslmode=verify-ca&\(trusted)", true),
            ("127.0.0.1", "sslmode=verify-ca&\(untrusted)", false),
            ("127.0.0.1", "sslmode=verify-full&\(trusted)", true),
            ("localhost", "sslmode=verify-full&\(trusted)", true),
            ("127.0.0.1", "sslmode=verify-full&sslrootcert=system", false),
        ]
        for (host, query, connects) in cases {
            let url = "postgres://iap@\(host):\(server.port)/\(database)" + (query.isEmpty ? "" : "?" + query)
            // This machine's own environment on both sides (its ~/.postgresql, if any).
            let refusal = try await Self.expectAgreement(server, url, environment: ProcessInfo.processInfo.environment, connects: connects)
            #expect(refusal?.contains("BoringSSL") != true, "\(refusal ?? "")")
        }
    }

    @Test("a refused certificate is named with what to change; so is a URL that cannot work")
    func refusalsSayWhatToChange() async throws {
        let folder = try TemporaryFolder()
        let authority = try TestCertificates(folder: folder.sub("ca"))
        let stranger = try TestCertificates(folder: folder.sub("stranger"))
        let (certificate, key) = try authority.server("db", names: ["DNS:db.internal"])
        let server = try await PostgresServer.start(tls: .init(certificate: certificate, key: key))
        let base = "postgres://iap@127.0.0.1:\(server.port)/\(try Self.databaseName(try await server.createDatabase()))?"

        let otherName = try await #require(throws: CatalogError.self) {
            try await PostgresCatalog(url: base + "sslmode=verify-full&sslrootcert=" + authority.authority)
        }
        #expect(otherName.message.contains("does not hold the name 127.0.0.1"), "\(otherName.message)")
        #expect(otherName.message.contains("sslmode=verify-ca"), "\(otherName.message)")
        // The name aside, the authority is right.
        await (try await PostgresCatalog(url: base + "sslmode=verify-ca&sslrootcert=" + authority.authority)).close()

        let untrusted = try await #require(throws: CatalogError.self) {
            try await PostgresCatalog(url: base + "sslmode=verify-ca&sslrootcert=" + stranger.authority)
        }
        #expect(untrusted.message.contains("not signed by sslrootcert=\(stranger.authority)"), "\(untrusted.message)")
        #expect(untrusted.message.contains("openssl s_client -starttls postgres -connect 127.0.0.1:\(server.port)"), "\(untrusted.message)")

        let notPEM = folder.path + "/ca.der"
        try Data([0x30, 0x82, 0x01, 0x00]).write(to: URL(fileURLWithPath: notPEM))
        for (query, expected) in [
            ("sslmode=verify-ca", "names no authority to check it against: add sslrootcert=<file>"),
            ("sslmode=verify-full", "names no authority to check it against: add sslrootcert=<file>"),
            ("sslmode=require&sslrootcert=system", "sslrootcert=system in the database URL needs sslmode=verify-full"),
            (
                "sslmode=verify-ca&sslrootcert=\(folder.path)/missing.pem",
                "cannot read the certificate authority file \(folder.path)/missing.pem: check the path given to sslrootcert in the database URL"
            ),
            ("sslmode=verify-ca&sslrootcert=\(notPEM)", "holds no PEM certificate"),
            ("sslmode=verify-ca&sslrootcert=\(authority.authority)&sslcert=\(folder.path)/missing.pem", "cannot read a PEM client certificate"),
            ("sslmode=always", "is not one of disable, allow, prefer, require, verify-ca, verify-full"),
        ] {
            let error = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: base + query) }
            #expect(error.message.contains(expected), "\(query): \(error.message)")
        }
    }

    @Test("sslcert and sslkey log in where the server asks for a client certificate")
    func clientCertificate() async throws {
        let folder = try TemporaryFolder()
        let authority = try TestCertificates(folder: folder.sub("ca"))
        let (certificate, key) = try authority.server("db", names: ["IP:127.0.0.1"])
        let server = try await PostgresServer.start(tls: .init(certificate: certificate, key: key, clientAuthority: authority.authority))
        let base = "postgres://iap@127.0.0.1:\(server.port)/\(try Self.databaseName(try await server.createDatabase()))?sslmode=verify-full&sslrootcert=\(authority.authority)"
        let login = try authority.client("iap")

        let url = base + "&sslcert=\(login.certificate)&sslkey=\(login.key)"
        // A key others may read is refused, by psql and here alike (the authority's helper
        // leaves keys readable for nginx's workers).
        let exposed = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: url) }
        #expect(exposed.message.contains("may be read by others: chmod 600 it"), "\(exposed.message)")
        #expect(try await server.psqlConnects(url).output.contains("has group or world access"))
        try FileManager.default.setAttributes([.posixPermissions: 0o600], ofItemAtPath: login.key)
        let viaPsql = try await server.psqlConnects(url)
        #expect(viaPsql.connected, "\(viaPsql.output)")
        await (try await PostgresCatalog(url: url)).close()

        // Without one, the server's own reason.
        let refused = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: base) }
        #expect(refused.message.contains("certificate"), "\(refused.message)")
        #expect(!(try await server.psqlConnects(base).connected))

        let keyless = try await #require(throws: CatalogError.self) {
            try await PostgresCatalog(url: base + "&sslcert=\(login.certificate)&sslkey=\(folder.path)/none.key")
        }
        #expect(keyless.message.contains("cannot read the client certificate's private key from \(folder.path)/none.key"), "\(keyless.message)")
    }

    @Test("a password from the URL, PGPASSWORD or the password file, where psql finds it")
    func passwords() async throws {
        let folder = try TemporaryFolder()
        let server = try await PostgresServer.start(passwords: true)
        let created = try await server.createDatabase()
        let database = try Self.databaseName(created)
        // @, : and / must be percent-encoded in a URL, and a colon escaped with \ in the password file.
        _ = try await server.psql(created, "CREATE ROLE app LOGIN PASSWORD 'p@ss:w/rd'")
        let bare = "postgres://app@127.0.0.1:\(server.port)/\(database)"
        let home = folder.path + "/home"
        try FileManager.default.createDirectory(atPath: home, withIntermediateDirectories: true)
        // Nothing from this machine's own environment: an empty home, no PGPASSWORD.
        let isolated = ["HOME": home]

        // Logged in, but PostgreSQL 15 lets only the database's owner create the catalog's tables.
        let notOwner = try await #require(throws: CatalogError.self) {
            try await PostgresCatalog(url: "postgres://app:p%40ss%3Aw%2Frd@127.0.0.1:\(server.port)/\(database)", environment: isolated)
        }
        #expect(notOwner.message.contains("SQLSTATE 42501): the database user lacks a privilege the catalog needs; make it the database's owner"))
        #expect(!notOwner.message.contains("check that it runs"), "\(notOwner.message)")
        _ = try await server.psql(created, "ALTER DATABASE \(database) OWNER TO app")

        let none = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: bare, environment: isolated) }
        #expect(none.message.contains("the server asks for a password and the database URL gives none"), "\(none.message)")
        try await Self.expectAgreement(server, bare, environment: isolated, connects: false, "no password anywhere")
        try await Self.expectAgreement(server, "postgres://app:p%40ss%3Aw%2Frd@127.0.0.1:\(server.port)/\(database)", environment: isolated, connects: true, "in the URL")
        try await Self.expectAgreement(server, bare, environment: isolated.merging(["PGPASSWORD": "p@ss:w/rd"]) { $1 }, connects: true, "PGPASSWORD")
        try await Self.expectAgreement(server, bare, environment: isolated.merging(["PGPASSWORD": "wrong"]) { $1 }, connects: false, "a wrong PGPASSWORD")

        // ~/.pgpass: the first matching line wins; * matches anything.
        let pgpass = home + "/.pgpass"
        try "# comment\n127.0.0.1:1:*:app:not-this-port\n*:\(server.port):\(database):app:p@ss\\:w/rd\n*:*:*:app:not-reached\n"
            .write(toFile: pgpass, atomically: true, encoding: .utf8)
        try FileManager.default.setAttributes([.posixPermissions: 0o600], ofItemAtPath: pgpass)
        try await Self.expectAgreement(server, bare, environment: isolated, connects: true, "~/.pgpass")
        // One others may read is ignored, by both.
        try FileManager.default.setAttributes([.posixPermissions: 0o644], ofItemAtPath: pgpass)
        try await Self.expectAgreement(server, bare, environment: isolated, connects: false, "~/.pgpass readable by others")
        // passfile= in the URL names another.
        let elsewhere = folder.path + "/passwords"
        try "127.0.0.1:\(server.port):*:app:p@ss\\:w/rd\n".write(toFile: elsewhere, atomically: true, encoding: .utf8)
        try FileManager.default.setAttributes([.posixPermissions: 0o600], ofItemAtPath: elsewhere)
        try await Self.expectAgreement(server, bare + "?passfile=\(elsewhere)", environment: isolated, connects: true, "passfile=")
    }

    @Test("parameters as psql takes them: a misspelt one refused, the query over the URL's parts over the PG* environment, an IPv6 host, application_name sent")
    func parameters() async throws {
        let server = try await PostgresServer.shared()
        let created = try await server.createDatabase()
        let database = try Self.databaseName(created)
        let base = "postgres://iap@127.0.0.1:\(server.port)/\(database)?sslmode=disable"
        for (url, connects) in [
            (base + "&sslmod=require", false),
            (base + "&port=1", false),
            (base + "&user=nobody", false),
            ("postgres://nobody@127.0.0.1:1/none?host=127.0.0.1&port=\(server.port)&user=iap&dbname=\(database)&sslmode=disable", true),
            (base + "&gssencmode=disable&connect_timeout=5", true),
            ("postgres://iap@[::1]:\(server.port)/\(database)?sslmode=disable", true),
        ] {
            try await Self.expectAgreement(server, url, connects: connects)
        }
        let typo = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: base + "&sslmod=require", environment: [:]) }
        #expect(typo.message.contains("sslmod in the database URL is not a parameter PostgreSQL clients know"), "\(typo.message)")
        let timeout = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: base + "&connect_timeout=soon", environment: [:]) }
        #expect(timeout.message.contains("connect_timeout=soon in the database URL is not a number of seconds"), "\(timeout.message)")

        // libpq's environment: each PG* variable fills in what the URL leaves out, and only that.
        let environment = [
            "PGHOST": "127.0.0.1", "PGPORT": String(server.port), "PGUSER": "iap", "PGDATABASE": database, "PGSSLMODE": "disable",
        ]
        for (url, environment, connects) in [
            ("postgres://", environment, true),
            (base, ["PGPORT": "1", "PGUSER": "nobody", "PGDATABASE": "none"], true),
            ("postgres://", environment.merging(["PGSSLMODE": "verify-full"]) { $1 }, false),
        ] {
            let refusal = try await Self.expectAgreement(server, url, environment: environment, connects: connects)
            #expect(refusal.map { $0.contains("(from the environment: ") } != false, "\(refusal ?? "")")
        }
        // No user anywhere: this process's login name, as psql takes it.
        let anonymous = "postgres://127.0.0.1:\(server.port)/\(database)?sslmode=disable"
        let psqlAnonymous = try await server.psqlConnects(anonymous).connected
        let oursAnonymous = try? await PostgresCatalog(url: anonymous, environment: [:])
        await oursAnonymous?.close()
        #expect(psqlAnonymous == (oursAnonymous != nil), "psql connected: \(psqlAnonymous)")

        // The server sees the name, as it does psql's (pg_stat_activity).
        let name = "iap-test-" + UUID().uuidString.prefix(8)
        let catalog = try await PostgresCatalog(url: base + "&application_name=\(name)", environment: [:])
        _ = try await catalog.versions(productId: nil)
        #expect(try await server.psql(created, "SELECT COUNT(*) > 0 FROM pg_stat_activity WHERE application_name = '\(name)'") == "t")
        await catalog.close()
    }

    /// Opens `url` with psql and with the catalog, both in `environment`, and expects both to
    /// connect or both to be refused, as `connects` says; returns the catalog's refusal.
    @discardableResult
    static func expectAgreement(
        _ server: PostgresServer, _ url: String, environment: [String: String] = [:], connects: Bool, _ what: String = "",
        sourceLocation: SourceLocation = #_sourceLocation
    ) async throws -> String? {
        let psql = try await server.psqlConnects(url, environment: environment)
        #expect(psql.connected == connects, "psql, \(what) \(url): \(psql.output)", sourceLocation: sourceLocation)
        do throws(CatalogError) {
            await (try await PostgresCatalog(url: url, environment: environment)).close()
            #expect(connects, "connected, \(what) \(url)", sourceLocation: sourceLocation)
            return nil
        } catch {
            #expect(!connects, "refused, \(what) \(url): \(error.message)", sourceLocation: sourceLocation)
            return error.message
        }
    }

    /// The database's name in a URL from ``PostgresServer/createDatabase()``.
    static func databaseName(_ url: String) throws -> String {
        try #require(url.split(separator: "/").last?.split(separator: "?").first.map(String.init))
    }
}

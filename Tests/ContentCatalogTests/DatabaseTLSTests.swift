import CatalogPostgres
import ContentCatalog
import Foundation
import IAPTestSupport
import Testing

/// The database URL's TLS parameters, read as libpq (psql) reads them: an operator's URL that
/// works with psql works with --database. The servers here take TCP connections over TLS only
/// (`hostssl` alone in pg_hba.conf), so a connection that opens at all was encrypted.
@Suite("The database over TLS, as libpq reads the URL")
struct DatabaseTLSTests {
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
            let psql = try await server.psqlConnects(url)
            #expect(psql.connected == connects, "psql with \(query): \(psql.output)")
            do throws(CatalogError) {
                let catalog = try await PostgresCatalog(url: url)
                #expect(connects, "connected with \(query)")
                await catalog.close()
            } catch {
                #expect(!connects, "refused with \(query): \(error.message)")
                #expect(!error.message.contains("BoringSSL"), "\(error.message)")
            }
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
            ("sslmode=verify-ca&sslrootcert=\(folder.path)/missing.pem", "cannot read the certificate authority file of sslrootcert=\(folder.path)/missing.pem"),
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

    /// The database's name in a URL from ``PostgresServer/createDatabase()``.
    static func databaseName(_ url: String) throws -> String {
        try #require(url.split(separator: "/").last?.split(separator: "?").first.map(String.init))
    }
}

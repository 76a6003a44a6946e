import CertificateTrust
import ContentCatalog
import Foundation
import NIOSSL
import PostgresNIO

/// The TLS a database URL asks for, read as libpq reads the same URL, so that a URL that works
/// with `psql` works here: `sslmode`, `sslrootcert`, `sslcert` and `sslkey`.
///
/// As in libpq, `prefer` (the default) and `require` encrypt without checking the server's
/// certificate unless there is an authority to check it against (`sslrootcert`, or
/// `~/.postgresql/root.crt`), and the verify modes require one. Debian's PostgreSQL turns TLS on
/// with a self-signed certificate, so checking by default would refuse the servers psql reaches.
struct DatabaseTLS {
    enum Mode: String, CaseIterable {
        case disable, allow, prefer, require
        case verifyCA = "verify-ca"
        case verifyFull = "verify-full"
    }

    let mode: Mode
    /// The client's settings; nil with `sslmode=disable`.
    let configuration: TLSConfiguration?
    /// What the server's certificate is checked against, as messages name it; nil when unchecked.
    let authority: String?

    /// Reads the URL's query parameters; `home` is where `~/.postgresql` is looked for.
    init(query: [String: String], home: String?) throws(CatalogError) {
        let modes = Mode.allCases.map(\.rawValue).joined(separator: ", ")
        guard let mode = Mode(rawValue: query["sslmode"] ?? "prefer") else {
            throw CatalogError(.storage, "sslmode=\(query["sslmode"] ?? "") in the database URL is not one of \(modes) (libpq's values)")
        }
        self.mode = mode
        guard mode != .disable else {
            (configuration, authority) = (nil, nil)
            return
        }
        let defaults = home.map { $0 + "/.postgresql/" }
        var tls = TLSConfiguration.makeClientConfiguration()
        let verify = mode == .verifyCA || mode == .verifyFull
        switch query["sslrootcert"] {
        case "system":
            // libpq 16's rule: the system's authorities sign for anyone's name, so only with the name checked.
            guard mode == .verifyFull else {
                throw CatalogError(.storage, "sslrootcert=system in the database URL needs sslmode=verify-full, as libpq requires: the name must be checked too")
            }
            authority = "the system's certificate authorities"
        case let path?:
            tls.trustRoots = .certificates(try Self.authorities(path, parameter: "sslrootcert in the database URL"))
            authority = "sslrootcert=\(path)"
        case nil:
            if let path = defaults.map({ $0 + "root.crt" }), FileManager.default.fileExists(atPath: path) {
                tls.trustRoots = .certificates(try Self.authorities(path, parameter: "libpq's default authority file"))
                authority = path
            } else if verify {
                throw CatalogError(
                    .storage,
                    "sslmode=\(mode.rawValue) checks the server's certificate, and the database URL names no authority to check it against: add sslrootcert=<file> (the authority's certificate, PEM), or sslrootcert=system with sslmode=verify-full for a certificate from a public authority"
                )
            } else {
                authority = nil
            }
        }
        tls.certificateVerification = authority == nil ? .none : mode == .verifyFull ? .fullVerification : .noHostnameVerification
        try Self.clientCertificate(query, defaults: defaults, into: &tls)
        configuration = tls
    }

    /// Whether a server without TLS is taken in plain text (libpq's `allow` and `prefer`).
    private var plainAllowed: Bool { mode == .allow || mode == .prefer }

    /// For the pool.
    var client: PostgresClient.Configuration.TLS {
        guard let configuration else { return .disable }
        return plainAllowed ? .prefer(configuration) : .require(configuration)
    }

    /// For the one connection made first, whose failure is reported.
    func connection() throws -> PostgresConnection.Configuration.TLS {
        guard let configuration else { return .disable }
        let context = try NIOSSLContext(configuration: configuration)
        return plainAllowed ? .prefer(context) : .require(context)
    }

    /// What to say when the server's certificate was refused, or nil when `error` is not that.
    func refusal(_ error: any Error, host: String, port: Int) -> String? {
        switch CertificateRefusal(error) {
        case nil:
            return nil
        case .otherName:
            return "the server's TLS certificate does not hold the name \(host), which sslmode=verify-full checks: "
                + "put a name the certificate holds in the database URL, or use sslmode=verify-ca to check the authority alone"
        case .untrusted:
            return "the server's TLS certificate is not signed by \(authority ?? "a trusted authority"), or it has expired: check sslrootcert in the database URL "
                + "(`openssl s_client -starttls postgres -connect \(host):\(port) -showcerts` shows what the server sends), "
                + "or, to encrypt without checking the certificate as libpq does, use sslmode=require without sslrootcert"
        }
    }

    private static func authorities(_ path: String, parameter: String) throws(CatalogError) -> [NIOSSLCertificate] {
        do throws(AuthorityFileError) {
            return try AuthorityFile.load(path)
        } catch {
            throw CatalogError(.storage, error.explanation(givenAs: parameter))
        }
    }

    /// A client certificate for servers that ask for one (`hostssl … cert` in pg_hba.conf):
    /// `sslcert` and `sslkey`, or libpq's `~/.postgresql/postgresql.crt` and `.key` when present.
    private static func clientCertificate(_ query: [String: String], defaults: String?, into tls: inout TLSConfiguration) throws(CatalogError) {
        let defaultCertificate = defaults.map { $0 + "postgresql.crt" }.flatMap { FileManager.default.fileExists(atPath: $0) ? $0 : nil }
        guard let certificatePath = query["sslcert"] ?? defaultCertificate else { return }
        let keyPath = query["sslkey"] ?? defaults.map { $0 + "postgresql.key" } ?? ""
        let certificates: [NIOSSLCertificate]
        do throws(AuthorityFileError) {
            certificates = try AuthorityFile.load(certificatePath)
        } catch {
            throw CatalogError(.storage, "cannot read a PEM client certificate from \(certificatePath) (sslcert in the database URL): check the path and that it is PEM")
        }
        // libpq's rule, so that a key psql refuses is refused here too: only its owner (the
        // user, or root with a group that may read) may reach it.
        var status = stat()
        if stat(keyPath, &status) == 0 {
            let owner = status.st_uid, mode = status.st_mode & 0o777
            guard owner == geteuid() || owner == 0 else {
                throw CatalogError(.storage, "the client certificate's private key \(keyPath) (sslkey in the database URL) must be owned by this user or root, as libpq requires")
            }
            guard owner == geteuid() ? mode & 0o077 == 0 : mode & 0o037 == 0 else {
                throw CatalogError(
                    .storage,
                    "the client certificate's private key \(keyPath) (sslkey in the database URL) may be read by others: chmod 600 it (0640 when root owns it), as libpq requires")
            }
        }
        guard FileManager.default.isReadableFile(atPath: keyPath), let key = try? NIOSSLPrivateKey(file: keyPath, format: .pem) else {
            throw CatalogError(
                .storage,
                "cannot read the client certificate's private key from \(keyPath) (sslkey in the database URL): give an unencrypted PEM key readable by this user")
        }
        tls.certificateChain = certificates.map { .certificate($0) }
        tls.privateKey = .privateKey(key)
    }
}

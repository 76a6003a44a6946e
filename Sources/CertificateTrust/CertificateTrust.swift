import Foundation
import NIOSSL

/// A file of certificate authorities that could not be used.
public struct AuthorityFileError: Error, Sendable, Equatable {
    public enum Problem: Sendable, Equatable {
        /// Missing, or not readable by this process.
        case unreadable
        /// Readable, but holding no PEM certificate (DER, a key, an empty file).
        case noCertificate
    }

    public let path: String
    public let problem: Problem

    /// What to tell the user, naming the setting the file was given through (`--ca-file`).
    public func explanation(givenAs setting: String) -> String {
        switch problem {
        case .unreadable:
            "cannot read the certificate authority file \(path): check the path given to \(setting)"
        case .noCertificate:
            "\(path) holds no PEM certificate: \(setting) takes the certificate authority's certificate as PEM (-----BEGIN CERTIFICATE-----)"
        }
    }
}

/// Reads certificate authorities from PEM files, for the clients that trust a private authority
/// (iap-fetch's and iap-server's `--ca-file`, the database URL's `sslrootcert`).
public enum AuthorityFile {
    /// The certificates in the PEM file at `path`, at least one.
    public static func load(_ path: String) throws(AuthorityFileError) -> [NIOSSLCertificate] {
        guard FileManager.default.isReadableFile(atPath: path) else { throw AuthorityFileError(path: path, problem: .unreadable) }
        let certificates = (try? NIOSSLCertificate.fromPEMFile(path)) ?? []
        guard !certificates.isEmpty else { throw AuthorityFileError(path: path, problem: .noCertificate) }
        return certificates
    }

    /// A client's TLS settings trusting the system's authorities and those in `files`. Read now,
    /// so that a wrong path is said at start, not on the first connection.
    public static func clientConfiguration(adding files: [String]) throws(AuthorityFileError) -> TLSConfiguration {
        var configuration = TLSConfiguration.makeClientConfiguration()
        var added: [NIOSSLCertificate] = []
        for file in files { added += try load(file) }
        if !added.isEmpty { configuration.additionalTrustRoots = [.certificates(added)] }
        return configuration
    }
}

/// A server certificate that a TLS client refused, told apart from other handshake failures (a
/// reset during the handshake is the network's, and worth trying again; a refused certificate
/// is refused again until someone changes the configuration).
public enum CertificateRefusal: Sendable, Equatable {
    /// The chain does not lead to a trusted authority, or a certificate in it is expired or not
    /// yet valid.
    case untrusted
    /// The chain is trusted, but the certificate does not hold the name that was connected to.
    case otherName

    /// The refusal `error` is, or nil for any other error.
    public init?(_ error: any Error) {
        if let extra = error as? NIOSSLExtraError, extra == .failedToValidateHostname {
            self = .otherName
            return
        }
        // NIOSSL reports BoringSSL's verification failure as a handshake error whose only
        // structure is its text (no X509_V_ERR code), so the reason is recognised by its name.
        guard case .handshakeFailed(let underlying) = error as? NIOSSLError, "\(underlying)".contains("CERTIFICATE_VERIFY_FAILED") else {
            return nil
        }
        self = .untrusted
    }
}

import Foundation
import NIOSSL

/// Why a file of certificate authorities could not be used.
public enum AuthorityFileProblem: Error, Sendable, Equatable {
    /// Missing, or not readable by this process.
    case unreadable
    /// Readable, but holding no PEM certificate (DER, a key, an empty file).
    case noCertificate
}

/// Reads certificate authorities from PEM files, for the clients that trust a private authority
/// (iap-fetch's `--ca-file`, the database URL's `sslrootcert`). Each caller words the problem for
/// the option it was given through.
public enum AuthorityFile {
    /// The certificates in the PEM file at `path`, at least one.
    public static func load(_ path: String) throws(AuthorityFileProblem) -> [NIOSSLCertificate] {
        guard FileManager.default.isReadableFile(atPath: path) else { throw .unreadable }
        let certificates = (try? NIOSSLCertificate.fromPEMFile(path)) ?? []
        guard !certificates.isEmpty else { throw .noCertificate }
        return certificates
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

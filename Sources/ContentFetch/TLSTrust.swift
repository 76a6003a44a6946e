import CertificateTrust
import Foundation
import NIOSSL

/// What the fetcher trusts on `https://` servers, and how it says that a server's certificate
/// was not accepted.
enum TLSTrust {
    /// The client's TLS settings: the system's roots plus the certificates in `files` (PEM). Read
    /// now, so that a wrong path is said before anything is fetched, not on the first connection.
    static func configuration(adding files: [String]) throws(FetchError) -> TLSConfiguration {
        do throws(AuthorityFileError) {
            return try AuthorityFile.clientConfiguration(adding: files)
        } catch {
            throw FetchError(.tls, error.explanation(givenAs: "--ca-file"))
        }
    }

    /// `error` as a `.tls` error naming the server and what to do, when it is a certificate the
    /// client refused; nil for anything else (a reset during the handshake stays a network
    /// error, and is retried).
    static func refusal(_ error: any Error, url: String) -> FetchError? {
        let address = ServerAddress(url)
        let host = address.host, server = address.hostAndPort
        switch CertificateRefusal(error) {
        case nil:
            return nil
        case .otherName:
            return FetchError(
                .tls,
                "the TLS certificate of \(server) is for another name, not \(host): use a name the certificate holds in the URL (`openssl s_client -connect \(server)` shows its names), or give the server a certificate for \(host)"
            )
        case .untrusted:
            return FetchError(
                .tls,
                "the TLS certificate of \(server) is not trusted: it is self-signed, expired or not yet valid, or issued by a certificate authority this machine does not trust. "
                    + "If the server uses a private certificate authority, pass that authority's certificate (PEM) with --ca-file (FetchConfiguration.additionalTrustRootFiles); "
                    + "otherwise the server must send its whole chain (nginx: ssl_certificate holds the certificate followed by its intermediates). "
                    + "`openssl s_client -connect \(server) -showcerts` shows what it sends"
            )
        }
    }
}

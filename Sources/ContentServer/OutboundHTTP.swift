import AsyncHTTPClient
import CertificateTrust
import NIOSSL
import ServerStartup

/// The server's own requests: archives from other replicas (their `--advertise-url`),
/// `verifyReceipt`, the App Store Server API for `reconcile`.
public enum OutboundHTTP {
    /// The TLS settings trusting the system's authorities plus those in `files` (PEM), so
    /// replicas can reach each other over HTTPS with a private authority.
    public static func trust(_ files: [String]) throws(ServerStartError) -> TLSConfiguration {
        do throws(AuthorityFileError) {
            return try AuthorityFile.clientConfiguration(adding: files)
        } catch {
            throw ServerStartError(.caFile, error.explanation(givenAs: "--ca-file (IAP_CA_FILES)"))
        }
    }

    /// A client with those settings, HTTP/1.1 only: an archive is one long response, and
    /// AsyncHTTPClient's HTTP/2 took half as long again for the same bytes (docs/performance.md,
    /// twelfth stop). The caller shuts it down.
    public static func client(_ tls: TLSConfiguration) -> HTTPClient {
        var configuration = HTTPClient.Configuration(tlsConfiguration: tls)
        configuration.httpVersion = .http1Only
        return HTTPClient(eventLoopGroupProvider: .singleton, configuration: configuration)
    }

    /// What to say about a request to `url` that failed with `error`: a refused certificate names
    /// the option that fixes it; anything else is said as it is.
    static func describe(_ error: any Error, url: String) -> String {
        switch CertificateRefusal(error) {
        case .untrusted:
            return "the TLS certificate of \(url) is not trusted: start this replica with --ca-file <the authority's certificate, PEM> (IAP_CA_FILES) if it comes from a private authority"
        case .otherName:
            return "the TLS certificate of \(url) does not hold its host name: advertise the replica under a name its certificate holds (--advertise-url)"
        case nil:
            return "\(error)"
        }
    }
}

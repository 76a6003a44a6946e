import AsyncHTTPClient
import Foundation
import IAPProtocol
import NIOCore
import NIOPosix

/// The server could not be reached at all: the connection was refused, the host or network is
/// unreachable, its name does not resolve, or connecting timed out. A server restarting, a
/// deploy or a network that comes back: ``RetryPolicy`` tries it again for a while (its
/// `patience`) rather than a number of times, then throws it, and the download fails with `reason`.
struct Unreachable: Error, CustomStringConvertible {
    let reason: FetchError

    var description: String { reason.message }

    /// `error` as an ``Unreachable`` whose reason names the server of `url`, when it is a failure
    /// to connect (AsyncHTTPClient's, with its own retries of connections turned off, or NIO's).
    static func from(_ error: any Error, url: String) -> Unreachable? {
        let connecting: Bool
        switch error {
        case let io as IOError:
            connecting = [ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, ENETDOWN, EHOSTDOWN, ETIMEDOUT, EADDRNOTAVAIL].contains(io.errnoCode)
        case is NIOConnectionError, is SocketAddressError, is SocketAddressError.UnknownHost:
            connecting = true
        case let client as HTTPClientError:
            connecting = client == .connectTimeout
        case let channel as ChannelError:
            if case .connectTimeout = channel { connecting = true } else { connecting = false }
        default:
            connecting = false
        }
        guard connecting else { return nil }
        return Unreachable(reason: FetchError(.network, "cannot reach \(ServerAddress(url).origin): \(GrantClient.describe(error))"))
    }
}

/// What a request that got no answer means for the retries, when it means more than a network
/// error: a certificate refused (a `.tls` `FetchError`, not retried) or a server not reached
/// (``Unreachable``, tried for the patience). Nil for anything else.
func connectionFailure(_ error: any Error, url: String) -> (any Error)? {
    if let refusal = TLSTrust.refusal(error, url: url) { return refusal }
    return Unreachable.from(error, url: url)
}

/// How messages name the server of a URL (the URL itself when it does not parse).
struct ServerAddress {
    /// `content.example.com`, or `[::1]`: an IPv6 address in brackets, as in a URL.
    let host: String
    /// `content.example.com:8443`, `[::1]:8443`, or the host alone when the URL gives no port.
    let hostAndPort: String
    /// `https://content.example.com:8443`.
    let origin: String

    init(_ url: String) {
        let parsed = URL(string: url)
        let host = parsed?.host.map(URLHost.inURL) ?? url
        let hostAndPort = parsed?.port.map { "\(host):\($0)" } ?? host
        self.host = host
        self.hostAndPort = hostAndPort
        origin = parsed.map { "\($0.scheme ?? "http")://\(hostAndPort)" } ?? url
    }
}

import IAPProtocol
import NIOCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Why the server could not start: it cannot listen where it was told to.
public enum ServerStartErrorCode: String, ErrorCode {
    case cannotListen = "cannot-listen"
    /// A `--ca-file` that cannot be read or holds no certificate.
    case caFile = "ca-file"
    /// A `--loopback-congestion-control` the system does not offer.
    case congestionControl = "congestion-control"
}

/// Why the server could not start, said so that the operator can act on it.
public typealias ServerStartError = CodedError<ServerStartErrorCode>

extension CodedError where Code == ServerStartErrorCode {
    /// What a server that stopped with `error` should report: the failure to bind `host`:`port`
    /// said as such when it had not started listening, `error` itself otherwise (a later
    /// EADDRNOTAVAIL, say from an outgoing connection, is not about the listening address).
    public static func reported(_ error: any Error, listening: Bool, host: String, port: Int) -> any Error {
        guard !listening, let reason = ServerStartError(listening: error, host: host, port: port) else { return error }
        return reason
    }

    /// The error for a failure to bind `host`:`port`, or nil when `error` is not one (NIO's
    /// messages name the system call, not the flag to change).
    public init?(listening error: any Error, host: String, port: Int) {
        if error is SocketAddressError || error is SocketAddressError.UnknownHost {
            self.init(.cannotListen, "cannot resolve --host \(host): give an address such as 127.0.0.1, or 0.0.0.0 for all of this machine's")
            return
        }
        guard let error = error as? IOError else { return nil }
        switch error.errnoCode {
        case EADDRINUSE:
            self.init(.cannotListen, "port \(port) on \(host) is in use by another process: stop it, or give another --port (0 picks a free one)")
        case EACCES:
            self.init(.cannotListen, "port \(port) on \(host) needs privileges this process lacks: give a port above 1023, or put a proxy in front")
        case EADDRNOTAVAIL:
            self.init(.cannotListen, "\(host) is not an address of this machine: give one of its addresses, or 0.0.0.0 for all of them")
        default:
            return nil
        }
    }
}

/// The process's open-file limit, which caps the connections the server can hold: each is a
/// descriptor, and each download also holds its archive open.
public enum OpenFileLimit {
    /// Raises the soft limit to the hard one, as Go's runtime and nginx's
    /// `worker_rlimit_nofile` do: the soft limit a service manager or shell hands over is often
    /// 1,024, which a thousand slow downloads exhaust, while the hard limit is set by the operator.
    /// Returns the limit before and after; nil when it could not be read or changed.
    public static func raiseToHardLimit() -> (before: UInt64, after: UInt64)? {
        var limit = rlimit()
        guard getrlimit(resourceNumber, &limit) == 0 else { return nil }
        let before = UInt64(limit.rlim_cur)
        guard limit.rlim_cur < limit.rlim_max else { return (before, before) }
        limit.rlim_cur = limit.rlim_max
        guard setrlimit(resourceNumber, &limit) == 0 else { return nil }
        return (before, UInt64(limit.rlim_max))
    }

    /// The soft limit now, or nil when unknown.
    public static var current: UInt64? {
        var limit = rlimit()
        return getrlimit(resourceNumber, &limit) == 0 ? UInt64(limit.rlim_cur) : nil
    }

    #if canImport(Glibc)
        private static let resourceNumber = __rlimit_resource_t(RLIMIT_NOFILE.rawValue)
    #else
        private static let resourceNumber = RLIMIT_NOFILE
    #endif
}

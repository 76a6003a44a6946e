import Logging
import NIOCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

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
    static var current: UInt64? {
        var limit = rlimit()
        return getrlimit(resourceNumber, &limit) == 0 ? UInt64(limit.rlim_cur) : nil
    }

    #if canImport(Glibc)
        private static let resourceNumber = __rlimit_resource_t(RLIMIT_NOFILE.rawValue)
    #else
        private static let resourceNumber = RLIMIT_NOFILE
    #endif
}

/// Says, on the server socket's pipeline, when connections cannot be accepted for want of file
/// descriptors. NIO backs off accepting for a second and retries, silently: without this an
/// operator sees only clients that time out. Said at most once a minute, counted every time
/// (`iap_accept_failures_total`).
final class AcceptFailureLogger: ChannelInboundHandler {
    typealias InboundIn = Any

    private let logger: Logger
    private let metrics: ServerMetrics
    private var lastSaid: NIODeadline?

    init(logger: Logger, metrics: ServerMetrics) {
        self.logger = logger
        self.metrics = metrics
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        if let error = error as? IOError, error.errnoCode == EMFILE || error.errnoCode == ENFILE {
            metrics.acceptFailure(error.errnoCode == EMFILE ? "process-limit" : "system-limit")
            let now = NIODeadline.now()
            if lastSaid.map({ now - $0 >= .minutes(1) }) ?? true {
                lastSaid = now
                if error.errnoCode == EMFILE {
                    let limit = OpenFileLimit.current.map { " (\($0))" } ?? ""
                    logger.warning(
                        "cannot accept connections: this process has reached its open-file limit\(limit); new connections wait until connections close. Raise the limit (systemd LimitNOFILE=, ulimit -n) or put a proxy in front that limits connections"
                    )
                } else {
                    logger.warning(
                        "cannot accept connections: the system's open-file table is full (fs.file-max); new connections wait until files are closed"
                    )
                }
            }
        }
        context.fireErrorCaught(error)
    }
}

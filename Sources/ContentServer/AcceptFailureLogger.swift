import Logging
import NIOCore
import ServerStartup

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

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

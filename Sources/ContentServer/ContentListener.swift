import ContentDelivery
import Logging
import NIOCore
import NIOExtras
import NIOPosix
import ServerStartup
import ServiceLifecycle
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Accepts the server's connections: one listening socket per event loop on the same port
/// (`SO_REUSEPORT`), so that the kernel spreads new connections over the loops and each loop
/// serves the connections it accepted, as nginx's workers do with `reuseport`.
///
/// Why not Hummingbird's server, which the JSON API still answers through (see
/// `HandedOffConnections`): it accepts on one loop and hands every connection to the next loop
/// of the group (a wake-up of another thread), then passes it through an async stream to a task
/// of its own on the concurrency pool (another). A fresh connection cost the server 207 µs of CPU
/// that way, nginx 41 µs (docs/performance.md, twentieth stop).
///
/// Another process of the same user could join the port the same way, so the port is first
/// bound by a socket without `SO_REUSEPORT`: a port something already listens on (an earlier
/// instance left running) is refused as before, by name, instead of sharing the connections
/// (`--port 0` takes the port that socket was given).
struct ContentListener: Service {
    let host: String
    let port: Int
    let group: MultiThreadedEventLoopGroup
    let connections: OpenConnections
    /// The congestion control of the connections that cross no link (see
    /// ``ServerConfiguration/loopbackCongestionControl``).
    let loopbackCongestionControl: LoopbackCongestionControl
    /// Told at start the congestion control the connections from this machine get, or why not.
    let logger: Logger
    /// Sets up an accepted connection's pipeline, on its loop.
    let setUp: @Sendable (any Channel) throws -> Void
    /// Added first to each listening socket's pipeline, in this order; made anew for each.
    let listenerHandlers: @Sendable () -> [any ChannelHandler]
    /// Called with the port once every loop listens.
    let onListening: @Sendable (Int) async -> Void

    func run() async throws {
        // One helper per listener: a helper drains the connections of the first listener it is
        // given only.
        let quiescing = group.makeIterator().map { _ in ServerQuiescingHelper(group: group) }
        let listeners = try await bind(quiescing)
        await onListening(listeners.first?.localAddress?.port ?? port)
        let stopped = quiescing.map { _ in group.any().makePromise(of: Void.self) }
        let drained = EventLoopFuture.andAllComplete(stopped.map(\.futureResult), on: group.any())
        await withTaskCancellationHandler {
            await withGracefulShutdownHandler {
                // Ends when the drain has closed the listeners and every connection.
                try? await drained.get()
            } onGracefulShutdown: {
                for (helper, promise) in zip(quiescing, stopped) { helper.initiateShutdown(promise: promise) }
            }
        } onCancel: {
            // The drain ran out of time (or the server failed): what is left is cut.
            for listener in listeners { listener.close(promise: nil) }
            connections.closeAll()
            for promise in stopped { promise.succeed() }
        }
    }

    private func bind(_ quiescing: [ServerQuiescingHelper]) async throws -> [any Channel] {
        let address = try SocketAddress.makeAddressResolvingHost(host, port: port)
        let free = try freePort(address)
        let congestion = try Self.congestionPlan(loopbackCongestionControl, address: address)
        if let note = congestion.note { logger.notice("\(note)") }
        #if os(Linux)
            // Said when it changes anything: the operator chose the system's for a reason.
            let system = (try? String(contentsOfFile: "/proc/sys/net/ipv4/tcp_congestion_control", encoding: .utf8))?
                .trimmingCharacters(in: .whitespacesAndNewlines)
            if let name = congestion.listener ?? congestion.connections, name != system {
                logger.info(
                    "congestion control \(name) for the connections from this machine, which cross no link (the system's: \(system ?? "?"); --loopback-congestion-control system keeps it)"
                )
            }
        #endif
        // The option's value, made once for every listener and connection it is set on.
        let listenerValue = congestion.listener.map(Self.optionValue)
        let connectionValue = congestion.connections.map(Self.optionValue)
        var listeners: [any Channel] = []
        do {
            for (loop, quiescing) in zip(group.makeIterator(), quiescing) {
                var bootstrap = ServerBootstrap(group: loop)
                #if os(Linux)
                    // Handed over once the first request has arrived, so that `ContentAcceptor`
                    // finds it there (see `deferAccept`).
                    bootstrap = bootstrap.serverChannelOption(ContentAcceptor.deferAccept, value: 1)
                #endif
                let listener =
                    try await bootstrap
                    .serverChannelOption(ChannelOptions.backlog, value: 256)
                    // Up to 16 connections accepted per wake-up, not NIO's 4: a new connection
                    // for each 4 KiB range, 7 alternated rounds, 1-4% more requests a second at 16
                    // and 64 connections and a 6% lower p99 (docs/performance.md, twenty-first
                    // stop); one per wake-up was 14% slower.
                    .serverChannelOption(ChannelOptions.maxMessagesPerRead, value: 16)
                    .serverChannelOption(ChannelOptions.socketOption(.so_reuseaddr), value: 1)
                    .serverChannelOption(ChannelOptions.socketOption(.init(rawValue: SO_REUSEPORT)), value: 1)
                    .childChannelOption(ChannelOptions.allowRemoteHalfClosure, value: true)
                    .serverChannelInitializer { channel in
                        // Before the bind: every connection accepted inherits it.
                        Self.setCongestionControl(listenerValue, on: channel).flatMapThrowing {
                            let sync = channel.pipeline.syncOperations
                            for handler in listenerHandlers().reversed() { try sync.addHandler(handler, position: .first) }
                            try sync.addHandler(quiescing.makeServerChannelHandler(channel: channel))
                        }
                    }
                    .childChannelInitializer { channel in
                        if let connectionValue, Self.crossesNoLink(local: channel.localAddress, remote: channel.remoteAddress) {
                            // On the channel's loop, so set before the first response; one that
                            // fails leaves the connection the system's choice.
                            Self.setCongestionControl(connectionValue, on: channel).whenFailure { _ in }
                        }
                        return channel.eventLoop.makeCompletedFuture {
                            connections.add(channel)
                            try setUp(channel)
                        }
                    }
                    .bind(host: host, port: free).get()
                listeners.append(listener)
            }
        } catch {
            for listener in listeners { try? await listener.close() }
            throw error
        }
        return listeners
    }

    /// Where the congestion control is set: on the listening sockets, whose connections inherit
    /// it (a loopback address: no call per connection), or on each accepted connection that
    /// crosses no link (any other address); and what to tell the operator at start.
    struct CongestionPlan: Equatable {
        var listener: String?
        var connections: String?
        var note: String?
    }

    /// The plan for `setting` on a server listening on `address`. The algorithm is first set on a
    /// socket of the same family, so that one the system does not let this process set is found
    /// before anything listens: refused for ``LoopbackCongestionControl/required(_:)``, the
    /// system's kept (and said) for ``LoopbackCongestionControl/preferred(_:)``.
    static func congestionPlan(_ setting: LoopbackCongestionControl, address: SocketAddress) throws -> CongestionPlan {
        #if os(Linux)
            let (wanted, required): (String, Bool)
            switch setting {
            case .system: return CongestionPlan()
            case .preferred(let name): (wanted, required) = (name, false)
            case .required(let name): (wanted, required) = (name, true)
            }
            let probe = socket(CInt(address.protocol.rawValue), CInt(SOCK_STREAM.rawValue) | CInt(SOCK_CLOEXEC.rawValue), 0)
            guard probe >= 0 else { throw IOError(errnoCode: errno, reason: "socket") }
            defer { close(probe) }
            let code = setCongestionControl(wanted, descriptor: probe)
            guard code != 0 else {
                return isLoopback(address) ? CongestionPlan(listener: wanted) : CongestionPlan(connections: wanted)
            }
            func list(_ name: String) -> String {
                (try? String(contentsOfFile: "/proc/sys/net/ipv4/" + name, encoding: .utf8))?.trimmingCharacters(in: .whitespacesAndNewlines) ?? "?"
            }
            let allowed = list("tcp_allowed_congestion_control")
            // Not allowed (EPERM) is fixed by the system's list; one the kernel lacks (ENOENT), by another name.
            let (why, fix) =
                switch code {
                case EPERM:
                    (
                        "congestion control \(wanted) is not allowed for this process",
                        "add it to net.ipv4.tcp_allowed_congestion_control (now: \(allowed))"
                    )
                case ENOENT:
                    (
                        "congestion control \(wanted) is not one this kernel offers (available: \(list("tcp_available_congestion_control")))",
                        "this process may set \(allowed)"
                    )
                default: ("congestion control \(wanted) cannot be set (\(String(cString: strerror(code))))", "this process may set \(allowed)")
                }
            guard required else {
                return CongestionPlan(
                    note: "\(why): connections from this machine keep the system's; \(fix), or give --loopback-congestion-control system to keep it without this notice")
            }
            throw ServerStartError(.congestionControl, "\(why): \(fix); give --loopback-congestion-control one of those, or 'system' to keep the system's")
        #else
            return CongestionPlan()
        #endif
    }

    #if os(Linux)
        /// `TCP_CONGESTION` (13 in <netinet/tcp.h>, not imported into Swift).
        private static let tcpCongestion: CInt = 13

        /// Sets the congestion control `name` on `descriptor`; 0, or the `errno`.
        private static func setCongestionControl(_ name: String, descriptor: CInt) -> CInt {
            let done = name.withCString { setsockopt(descriptor, CInt(IPPROTO_TCP), tcpCongestion, $0, socklen_t(strlen($0))) }
            return done == 0 ? 0 : errno
        }
    #endif

    /// `TCP_CONGESTION`'s value for `name`: the name, NUL-padded to the kernel's 16 bytes. A tuple
    /// because NIO's `SocketOptionProvider` takes a value of fixed layout, not a buffer.
    typealias OptionValue = (CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar, CChar)

    static func optionValue(_ name: String) -> OptionValue {
        var value: OptionValue = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        withUnsafeMutableBytes(of: &value) { bytes in
            for (index, byte) in name.utf8.prefix(15).enumerated() { bytes[index] = byte }
        }
        return value
    }

    /// Sets the congestion control `value` names on a channel's socket: a listener's before its
    /// bind, or an accepted connection's as it is set up.
    private static func setCongestionControl(_ value: OptionValue?, on channel: any Channel) -> EventLoopFuture<Void> {
        #if os(Linux)
            // NIO's options take integers; its channels set any other value for a call of ours.
            guard let value, let provider = channel as? any SocketOptionProvider else { return channel.eventLoop.makeSucceededVoidFuture() }
            return provider.unsafeSetSocketOption(level: .tcp, name: .init(rawValue: tcpCongestion), value: value)
        #else
            return channel.eventLoop.makeSucceededVoidFuture()
        #endif
    }

    /// Whether `address` is a loopback address: 127.0.0.0/8, ::1, or ::ffff:127.0.0.0/104.
    static func isLoopback(_ address: SocketAddress) -> Bool {
        guard let bytes = ipBytes(address) else { return false }
        let mapped = (0..<10).allSatisfy { bytes[$0] == 0 } && bytes[10] == 0xff && bytes[11] == 0xff
        return (0..<15).allSatisfy { bytes[$0] == 0 } && bytes[15] == 1 || mapped && bytes[12] == 127
    }

    /// Whether a connection between `local` and `remote` stays on this machine: the peer is at a
    /// loopback address, or at the connection's own address (a client here that connected to
    /// the machine's address, which the kernel routes over loopback too).
    static func crossesNoLink(local: SocketAddress?, remote: SocketAddress?) -> Bool {
        guard let remote, let peer = ipBytes(remote) else { return false }
        return isLoopback(remote) || local.flatMap(ipBytes) == peer
    }

    /// The 16 bytes of an IP address, an IPv4 one as IPv6 maps it (::ffff:a.b.c.d); nil for a
    /// Unix socket's. A vector, not an array: asked for each connection accepted, it allocates nothing.
    private static func ipBytes(_ address: SocketAddress) -> SIMD16<UInt8>? {
        switch address {
        case .v4(let v4):
            var bytes = SIMD16<UInt8>()
            bytes[10] = 0xff
            bytes[11] = 0xff
            withUnsafeBytes(of: v4.address.sin_addr.s_addr) { for index in 0..<4 { bytes[12 + index] = $0[index] } }
            return bytes
        case .v6(let v6):
            return withUnsafeBytes(of: v6.address.sin6_addr) { $0.loadUnaligned(as: SIMD16<UInt8>.self) }
        default:
            return nil
        }
    }

    /// Binds `port` (0: any) once without `SO_REUSEPORT`, on a socket that never listens, and
    /// returns the port it got: fails as a plain bind would, with the same error, when anything
    /// listens there.
    private func freePort(_ address: SocketAddress) throws -> Int {
        let probe = socket(CInt(address.protocol.rawValue), CInt(SOCK_STREAM.rawValue) | CInt(SOCK_CLOEXEC.rawValue), 0)
        guard probe >= 0 else { throw IOError(errnoCode: errno, reason: "socket") }
        defer { close(probe) }
        var one: CInt = 1
        _ = setsockopt(probe, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<CInt>.size))
        let bound = address.withSockAddr { Glibc.bind(probe, $0, socklen_t($1)) }
        guard bound == 0 else { throw IOError(errnoCode: errno, reason: "bind(descriptor:ptr:bytes:)") }
        var local = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let named = withUnsafeMutablePointer(to: &local) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(probe, $0, &length) } }
        guard named == 0 else { throw IOError(errnoCode: errno, reason: "getsockname") }
        // sin_port and sin6_port sit at the same offset, in network byte order.
        return withUnsafeBytes(of: &local) { Int(UInt16(bigEndian: $0.load(fromByteOffset: 2, as: UInt16.self))) }
    }
}

/// The connections open on the server, to close those a drain that ran out of time left.
final class OpenConnections: Sendable {
    private let open = Mutex<[ObjectIdentifier: any Channel]>([:])

    func add(_ channel: any Channel) {
        let key = ObjectIdentifier(channel)
        open.withLock { $0[key] = channel }
        channel.closeFuture.whenComplete { [self] _ in _ = open.withLock { $0.removeValue(forKey: key) } }
    }

    func closeAll() {
        for channel in open.withLock({ Array($0.values) }) { channel.close(promise: nil) }
    }
}

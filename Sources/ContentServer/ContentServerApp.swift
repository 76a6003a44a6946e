import ContentCatalog
import ContentDelivery
import Foundation
import Hummingbird
import HummingbirdCore
import IAPProtocol
import Logging
import NIOCore
import NIOPosix
import ServerStartup
import ServiceLifecycle
import Synchronization

/// Runs the server until SIGTERM or SIGINT, then drains transfers in flight for at most
/// `drainTimeout`.
public enum ContentServerApp {
    /// - Parameter onListening: called with the bound port once the server accepts connections.
    public static func run(
        configuration: ServerConfiguration, logger: Logger,
        onListening: @escaping @Sendable (Int) async -> Void = { _ in }
    ) async throws {
        let service = try await ContentService(configuration: configuration)
        // HEAD on every GET route, as RFC 9110 asks of a general-purpose server (a load
        // balancer's check may use it).
        let router = Router(context: ServerRequestContext.self, options: .autoGenerateHeadEndpoints)
        // Each request's method and path at debug: the decisions worth a line at info (a grant,
        // a refusal and why, a notification, a catalog change) are logged with their outcome.
        router.add(middleware: LogRequestsMiddleware(.debug))
        let methods = RouteMethods()
        router.add(middleware: ErrorFormatMiddleware(methods: methods))
        APIRoutes(service: service, log: DecisionLog(logger: logger)).register(on: router, methods: methods)

        // NIO's shared group (one loop per core) unless asked otherwise; a group of our own is
        // shut down once the server has stopped.
        let ownGroup = configuration.eventLoops.map { MultiThreadedEventLoopGroup(numberOfThreads: $0) }
        // Large archive bodies leave from sending threads of their own, as many as event loops.
        let sender = try? FileSender(threads: configuration.eventLoops ?? System.coreCount)
        let handedOff = HandedOffConnections()
        let loops = ownGroup ?? MultiThreadedEventLoopGroup.singleton
        let channel = ContentHTTPChannel(
            responder: ContentHTTPChannel.responder(router.buildResponder(), logger: logger), service: service, sender: sender,
            idleTimeout: configuration.idleTimeout, headerTimeout: configuration.headerTimeout, handedOff: handedOff)
        let connections = OpenConnections()
        let listener = ContentListener(
            host: configuration.host, port: configuration.port, group: loops, connections: connections,
            loopbackCongestionControl: configuration.loopbackCongestionControl, logger: logger,
            setUp: { try channel.configure($0, logger: logger) },
            // The failure logger first: NIO's accept back-off handler further on swallows the
            // error. Then new connections' first content requests are answered as accepted.
            listenerHandlers: {
                [
                    AcceptFailureLogger(logger: logger, metrics: service.metrics),
                    ContentAcceptor(prefix: ContentHTTPChannel.contentPrefix, resolver: service, observer: service.metrics),
                ]
            },
            onListening: { port in
                service.boundPort.withLock { $0 = port }
                logger.info("listening on \(configuration.host):\(port)")
                await onListening(port)
            })

        var group = ServiceGroupConfiguration(
            services: [
                // Before the server: stopped after it (see `HandedOffConnections`).
                .init(service: handedOff),
                .init(service: listener), .init(service: RevocationRefresher(service: service, interval: configuration.revocationRefresh)),
                // These two end at once when turned off (a retention of for ever, no periodic read):
                // that is not the server failing.
                .init(
                    service: NotificationPruner(store: service.store, retention: configuration.notificationRetention, logger: logger),
                    successTerminationBehavior: .ignore),
                .init(service: ArchiveChecker(service: service, interval: configuration.archiveCheckInterval), successTerminationBehavior: .ignore),
            ],
            gracefulShutdownSignals: [.sigterm, .sigint], cancellationSignals: [], logger: logger)
        group.maximumGracefulShutdownDuration = configuration.drainTimeout
        do {
            try await ServiceGroup(configuration: group).run()
        } catch {
            // An app embedding the server keeps running: its threads must not outlive the server.
            // The sender first: a send it cancels reports back on its connection's event loop.
            await sender?.shutdown()
            try? await service.outbound.shutdown()
            try? await ownGroup?.shutdownGracefully()
            throw ServerStartError.reported(error, listening: service.boundPort.withLock { $0 } != 0, host: configuration.host, port: configuration.port)
        }
        await sender?.shutdown()
        try? await service.outbound.shutdown()
        service.closeFiles()
        await service.store.database.close()
        try? await ownGroup?.shutdownGracefully()
    }
}

/// Keeps the in-memory revocations current with what other replicas write: PostgreSQL announces
/// each one as it commits (LISTEN/NOTIFY), and a reload every few seconds covers SQLite shared
/// by replicas and any announcement lost while the listening connection was down. The same
/// beat reads the grant key file again when it changed (`iap-server grant-keys`).
struct RevocationRefresher: Service {
    let service: ContentService
    let interval: Duration

    func run() async throws {
        await cancelWhenGracefulShutdown {
            await withTaskGroup(of: Void.self) { group in
                group.addTask {
                    _ = await service.store.database.watchRevocations { change in service.apply(change) }
                }
                group.addTask {
                    await service.catchUpArchives()
                    while !Task.isCancelled {
                        do { try await Task.sleep(for: interval) } catch { return }
                        // First: a stat, which the database's slowness must not hold up.
                        service.reloadGrantKeys()
                        try? await service.refreshRevocations()
                        await service.catchUpArchives()
                        service.checkKeptFiles()
                    }
                }
                await group.waitForAll()
            }
        }
    }
}

/// Reads every published archive through every `--archive-check-interval`, to find bytes
/// damaged on disk at their published size (``ContentService/findRottenArchives()``); the first
/// pass after the interval or ten minutes, whichever is sooner. A pass in progress stops at the
/// next archive on shutdown.
struct ArchiveChecker: Service {
    let service: ContentService
    let interval: Duration?

    func run() async throws {
        guard let interval else { return }
        await cancelWhenGracefulShutdown {
            var wait = min(interval, .seconds(600))
            while !Task.isCancelled {
                do { try await Task.sleep(for: wait) } catch { return }
                await service.findRottenArchives()
                wait = interval
            }
        }
    }
}

/// Deletes stored App Store notifications older than `--notification-retention`, at start and
/// then hourly: a large app's renewals alone add millions a year, a few KiB each. Every replica
/// prunes; they delete the same rows, which costs nothing twice.
struct NotificationPruner: Service {
    let store: ContentStore
    let retention: Duration?
    let logger: Logger
    static let interval: Duration = .seconds(3_600)

    func run() async throws {
        guard let retention else { return }
        await cancelWhenGracefulShutdown {
            while !Task.isCancelled {
                await prune(retention)
                do { try await Task.sleep(for: Self.interval) } catch { return }
            }
        }
    }

    func prune(_ retention: Duration) async {
        let cutoff = Date().addingTimeInterval(-Double(retention.components.seconds))
        do throws(CatalogError) {
            let deleted = try await store.pruneNotifications(receivedBefore: cutoff)
            guard deleted > 0 else { return }
            logger.notice(
                "deleted \(deleted) stored notification(s) received before \(cutoff.formatted(.iso8601)) (--notification-retention \(retention.components.seconds / 86_400) days; 0 keeps them)")
        } catch {
            // A server stopping (one that could not listen, say) cancels the prune: nothing to say.
            guard !Task.isCancelled else { return }
            logger.warning("could not delete old notifications, trying again in an hour: \(error.message)")
        }
    }
}

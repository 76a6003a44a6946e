import Foundation
import Logging
import NIOCore
import PostgresNIO
import Synchronization

/// The catalog's connection pool, started afresh when the database is back but the pool is not.
///
/// PostgresNIO's pool retries a lost server on a backoff that grows by a quarter with every failed
/// attempt, to a minute, and has no way to be told to try now: after a five-minute outage a replica
/// would go on refusing grants for up to a minute more (`tools/bench-reconnect.sh` measured 7 s
/// after one minute). The keeper checks the pool when no operation holds a connection and none has
/// had one for a while; when the pool cannot lend a connection but a connection of the keeper's own
/// opens, the pool is only waiting out its backoff, and a fresh one takes its place.
final class PoolKeeper: Sendable {
    private struct State {
        var client: PostgresClient
        var runner: Task<Void, Never>
        /// Pools replaced and shut down; `close()` waits for them.
        var retired: [Task<Void, Never>] = []
        /// Operations holding a connection now: a pool that lends connections is not stuck.
        var holding = 0
        var lastLease = ContinuousClock.now
        /// Whether the keeper has said that the database does not answer (said once per outage).
        var away = false
        var replacements = 0
    }

    private let state: Mutex<State>
    private let configuration: PostgresClient.Configuration
    private let probe: PostgresConnection.Configuration
    /// PostgresNIO's logger (warnings and up) and the catalog's own (for the keeper's notices).
    private let poolLogger: Logger, logger: Logger
    private let location: String

    /// How often the keeper looks, and how long a check may wait for the pool's connection.
    static let interval: Duration = .seconds(1)
    static let checkTimeout: Duration = .milliseconds(500)
    static let probeTimeout: Duration = .seconds(5)

    init(configuration: PostgresClient.Configuration, probe: PostgresConnection.Configuration, location: String, poolLogger: Logger, logger: Logger) async {
        (self.configuration, self.location, self.poolLogger, self.logger) = (configuration, location, poolLogger, logger)
        // The keeper's own connections say what they are in pg_stat_activity.
        var probe = probe
        let name = probe.options.additionalStartupParameters.first { $0.0 == "application_name" }?.1 ?? "iap-server"
        probe.options.additionalStartupParameters.removeAll { $0.0 == "application_name" }
        probe.options.additionalStartupParameters.append(("application_name", name + " (reconnect probe)"))
        self.probe = probe
        let client = PostgresClient(configuration: configuration, backgroundLogger: poolLogger)
        state = Mutex(State(client: client, runner: Self.start(client)))
    }

    /// Runs `client` in a task of its own, returning once its `run()` is under way: PostgresNIO
    /// warns of every lease asked for before that. The task starts on this thread and runs
    /// until `run()` first waits (`Task.immediate`), so `run()` has marked the client running
    /// before this returns; a task that signalled just before calling `run()` let a lease in
    /// between when its thread was preempted there (one `iap-server publish` in sixteen on a
    /// busy machine).
    private static func start(_ client: PostgresClient) -> Task<Void, Never> {
        Task.immediate { await client.run() }
    }

    /// The pool operations use now.
    var client: PostgresClient { state.withLock { $0.client } }

    /// How many times a stuck pool was replaced.
    var replacements: Int { state.withLock { $0.replacements } }

    /// False from the keeper's finding the database away until it answers again.
    var answering: Bool { state.withLock { !$0.away } }

    /// The operation did not end within its deadline.
    struct DeadlinePassed: Error {}

    /// The connection an operation holds, for closing it when the deadline passes.
    private final class Held: Sendable {
        let connection = Mutex<PostgresConnection?>(nil)
    }

    /// Runs `body` on a connection of the pool. An operation's connection is `counted` as held
    /// while it runs; a listener's, held for good, is not (it would hide a pool that lends no other).
    /// With a `deadline`, ``DeadlinePassed`` is thrown when it passes, at once: a query waiting on
    /// a server that stopped answering (frozen, or cut off without a reset) does not end when its
    /// task is cancelled, so its connection is closed, which fails the query and frees the slot.
    func withConnection<T: Sendable>(
        counted: Bool = true, deadline: Duration? = nil, _ body: @escaping @Sendable (PostgresConnection) async throws -> T
    ) async throws -> T {
        guard let deadline else { return try await lend(counted: counted, held: nil, body) }
        let held = Held()
        return try await withThrowingTaskGroup(of: T.self) { group in
            group.addTask { try await self.lend(counted: counted, held: held, body) }
            group.addTask {
                try await Task.sleep(for: deadline)
                throw DeadlinePassed()
            }
            defer { group.cancelAll() }
            do {
                return try await group.next()!
            } catch let error as DeadlinePassed {
                if let connection = held.connection.withLock({ $0 }) {
                    // The future's close, not the async one: this path must not wait on the server.
                    let closing: EventLoopFuture<Void> = connection.close()
                    _ = closing
                }
                throw error
            }
        }
    }

    private func lend<T: Sendable>(counted: Bool, held: Held?, _ body: @escaping @Sendable (PostgresConnection) async throws -> T) async throws -> T {
        while true {
            let client = client
            var leased = false
            do {
                return try await client.withConnection { connection in
                    leased = true
                    held?.connection.withLock { $0 = connection }
                    defer { held?.connection.withLock { $0 = nil } }
                    noteAnswer()
                    guard counted else { return try await body(connection) }
                    state.withLock {
                        $0.holding += 1
                        $0.lastLease = .now
                    }
                    defer {
                        state.withLock {
                            $0.holding -= 1
                            $0.lastLease = .now
                        }
                    }
                    return try await body(connection)
                }
            } catch {
                // Still waiting for a connection when its pool was replaced: the new pool takes
                // the request, within the caller's deadline. Work that began on a connection is not
                // run twice.
                if !leased, self.client !== client, !Task.isCancelled { continue }
                throw error
            }
        }
    }

    /// A connection was lent: the database answers, which is said once after an outage.
    private func noteAnswer() {
        let wasAway = state.withLock { state in
            defer { state.away = false }
            return state.away
        }
        if wasAway { logger.notice("\(location) answers again") }
    }

    /// Looks at the pool every ``interval`` until cancelled.
    func watch() async {
        while !Task.isCancelled {
            do { try await Task.sleep(for: Self.interval) } catch { return }
            await check()
        }
    }

    private func check() async {
        // Connections lent lately, or held now (a slow query, a lock wait): the pool is working.
        let busy = state.withLock { $0.holding > 0 || ContinuousClock.now - $0.lastLease < Self.interval * 2 }
        if busy { return }
        if await poolLends() { return }
        let reason: String
        do {
            let connecting = try await probeConnects()
            // Over a slow link (TLS to a distant server) the pool's own new connection may need
            // longer than the check gave it: it gets twice what the probe took before it is judged.
            if connecting * 2 > Self.checkTimeout, await poolLends(within: connecting * 2) { return }
            await replace()
            return
        } catch {
            reason = PostgresCatalog.describe(error)
        }
        let first = state.withLock { state in
            defer { state.away = true }
            return !state.away
        }
        if first { logger.warning("\(location) does not answer (\(reason)); what needs it fails (grants answer 503) until it does") }
    }

    /// Whether the pool lends a connection (and answers on it) within `limit`.
    private func poolLends(within limit: Duration = PoolKeeper.checkTimeout) async -> Bool {
        (try? await withConnection(deadline: limit) { connection in try await connection.query("SELECT 1", logger: self.poolLogger) }) != nil
    }

    /// How long a connection of the keeper's own took to open, or why it did not within
    /// ``probeTimeout``. A server that accepts but never answers (frozen) would hold the connect
    /// for good, so the attempt is left to end by itself rather than waited for.
    private func probeConnects() async throws -> Duration {
        let probe = probe, logger = poolLogger
        let outcome = ProbeOutcome()
        let attempt = Task {
            let clock = ContinuousClock(), start = clock.now
            do {
                let connection = try await PostgresConnection.connect(configuration: probe, id: 0, logger: logger)
                let took = clock.now - start
                try? await connection.close()
                outcome.settle(.success(took))
            } catch {
                outcome.settle(.failure(error))
            }
        }
        let timer = Task {
            try? await Task.sleep(for: Self.probeTimeout)
            outcome.settle(.failure(DeadlinePassed()))
        }
        defer {
            attempt.cancel()
            timer.cancel()
        }
        return try await outcome.value.get()
    }

    /// A fresh pool in the stuck one's place. The old one is shut down: its waiting requests fail
    /// at once, and their callers (a grant, the revocation listener) try again on the new one.
    private func replace() async {
        let fresh = PostgresClient(configuration: configuration, backgroundLogger: poolLogger)
        let runner = Self.start(fresh)
        let old = state.withLock { state in
            let old = state.runner
            state.client = fresh
            state.runner = runner
            state.retired.append(old)
            state.replacements += 1
            state.lastLease = .now
            state.away = false
            return old
        }
        old.cancel()
        logger.notice(
            "\(location) answers again, but its connection pool was still waiting to retry (PostgresNIO's backoff grows to a minute): started a fresh pool")
    }

    /// Shuts every pool down and waits for them.
    func close() async {
        let runners = state.withLock { [$0.runner] + $0.retired }
        for runner in runners { runner.cancel() }
        for runner in runners { await runner.value }
    }
}

/// The first of several results, which a waiter reads.
private final class ProbeOutcome: Sendable {
    private let state = Mutex<(result: Result<Duration, any Error>?, waiter: CheckedContinuation<Result<Duration, any Error>, Never>?)>((nil, nil))

    func settle(_ result: Result<Duration, any Error>) {
        let waiter = state.withLock { state -> CheckedContinuation<Result<Duration, any Error>, Never>? in
            guard state.result == nil else { return nil }
            state.result = result
            defer { state.waiter = nil }
            return state.waiter
        }
        waiter?.resume(returning: result)
    }

    var value: Result<Duration, any Error> {
        get async {
            await withCheckedContinuation { continuation in
                let ready = state.withLock { state -> Result<Duration, any Error>? in
                    if let result = state.result { return result }
                    state.waiter = continuation
                    return nil
                }
                if let ready { continuation.resume(returning: ready) }
            }
        }
    }
}

import CatalogPostgres
import ContentArchive
import ContentCatalog
import Foundation
import IAPTestSupport
import Logging
import Synchronization
import Testing

/// What only PostgreSQL does: several processes (replicas) on one database.
@Suite("The catalog in PostgreSQL")
struct PostgresCatalogTests {
    @Test("replicas starting together migrate once; two publishing the same version at once: one publishes, the other finds it unchanged")
    func concurrentReplicas() async throws {
        let url = try await PostgresServer.shared().createDatabase()
        let folder = try TemporaryFolder()
        let catalogs = try await withThrowingTaskGroup(of: PostgresCatalog.self) { group in
            for _ in 0..<4 { group.addTask { try await testCatalog(url) } }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        #expect(try await PostgresServer.shared().psql(url, "SELECT string_agg(version::text, ',' ORDER BY version) FROM iap_schema") == "1,2,3,4,5,6")

        try folder.write("content/level.json", "level\n")
        let packed = try ArchivePacker.pack(
            folder: folder.sub("content"),
            options: .init(productId: try ProductIdentifier("com.example.race"), contentVersion: try ContentVersion("1.0"), outputDirectory: folder.sub("out")))
        let stores = try catalogs.map { try ContentStore(dataDirectory: folder.sub("data"), database: $0) }
        let outcomes = try await withThrowingTaskGroup(of: PublishOutcome.self) { group in
            for store in stores { group.addTask { try await store.publish(archiveAt: packed.archivePath) } }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        #expect(outcomes.filter { if case .published = $0 { true } else { false } }.count == 1)
        #expect(outcomes.filter { if case .unchanged = $0 { true } else { false } }.count == 3)
        #expect(try await PostgresServer.shared().psql(url, "SELECT COUNT(*) FROM versions") == "1")
        for catalog in catalogs { await catalog.close() }
    }

    @Test("a refund applied through one connection is announced to another that listens (LISTEN/NOTIFY)")
    func revocationsAreAnnounced() async throws {
        let url = try await PostgresServer.shared().createDatabase()
        let writer = try await testCatalog(url), listener = try await testCatalog(url)
        let (changes, continuation) = AsyncStream.makeStream(of: RevocationChange.self)
        let watching = Task { _ = await listener.watchRevocations { continuation.yield($0) } }
        var iterator = changes.makeAsyncIterator()
        // The first thing a listener hears is to read everything (it may have missed changes).
        #expect(await iterator.next() == .resynchronize)
        let refund = NotificationRecord(
            uuid: "n1", type: "REFUND", subtype: nil, transactionId: "t42", revoke: true, revokedAt: Date(), receivedAt: Date(), signedPayload: "x")
        #expect(try await writer.apply(refund) == .applied)
        #expect(await iterator.next() == .revoked(transactionId: "t42"))
        // A duplicate changes nothing and announces nothing; the reversal is announced.
        #expect(try await writer.apply(refund) == .duplicate)
        var reversal = refund
        reversal.uuid = "n2"
        reversal.type = "REFUND_REVERSED"
        reversal.revoke = false
        #expect(try await writer.apply(reversal) == .applied)
        #expect(await iterator.next() == .restored(transactionId: "t42"))
        watching.cancel()
        await writer.close()
        await listener.close()
    }

    @Test("a catalog used as soon as it opens asks its pool for a connection only once the pool runs: no PostgresNIO warning in an operator's log")
    func noLeaseBeforeThePoolRuns() async throws {
        let url = try await PostgresServer.shared().createDatabase()
        let log = CapturedLog()
        // The migration leases a connection right after the pool starts: with any suspension
        // between the pool's task starting and its `run()` (the signal the keeper waited for
        // came before it), some opens warned (one `iap-server publish` in sixteen on a busy
        // machine), and with a suspension of a few milliseconds there, every one.
        for _ in 0..<20 {
            let catalog = try await PostgresCatalog(url: url, operationTimeout: .seconds(60), logger: Logger(label: "test") { _ in log })
            await catalog.close()
        }
        #expect(log.messages.filter { $0.contains("run()") }.isEmpty, "\(log.messages)")
    }

    @Test("bad URLs and unreachable servers are named, with the fix")
    func errors() async throws {
        for (url, expected) in [
            ("mysql://u:secret@h/db", "the database URL ('mysql:') is not a PostgreSQL URL"),
            ("postgres://u:secret@h1:5432,h2:5432/db", "names several hosts, which iap-server does not take"),
            ("postgres://u:se cret/x@h/db", "percent-encode @ : / and spaces"),
            ("postgres://u@127.0.0.1/db?sslmode=sometimes", "sslmode=sometimes"),
            ("postgres://u@127.0.0.1/db?pool_max_conns=1", "pool_max_conns=1 in the database URL is not a number from 2 to 1000"),
            ("postgres://u@127.0.0.1/db?pool_max_conns=many", "give, say, pool_max_conns=10"),
        ] {
            let error = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: url) }
            #expect(error.message.contains(expected), "\(error.message)")
            #expect(!error.message.contains("secret"), "a password in a message: \(error.message)")
        }
        let port = try freePort()
        let error = try await #require(throws: CatalogError.self) { try await PostgresCatalog(url: "postgres://iap@127.0.0.1:\(port)/none?sslmode=disable") }
        #expect(error.code == .storage)
        #expect(error.message.contains("PostgreSQL at 127.0.0.1:\(port)/none"), "\(error.message)")
        #expect(error.message.contains("check that it runs"), "\(error.message)")
        // The server's own reason, not a retry loop.
        let server = try await PostgresServer.shared()
        let wrong = try await #require(throws: CatalogError.self) {
            try await PostgresCatalog(url: "postgres://iap@127.0.0.1:\(server.port)/nosuch?sslmode=disable")
        }
        #expect(wrong.message.contains("database \"nosuch\" does not exist"), "\(wrong.message)")
    }

    @Test("pool_max_conns bounds the connections one replica opens, however many requests wait")
    func connectionLimit() async throws {
        let server = try await PostgresServer.shared()
        let url = try await server.createDatabase()
        let catalog = try await testCatalog(url + "&pool_max_conns=2")
        // Requests queue behind a lock another session holds, so each would want a connection of
        // its own; without the limit the pool opens one per request.
        let holder = Task { try await server.psql(url, "BEGIN; LOCK TABLE versions IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(2); COMMIT") }
        let counts = try await withThrowingTaskGroup(of: Int.self) { group in
            for _ in 0..<6 { group.addTask { try await catalog.versions(productId: nil).count } }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        _ = try await holder.value
        #expect(counts == Array(repeating: 0, count: 6))
        let open = try await server.psql(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        #expect(Int(open).map { $0 >= 1 && $0 <= 2 } == true, "connections open: \(open)")
        // Connections held past the keeper's look are a busy pool, not a stuck one: it stays.
        #expect(catalog.poolReplacements == 0)
        await catalog.close()
    }

    @Test("after an outage long enough for PostgresNIO's pool to back off for seconds, the catalog answers once the database is back: the waiting pool is replaced")
    func stuckPoolReplaced() async throws {
        let server = try await PostgresServer.start()
        let url = try await server.createDatabase()
        let catalog = try await testCatalog(url)
        // As a replica's revocation listener does, something waits for a connection throughout.
        let listens = Mutex(0)
        let watching = Task { _ = await catalog.watchRevocations { if $0 == .resynchronize { listens.withLock { $0 += 1 } } } }
        // Listening before the outage: a listener that first listens after it counts only once
        // (a loaded machine started the task after the stop, and the test waited for a second).
        let first = await waitUntil(.seconds(30)) { listens.withLock { $0 } >= 1 }
        #expect(first != nil, "the revocation listener did not listen")
        try await server.stop()
        // The pool's attempts are counted at a stand-in on the database's port. At the 20th failed
        // attempt it waits 6.9 s before the next: long after the database is back.
        let standIn = try StandInListener(port: server.port)
        let counted = await waitUntil(.seconds(120)) { standIn.poolAttempts >= 20 }
        #expect(counted != nil, "the pool tried \(standIn.poolAttempts) times")
        #expect(!catalog.isAnswering)
        standIn.close()
        try await server.restart()
        // A request that comes before the keeper's next look may still be refused by the old pool
        // (after a minute of failures PostgresNIO refuses at once): the catalog answers soon after.
        let answered = await waitUntilAnswered(.seconds(30)) { (try? await catalog.versions(productId: nil))?.isEmpty == true }
        #expect(answered != nil, "the catalog did not answer after PostgreSQL came back")
        #expect(catalog.poolReplacements == 1)
        #expect(catalog.isAnswering)
        // The revocation listener, whose wait the old pool's shutdown ended, listens on the new one.
        let listening = await waitUntil(.seconds(30)) { listens.withLock { $0 } >= 2 }
        #expect(listening != nil, "the revocation listener did not listen again: it listened \(listens.withLock { $0 }) times")
        watching.cancel()
        await catalog.close()
        try await server.stop(mode: "immediate")
    }
}

extension PostgresCatalogTests {
    @Test("a database that stops answering but keeps its connections open (frozen): an operation is refused at its deadline, not held; the catalog answers once it thaws")
    func frozenDatabase() async throws {
        let server = try await PostgresServer.start()
        let url = try await server.createDatabase()
        let catalog = try await PostgresCatalog(url: url, operationTimeout: .seconds(2))
        #expect(try await catalog.versions(productId: nil).isEmpty)
        try server.signal(SIGSTOP)
        let outcome = Mutex<String?>(nil)
        let asking = Task {
            let text: String
            do { text = "answered: \(try await catalog.versions(productId: nil))" } catch { text = (error as? CatalogError)?.message ?? "\(error)" }
            outcome.withLock { $0 = text }
        }
        // Bounded: if the deadline did not hold, the server is thawed anyway so that the test ends.
        let refused = await waitUntil(.seconds(20)) { outcome.withLock { $0 } != nil }
        try server.signal(SIGCONT)
        await asking.value
        #expect(refused != nil, "the operation was held past its deadline")
        #expect(outcome.withLock { $0 }?.contains("did not answer within 2.0 seconds") == true, "\(outcome.withLock { $0 } ?? "")")
        let answered = await waitUntilAnswered(.seconds(30)) { (try? await catalog.versions(productId: nil))?.isEmpty == true }
        #expect(answered != nil, "the catalog did not answer after the database thawed")
        await catalog.close()
        try await server.stop(mode: "immediate")
    }
}

/// A listener on a stopped database's port that takes each connection, reads its startup message
/// and closes it: to the client, a database that goes away at once. It counts the attempts that
/// are not the catalog's own reconnect probe (named by its application_name).
private final class StandInListener: Sendable {
    private let socket: Int32
    private let attempts = Mutex(0)

    var poolAttempts: Int { attempts.withLock { $0 } }

    init(port: Int) throws {
        let fd = Glibc.socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        var yes: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, socklen_t(MemoryLayout<Int32>.size))
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = UInt16(port).bigEndian
        let bound = withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0 }
        }
        guard bound, listen(fd, 16) == 0 else {
            Glibc.close(fd)
            throw CocoaError(.fileWriteUnknown, userInfo: [NSLocalizedDescriptionKey: "cannot listen on 127.0.0.1:\(port): \(String(cString: strerror(errno)))"])
        }
        socket = fd
        Thread { [self] in
            while true {
                let client = accept(fd, nil, nil)
                guard client >= 0 else { return }
                var timeout = timeval(tv_sec: 1, tv_usec: 0)
                setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
                var buffer = [UInt8](repeating: 0, count: 4096)
                let count = read(client, &buffer, buffer.count)
                let startup = count > 0 ? String(decoding: buffer[..<count], as: UTF8.self) : ""
                if !startup.contains("reconnect probe") { self.attempts.withLock { $0 += 1 } }
                Glibc.close(client)
            }
        }.start()
    }

    /// Stops taking connections and frees the port.
    func close() {
        shutdown(socket, Int32(SHUT_RDWR))
        Glibc.close(socket)
    }
}

/// Every message logged at warning or above, kept for a test to read.
private struct CapturedLog: LogHandler {
    private final class Kept: Sendable { let lines = Mutex<[String]>([]) }
    private let kept = Kept()
    var messages: [String] { kept.lines.withLock { $0 } }
    var metadata: Logger.Metadata = [:]
    var logLevel: Logger.Level = .warning
    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }
    func log(event: LogEvent) {
        kept.lines.withLock { $0.append("\(event.level): \(event.message)") }
    }
}

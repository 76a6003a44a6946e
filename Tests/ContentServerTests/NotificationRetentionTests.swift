import Foundation
import IAPTestSupport
import Testing

extension ServerTests {
    @Test("stored notifications older than --notification-retention are deleted at start, their revocations kept; a retention under 181 days is refused")
    func notificationRetention() throws {
        let tmp = try TemporaryFolder()
        let (_, first, data) = try start(tmp)
        #expect(first.stop() == 0)
        // Three refunds from two years ago and one from today, as a long-running server holds them.
        let catalog = data + "/catalog.sqlite"
        let rows = (0..<3).map { "('old-\($0)', 'REFUND', 't\($0)', '2024-11-01 00:00:00.000', 'x')" } + ["('new', 'DID_RENEW', 't9', datetime('now') || '.000', 'x')"]
        let filled = try run(
            "sqlite3",
            [
                catalog,
                "INSERT INTO notifications (uuid, type, transactionId, receivedAt, signedPayload) VALUES \(rows.joined(separator: ", "));"
                    + "INSERT INTO revocations (transactionId, revokedAt, notificationUUID) VALUES ('t0', '2024-11-01 00:00:00.000', 'old-0')",
            ])
        #expect(filled.status == 0, "\(filled.stderr)")

        let (_, server, _) = try start(tmp, data: data)
        defer { _ = server.stop() }
        let deadline = Date().addingTimeInterval(20)
        var log = ""
        while Date() < deadline, !log.contains("deleted 3 stored notification(s)") {
            log = (try? String(contentsOfFile: server.log, encoding: .utf8)) ?? ""
            usleep(50_000)
        }
        #expect(log.contains("deleted 3 stored notification(s) received before") && log.contains("--notification-retention 400 days"), "\(log)")
        let left = try run("sqlite3", [catalog, "SELECT group_concat(uuid) FROM notifications; SELECT group_concat(transactionId) FROM revocations"])
        #expect(left.stdout == "new\nt0\n", "\(left.stdout)")

        let binary = productsDirectory() + "/iap-server"
        let short = try run(binary, ["serve", "--data", tmp.sub("other"), "--bundle-id", bundleId, "--notification-retention", "30"])
        #expect(short.status == 64 && short.stderr.contains("must be 0 (for ever) or at least 181 days, not 30"), "\(short.stderr)")
    }

    @Test("with notifications kept for ever and no periodic read of the archives (both 0), the server runs and stops cleanly: a service turned off is not a failure")
    func servicesTurnedOff() throws {
        let tmp = try TemporaryFolder()
        let (_, server, _) = try start(tmp, extra: ["--notification-retention", "0", "--archive-check-interval", "0"])
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200)
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200)
        let status = server.stop()
        let log = (try? String(contentsOfFile: server.log, encoding: .utf8)) ?? ""
        #expect(status == 0 && !log.contains("finished unexpectedly"), "\(status): \(log)")
    }
}

import ContentCatalog
import Foundation
import IAPTestSupport
import SandboxStore
import Testing

extension ServerTests {
    /// `iap-server reconcile` with the sandbox's App Store Server API as the notification history.
    @Test(
        "a refund sent while the server was down is applied by reconcile: new grants and the old URL are refused; repeating changes nothing",
        arguments: Backend.allCases)
    func reconcileMissedRefund(backend: Backend) async throws {
        let tmp = try TemporaryFolder()
        let database = backend == .postgres ? try await PostgresServer.shared().createDatabase() : nil
        var (store, server, data) = try start(tmp, database: database)
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp, manifest: packed.manifest).status == 201)
        let purchase = try store.purchase(productId: product)
        let transactionId = try #require(purchase.transaction.transactionId)
        let granted = try grant(purchase.signedTransaction, server: server, tmp: tmp)
        let url = try #require(((granted.json["downloads"] as? [[String: Any]])?.first)?["url"] as? String)
        let contentPath = String(url.dropFirst(server.base.count))
        let window = Date().addingTimeInterval(-3600).formatted(.iso8601)

        // Down: the refund's notification finds nobody; the sandbox records the failed attempt.
        #expect(try server.stopKeepingPort() == 0)
        let notifyURL = server.base + "/v1/notifications"
        let refund = try run(productsDirectory() + "/iap-sandbox", ["refund", "--dir", store.folder, transactionId, "--notify", notifyURL])
        #expect(refund.status == 1 && refund.stderr.contains("iap-server reconcile"), "\(refund.stderr)")
        #expect(try store.notifications().map { $0.sendAttempts.map(\.sendAttemptResult) } == [["NO_RESPONSE"]])

        // Up again: it has not heard of the refund.
        (store, server, data) = try start(tmp, data: data, database: database)
        defer { _ = server.stop() }
        #expect(try curl([server.base + contentPath], folder: tmp).status == 200)
        #expect(try grant(purchase.signedTransaction, server: server, tmp: tmp).status == 200)

        let keyOutput = try run(productsDirectory() + "/iap-sandbox", ["api-key", "--dir", store.folder, "--json", "--output", tmp.sub("key.p8")])
        let key = try #require(try JSONSerialization.jsonObject(with: Data(keyOutput.stdout.utf8)) as? [String: String])
        let api = try ServerProcess(data: store.folder, arguments: [], folder: tmp, tool: "iap-sandbox", dataFlag: "--dir")
        defer { _ = api.stop() }
        let credentials =
            [
                "--data", data, "--bundle-id", bundleId, "--key-file", tmp.sub("key.p8"), "--key-id", key["keyId"] ?? "",
                "--issuer-id", key["issuerId"] ?? "", "--api-url", api.base, "--environment", "sandbox", "--since", window,
            ] + (database.map { ["--database", $0] } ?? [])
        let reconcile = productsDirectory() + "/iap-server"

        // Without the sandbox root the history's payloads do not verify: reported, nothing applied.
        let untrusted = try run(reconcile, ["reconcile"] + credentials)
        #expect(untrusted.status == 1 && untrusted.stdout.contains("REFUSED") && untrusted.stdout.contains("untrusted-chain"), "\(untrusted.stdout)\(untrusted.stderr)")
        #expect(try grant(purchase.signedTransaction, server: server, tmp: tmp).status == 200)

        let applied = try run(reconcile, ["reconcile", "--trust-root", store.rootCertificatePath, "--json"] + credentials)
        #expect(applied.status == 0, "\(applied.stderr)")
        let report = try #require(try JSONSerialization.jsonObject(with: Data(applied.stdout.utf8)) as? [String: Any])
        #expect(report["fetched"] as? Int == 1 && report["applied"] as? Int == 1)
        #expect(report["revoked"] as? [String] == [transactionId])

        // New grants are refused at once (the ledger is read); the running server's content path
        // picks the revocation up at its next refresh (2 s).
        let regrant = try grant(purchase.signedTransaction, server: server, tmp: tmp)
        #expect(regrant.status == 403 && regrant.errorCode == "revoked")
        let deadline = Date().addingTimeInterval(15)
        var status = 0
        repeat {
            status = try curl([server.base + contentPath], folder: tmp).status
        } while status != 403 && Date() < deadline
        #expect(status == 403)

        // Safe to repeat; the ledger holds the notification once, as if it had been POSTed.
        let again = try run(reconcile, ["reconcile", "--trust-root", store.rootCertificatePath] + credentials)
        #expect(again.status == 0 && again.stdout.contains("0 applied, 1 already known"), "\(again.stdout)")
        let ledger = try await openStore(data, databaseURL: database)
        #expect(try await ledger.notificationCount() == 1)
        await ledger.database.close()

        // Through a proxy that inspects TLS (here the shipped edge, with a private authority's
        // certificate): refused, naming --ca-file, until that authority is given.
        if backend == .sqlite {
            let authority = try TestCertificates(folder: tmp.sub("ca"))
            let edge = try NginxServer(replicaPorts: [api.port], folder: tmp, certificate: try authority.server("api", names: ["IP:127.0.0.1"]))
            let overTLS = credentials.map { $0 == api.base ? edge.base : $0 }
            let refused = try run(reconcile, ["reconcile", "--timeout", "3", "--trust-root", store.rootCertificatePath] + overTLS)
            #expect(refused.status == 2 && refused.stderr.contains("is not trusted") && refused.stderr.contains("--ca-file"), "\(refused.stderr)")
            let trusted = try run(reconcile, ["reconcile", "--ca-file", authority.authority, "--trust-root", store.rootCertificatePath] + overTLS)
            #expect(trusted.status == 0 && trusted.stdout.contains("0 applied, 1 already known"), "\(trusted.stdout)\(trusted.stderr)")
            let missing = try run(reconcile, ["reconcile", "--ca-file", tmp.sub("none.pem")] + overTLS)
            #expect(missing.status == 1 && missing.stderr.contains("--ca-file"), "\(missing.stderr)")
        }

        // Clear errors: an API nobody answers, a wrong key, a window Apple does not keep.
        let closed = credentials.map { $0 == api.base ? "http://127.0.0.1:1" : $0 }
        let unreachable = try run(reconcile, ["reconcile", "--timeout", "2", "--trust-root", store.rootCertificatePath] + closed)
        #expect(unreachable.status == 2 && unreachable.stderr.contains("cannot reach"), "\(unreachable.stderr)")
        let wrongKey = credentials.map { $0 == key["keyId"] ? "ZZZZZZZZZZ" : $0 }
        let unauthorized = try run(reconcile, ["reconcile"] + wrongKey)
        #expect(unauthorized.status == 2 && unauthorized.stderr.contains("401"), "\(unauthorized.stderr)")
        let old = credentials.map { $0 == window ? "2020-01-01" : $0 }
        let tooOld = try run(reconcile, ["reconcile"] + old)
        #expect(tooOld.status == 64 && tooOld.stderr.contains("180 days"), "\(tooOld.stderr)")
    }
}

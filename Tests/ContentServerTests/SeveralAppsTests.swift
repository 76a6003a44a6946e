import ContentArchive
import Foundation
import IAPTestSupport
import SandboxStore
import Testing

extension ServerTests {
    @Test("one server for two apps of an account: each app's purchases, receipts and refunds count; a third app's are refused naming both")
    func severalApps() throws {
        let tmp = try TemporaryFolder()
        // Two apps of one developer account, each with its sandbox store (its own chains), and a
        // third app whose chain the server trusts but whose bundle id it was not given.
        let game = try SandboxStore.initialize(folder: tmp.sub("game"), bundleId: "com.example.cosmos")
        let music = try SandboxStore.initialize(folder: tmp.sub("music"), bundleId: "com.example.soundkit")
        let stranger = try SandboxStore.initialize(folder: tmp.sub("stranger"), bundleId: "com.example.stranger")
        _ = try music.receiptAuthority()
        try adminToken.write(toFile: tmp.sub("admin-token"), atomically: true, encoding: .utf8)
        chmod(tmp.sub("admin-token"), 0o600)
        let server = try ServerProcess(
            data: tmp.sub("data"),
            arguments: [
                "--bundle-id", "com.example.cosmos", "--bundle-id", "com.example.soundkit",
                "--trust-root", game.rootCertificatePath, "--trust-root", music.rootCertificatePath, "--trust-root", music.receiptRootCertificatePath,
                "--trust-root", stranger.rootCertificatePath, "--environment", "sandbox", "--admin-token-file", tmp.sub("admin-token"),
            ], folder: tmp)
        defer { _ = server.stop() }
        let log = try String(contentsOfFile: server.log, encoding: .utf8)
        #expect(log.contains("for 'com.example.cosmos', 'com.example.soundkit' (Sandbox)"), "\(log)")

        let levels = try pack(tmp, product: "com.example.cosmos.levels1")
        let drums = try pack(tmp, product: "com.example.soundkit.drums")
        #expect(try upload(levels.archivePath, server: server, tmp: tmp, manifest: levels.manifest).status == 201)
        #expect(try upload(drums.archivePath, server: server, tmp: tmp, manifest: drums.manifest).status == 201)

        // Each app's purchase is granted its own product's archive.
        for (store, packed, product) in [(game, levels, "com.example.cosmos.levels1"), (music, drums, "com.example.soundkit.drums")] {
            let granted = try grant(try store.purchase(productId: product).signedTransaction, server: server, tmp: tmp)
            #expect(granted.status == 200, "\(granted.text)")
            let url = try #require((granted.json["downloads"] as? [[String: Any]])?.first?["url"] as? String)
            let fetched = try curl([url], folder: tmp)
            let archive = try Data(contentsOf: URL(fileURLWithPath: packed.archivePath))
            #expect(fetched.status == 200 && fetched.body == archive)
        }

        // A third app's purchase verifies (its chain is trusted) but is not for this server.
        let foreign = try grant(try stranger.purchase(productId: "com.example.cosmos.levels1").signedTransaction, server: server, tmp: tmp)
        #expect(foreign.status == 403 && foreign.errorCode == "wrong-bundle-id", "\(foreign.text)")
        #expect(foreign.text.contains("not one of the configured 'com.example.cosmos', 'com.example.soundkit'"), "\(foreign.text)")

        // The second app's StoreKit 1 receipt grants, and its refund notification is taken and cuts access.
        let bought = try music.purchase(productId: "com.example.soundkit.drums")
        let receipt = try music.receipt()
        #expect(try receiptGrant(receipt, server: server, tmp: tmp, transactionId: bought.transaction.transactionId).status == 200)
        let refund = try music.refund(transactionId: bought.transaction.transactionId!)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)
        let cut = try grant(bought.signedTransaction, server: server, tmp: tmp)
        #expect(cut.status == 403 && cut.errorCode == "revoked", "\(cut.text)")
        #expect(try receiptGrant(receipt, server: server, tmp: tmp, transactionId: bought.transaction.transactionId).errorCode == "revoked")

        // The third app's notifications are refused, so they cannot revoke the others' purchases.
        let strangerRefund = try stranger.refund(transactionId: try stranger.purchase(productId: "com.example.cosmos.levels1").transaction.transactionId!)
        #expect(try postJSON(server.base + "/v1/notifications", ["signedPayload": strangerRefund.signedPayload], folder: tmp).status != 200)
    }

    @Test("--bundle-id and IAP_BUNDLE_ID take several apps, repeated or comma-separated; a bad one is named; reconcile asks for one")
    func severalAppsOptions() throws {
        let tmp = try TemporaryFolder()
        let viaEnvironment = try ServerProcess(
            data: tmp.sub("data"), arguments: ["--environment", "sandbox"], folder: tmp,
            environment: ["IAP_BUNDLE_ID": "com.example.cosmos, com.example.soundkit"])
        let log = try String(contentsOfFile: viaEnvironment.log, encoding: .utf8)
        #expect(viaEnvironment.stop() == 0)
        #expect(log.contains("for 'com.example.cosmos', 'com.example.soundkit' (Sandbox)"), "\(log)")

        let server = productsDirectory() + "/iap-server"
        let bad = try run(server, ["serve", "--data", tmp.sub("data"), "--bundle-id", "com.example.cosmos,com.example/x"])
        #expect(bad.status == 64 && bad.stderr.contains("--bundle-id 'com.example/x' is not a bundle identifier"), "\(bad.stderr)")
        let none = try run(server, ["serve", "--data", tmp.sub("data")], environment: ProcessInfo.processInfo.environment.filter { $0.key != "IAP_BUNDLE_ID" })
        #expect(none.status == 64 && none.stderr.contains("repeat it, or separate them with commas, for several apps"), "\(none.stderr)")
        let reconcile = try run(
            server, ["reconcile", "--data", tmp.sub("data"), "--since", "2026-11-20"],
            environment: ProcessInfo.processInfo.environment.merging(["IAP_BUNDLE_ID": "com.example.cosmos,com.example.soundkit"]) { $1 })
        #expect(reconcile.status == 64 && reconcile.stderr.contains("run reconcile once per app, with --bundle-id"), "\(reconcile.stderr)")
    }
}

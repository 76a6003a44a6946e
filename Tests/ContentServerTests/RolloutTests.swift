import ContentArchive
import ContentCatalog
import Foundation
import IAPTestSupport
import Testing

extension ServerTests {
    @Test("staged rollout by transaction id, widened stably, rolled back at once, promoted; the catalog API and CLI show it", arguments: Backend.allCases)
    func stagedRollout(backend: Backend) async throws {
        let tmp = try TemporaryFolder()
        let database = backend == .postgres ? try await PostgresServer.shared().createDatabase() : nil
        let (store, server, data) = try start(tmp, database: database)
        // The command-line tools open the same store as the server.
        let storeOptions = database.map { ["--database", $0] } ?? []
        #expect(try upload(try packSample(tmp, version: "1.0").archivePath, server: server, tmp: tmp).status == 201)
        let staged = try run(productsDirectory() + "/iap-server", ["publish", "--data", data, "--rollout", "30", try packSample(tmp, version: "1.1").archivePath] + storeOptions)
        #expect(staged.status == 0 && staged.stdout.contains("staged for 30% of purchases"), "\(staged.stderr)")

        let purchases = try (0..<40).map { _ in try store.purchase(productId: product) }
        func versions() throws -> [String] {
            try purchases.map { purchase in
                let granted = try grant(purchase.signedTransaction, server: server, tmp: tmp)
                return ((granted.json["downloads"] as? [[String: Any]])?.first?["contentVersion"] as? String) ?? "refused \(granted.status)"
            }
        }
        func expected(_ percent: Int) -> [String] {
            purchases.map { ContentStore.rolloutBucket(productId: product, transactionId: $0.transaction.transactionId!) < percent ? "1.1" : "1.0" }
        }
        let at30 = try versions()
        #expect(at30 == expected(30))
        #expect(at30.contains("1.1") && at30.contains("1.0"), "40 purchases all on one side of 30%: \(at30)")
        let info = try curl([server.base + "/v1/products/\(product)"], folder: tmp)
        #expect(info.json["contentVersion"] as? String == "1.0")
        #expect((info.json["versions"] as? [[String: Any]])?.first?["rolloutPercent"] as? Int == 30)

        // Widening keeps every purchase that had 1.1.
        func admin(_ body: [String: Any], token: String? = nil) throws -> HTTPResult {
            try postJSON(server.base + "/v1/admin/rollouts", body, headers: ["Authorization: Bearer \(token ?? adminToken)"], folder: tmp)
        }
        #expect(try admin(["productId": product, "contentVersion": "1.1", "percent": 60]).status == 200)
        let at60 = try versions()
        #expect(at60 == expected(60))
        #expect(zip(at30, at60).allSatisfy { $0 != "1.1" || $1 == "1.1" })
        // A renewal (a new transaction id of the same original purchase) stays with its purchase's
        // version, even where its own id falls on the other side of the rollout.
        let flipping = purchases.filter { purchase in
            let renewal = purchase.transaction.transactionId! + "9"
            return (ContentStore.rolloutBucket(productId: product, transactionId: renewal) < 60)
                != (ContentStore.rolloutBucket(productId: product, transactionId: purchase.transaction.transactionId!) < 60)
        }
        #expect(!flipping.isEmpty, "no renewal id falls on the other side of 60%")
        for purchase in flipping {
            var renewal = purchase.transaction
            renewal.transactionId = purchase.transaction.transactionId! + "9"
            let granted = try grant(try store.sign(renewal), server: server, tmp: tmp)
            let version = (granted.json["downloads"] as? [[String: Any]])?.first?["contentVersion"] as? String
            #expect(version == at60[purchases.firstIndex { $0.transaction.transactionId == purchase.transaction.transactionId }!], "\(granted.text)")
        }
        // A pinned request gets a staged version only inside its rollout.
        let outside = try #require(purchases.first { ContentStore.rolloutBucket(productId: product, transactionId: $0.transaction.transactionId!) >= 60 })
        #expect(try grant(outside.signedTransaction, server: server, tmp: tmp, version: "1.1").status == 404)

        // Rolled back: everyone gets 1.0 from the next grant on.
        let rolledBack = try run(productsDirectory() + "/iap-server", ["rollback", "--data", data, product, "1.1"] + storeOptions)
        #expect(rolledBack.status == 0, "\(rolledBack.stderr)")
        #expect(try versions() == Array(repeating: "1.0", count: 40))
        let catalog = try run(productsDirectory() + "/iap-server", ["catalog", "--data", data] + storeOptions)
        #expect(catalog.stdout.contains("rolled back"))

        // Promoted: everyone gets 1.1, and the product's current version is 1.1.
        #expect(try run(productsDirectory() + "/iap-server", ["rollout", "--data", data, product, "1.1", "--promote"] + storeOptions).status == 0)
        #expect(try versions() == Array(repeating: "1.1", count: 40))
        #expect(try curl([server.base + "/v1/products/\(product)"], folder: tmp).json["contentVersion"] as? String == "1.1")

        // Bad requests are named.
        #expect(try admin(["productId": product, "contentVersion": "1.1", "percent": 10], token: "wrong").status == 401)
        #expect(try admin(["productId": product, "contentVersion": "9.9", "percent": 10]).status == 404)
        #expect(try admin(["productId": product, "contentVersion": "1.1", "percent": 0]).status == 400)
        #expect(try admin(["productId": product, "contentVersion": "1.1", "percent": 10, "rollBack": true]).status == 400)
        let unknown = try run(productsDirectory() + "/iap-server", ["rollout", "--data", data, product, "7.0", "--percent", "5"] + storeOptions)
        #expect(unknown.status == 1 && unknown.stderr.contains("is not published"))

        // The last version served to purchases is not rolled back or narrowed by mistake: 1.0
        // may go while 1.1 serves everyone, then 1.1 may not, unless asked for on purpose.
        #expect(try run(productsDirectory() + "/iap-server", ["rollback", "--data", data, product, "1.0"] + storeOptions).status == 0)
        let last = try run(productsDirectory() + "/iap-server", ["rollback", "--data", data, product, "1.1"] + storeOptions)
        #expect(last.status == 1 && last.stderr.contains("would leave 100% of its purchases with no version") && last.stderr.contains("--allow-unserved"), "\(last.stderr)")
        let narrowed = try admin(["productId": product, "contentVersion": "1.1", "percent": 20])
        #expect(narrowed.status == 409 && narrowed.errorCode == "conflict" && narrowed.text.contains("80% of its purchases"), "\(narrowed.text)")
        #expect(try versions() == Array(repeating: "1.1", count: 40), "a refused change took content away")
        #expect(try admin(["productId": product, "contentVersion": "1.1", "rollBack": true, "allowUnserved": true]).status == 200)
        let emptied = try run(productsDirectory() + "/iap-server", ["catalog", "--data", data] + storeOptions)
        #expect(emptied.stdout.contains("(100% of purchases are served no version"), "\(emptied.stdout)")
        #expect(server.stop() == 0)
    }
}

extension ServerTests {
    /// Whether the server process still holds a file at `path` open (deleted or not).
    func holdsOpen(_ server: ServerProcess, _ path: String) -> Bool {
        let fds = "/proc/\(server.process.processIdentifier)/fd"
        let links = (try? FileManager.default.contentsOfDirectory(atPath: fds)) ?? []
        return links.contains { ((try? FileManager.default.destinationOfSymbolicLink(atPath: fds + "/" + $0)) ?? "").hasPrefix(path) }
    }

    /// Waits, up to `seconds`, for the server to let go of `path`; true once it has.
    func released(_ server: ServerProcess, _ path: String, within seconds: Double) -> Bool {
        let deadline = Date().addingTimeInterval(seconds)
        while holdsOpen(server, path) {
            guard Date() < deadline else { return false }
            usleep(20_000)
        }
        return true
    }

    @Test("removing a rolled-back version through the admin API and the CLI: files deleted, kept handles closed, old grants 404, number taken", arguments: Backend.allCases)
    func removeVersion(backend: Backend) async throws {
        let tmp = try TemporaryFolder()
        let database = backend == .postgres ? try await PostgresServer.shared().createDatabase() : nil
        let (store, server, data) = try start(tmp, database: database)
        let storeOptions = database.map { ["--database", $0] } ?? []
        let v10 = try packSample(tmp, version: "1.0"), v11 = try packSample(tmp, version: "1.1"), v12 = try packSample(tmp, version: "1.2")
        #expect(try upload(v10.archivePath, server: server, tmp: tmp).status == 201)
        #expect(try upload(v11.archivePath, server: server, tmp: tmp).status == 201)
        let purchase = try store.purchase(productId: product)
        func downloadURL() throws -> String {
            let granted = try grant(purchase.signedTransaction, server: server, tmp: tmp)
            return try #require((granted.json["downloads"] as? [[String: Any]])?.first?["url"] as? String)
        }
        func delete(_ version: String, token: String? = nil) throws -> HTTPResult {
            try curl(["-X", "DELETE", "-H", "Authorization: Bearer \(token ?? adminToken)", server.base + "/v1/admin/archives/\(product)/\(version)"], folder: tmp)
        }
        // Downloaded once, so the server keeps 1.1's archive open.
        let url11 = try downloadURL()
        #expect(try curl([url11], folder: tmp).status == 200)
        let archive11 = data + "/archives/" + v11.manifest.archiveSHA256 + ".zip"
        #expect(holdsOpen(server, archive11))

        let served = try delete("1.1")
        #expect(served.status == 409 && served.errorCode == "conflict" && served.text.contains("roll it back first"), "\(served.text)")
        #expect(try delete("1.1", token: "wrong").status == 401)
        #expect(try delete("9.9").status == 404)
        #expect(
            try postJSON(server.base + "/v1/admin/rollouts", ["productId": product, "contentVersion": "1.1", "rollBack": true], headers: ["Authorization: Bearer \(adminToken)"], folder: tmp).status
                == 200)
        let removed = try delete("1.1")
        #expect(removed.status == 200, "\(removed.text)")
        #expect((removed.json["version"] as? [String: Any])?["removedAt"] != nil)
        #expect((removed.json["freedBytes"] as? Int).map { $0 >= v11.manifest.archiveSize } == true)
        #expect(!FileManager.default.fileExists(atPath: archive11))
        #expect(released(server, archive11, within: 10), "the server kept the removed archive open")
        let stale = try curl([url11], folder: tmp)
        #expect(stale.status == 404 && stale.errorCode == "no-content", "\(stale.text)")
        let info = try curl([server.base + "/v1/products/\(product)"], folder: tmp)
        #expect(info.json["contentVersion"] as? String == "1.0")
        #expect((info.json["versions"] as? [[String: Any]])?.first { $0["contentVersion"] as? String == "1.1" }?["removedAt"] != nil)
        // The number stays taken.
        let republished = try upload(v11.archivePath, server: server, tmp: tmp)
        #expect(republished.status == 409 && republished.text.contains("was removed"), "\(republished.text)")

        // With the command-line tool beside the running server: it learns of the removal when it
        // next reads the catalog, and lets go of the file.
        #expect(try upload(v12.archivePath, server: server, tmp: tmp).status == 201)
        let url12 = try downloadURL()
        #expect(url12.contains("-1.2.zip"))
        #expect(try curl([url12], folder: tmp).status == 200)
        let archive12 = data + "/archives/" + v12.manifest.archiveSHA256 + ".zip"
        #expect(holdsOpen(server, archive12))
        let refused = try run(productsDirectory() + "/iap-server", ["remove", "--data", data, product, "1.2"] + storeOptions)
        #expect(refused.status == 1 && refused.stderr.contains("roll it back first"), "\(refused.stderr)")
        #expect(try run(productsDirectory() + "/iap-server", ["rollback", "--data", data, product, "1.2"] + storeOptions).status == 0)
        let cli = try run(productsDirectory() + "/iap-server", ["remove", "--data", data, product, "1.2"] + storeOptions)
        #expect(cli.status == 0 && cli.stdout.contains("1.2: removed (deleted"), "\(cli.stderr)")
        #expect(released(server, archive12, within: 20), "the server kept the archive removed by the CLI open")
        #expect(try curl([url12], folder: tmp).status == 404)
        #expect(try downloadURL().contains("-1.0.zip"))
        let catalog = try run(productsDirectory() + "/iap-server", ["catalog", "--data", data] + storeOptions)
        #expect(catalog.stdout.contains("1.1") && catalog.stdout.contains("removed"), "\(catalog.stdout)")
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200, "removed versions count as missing archives")
        // A mistyped --data is said, not made into an empty catalog, by the commands that change versions.
        if database == nil {
            for command in [["rollout", "--percent", "10"], ["rollback"], ["remove"]] {
                let typo = try run(productsDirectory() + "/iap-server", [command[0], "--data", tmp.sub("dta"), product, "1.0"] + command.dropFirst())
                #expect(typo.status == 1 && typo.stderr.contains("holds no catalog"), "\(command): \(typo.stderr)")
            }
            #expect(!FileManager.default.fileExists(atPath: tmp.sub("dta")))
        }
        #expect(server.stop() == 0)
    }
}

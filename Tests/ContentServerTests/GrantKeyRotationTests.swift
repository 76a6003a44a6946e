import Foundation
import IAPTestSupport
import Testing

extension ServerTests {
    @Test(
        "grant keys rotate while the server runs (iap-server grant-keys add, activate, retire): a URL is refused only once its key is retired; a broken key file leaves the keys in force"
    )
    func grantKeyRotation() async throws {
        let tmp = try TemporaryFolder()
        let (store, server, data) = try start(tmp)
        defer { _ = server.stop() }
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp, manifest: packed.manifest).status == 201)
        let purchase = try store.purchase(productId: product)
        func grantURL() throws -> String {
            let granted = try grant(purchase.signedTransaction, server: server, tmp: tmp)
            return try #require(((granted.json["downloads"] as? [[String: Any]])?.first)?["url"] as? String, "\(granted.text)")
        }
        func keys(_ arguments: [String]) throws -> ProcessResult {
            try run(productsDirectory() + "/iap-server", ["grant-keys"] + arguments + ["--data", data])
        }
        func status(_ url: String) throws -> Int { try curl(["-o", "/dev/null", url], folder: tmp).status }
        func logged(_ text: String) -> Bool { ((try? String(contentsOfFile: server.log, encoding: .utf8)) ?? "").contains(text) }
        let first = try grantURL()
        #expect(first.contains("/v1/content/k1."))

        // Added: accepted once read, not signing yet.
        let added = try keys(["add"])
        #expect(added.status == 0 && added.stdout.contains("added k2"), "\(added.stderr)")
        let read = await waitUntil(.seconds(30)) { logged("grants signed with 'k1', 'k2' are accepted") }
        #expect(read != nil, "the server did not read the added key")
        #expect(try grantURL().contains("/v1/content/k1."))

        // Activated as the README says: at once, with --now, since the server has said it accepts k2.
        let early = try keys(["activate", "--settle", "3600", "k2"])
        #expect(early.status == 2 && early.stderr.contains("--now"), "\(early.stderr)")
        #expect(try keys(["activate", "--now", "k2"]).status == 0)
        let signing = try await waitUntil(.seconds(20)) { try grantURL().contains("/v1/content/k2.") }
        #expect(signing != nil, "new grants were not signed with the activated key")
        let second = try grantURL()
        #expect(try status(first) == 200 && status(second) == 200)

        // k1's grants are valid for --token-ttl yet: refused, unless --now (a leaked key).
        let tooSoon = try keys(["retire", "k1"])
        #expect(tooSoon.status == 2 && tooSoon.stderr.contains("stay valid for --token-ttl (900 s)"), "\(tooSoon.stderr)")
        let retired = try keys(["retire", "--now", "k1"])
        #expect(retired.status == 0, "\(retired.stderr)")
        let refused = try await waitUntil(.seconds(20)) { try status(first) == 401 }
        #expect(refused != nil, "a URL signed with the retired key was still served")
        #expect(try status(second) == 200)
        let listing = try keys(["list"])
        #expect(listing.stdout.hasPrefix("k2  active: signs new grants (added ") && listing.stdout.split(separator: "\n").count == 1, "\(listing.stdout)")

        // A key file broken by hand: said once, and the keys read before stay in force.
        try Data("{\"active\": ".utf8).write(to: URL(fileURLWithPath: data + "/grant-keys.json"))
        let said = await waitUntil(.seconds(20)) { logged("the grant keys read before stay in force") }
        #expect(said != nil, "the server did not say the key file is broken")
        #expect(try status(second) == 200)
        #expect(try grantURL().contains("/v1/content/k2."))
        let broken = try keys(["add"])
        #expect(broken.status == 1 && broken.stderr.contains("is not a grant key file"), "\(broken.stderr)")
    }

    @Test("files holding secrets that other users may read are warned of at start, with the chmod that fixes them")
    func exposedSecretsAreWarnedOf() throws {
        let tmp = try TemporaryFolder()
        var (_, server, data) = try start(tmp)
        #expect(server.stop() == 0)
        #expect(!((try? String(contentsOfFile: server.log, encoding: .utf8)) ?? "").contains("may be read by"))
        chmod(data + "/grant-keys.json", 0o644)
        (_, server, _) = try start(tmp, data: data)
        defer { _ = server.stop() }
        let log = (try? String(contentsOfFile: server.log, encoding: .utf8)) ?? ""
        #expect(
            log.contains(
                "\(data)/grant-keys.json holds the grant keys (whoever reads them can make download URLs) and may be read by its group and every user (mode 644): chmod 600 \(data)/grant-keys.json"),
            "\(log)")
    }
}

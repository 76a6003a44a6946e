import Foundation
import IAPTestSupport
import Testing

/// The demo's path through the four command-line tools, with assertions at every step.
@Suite("End to end: pack, publish, buy, grant, fetch, install, finish, refund", .serialized, .onTestThreads)
struct EndToEndTests {
    let tools = productsDirectory()

    func tool(_ name: String, _ arguments: [String], sourceLocation: SourceLocation = #_sourceLocation) throws -> ProcessResult {
        let result = try run(tools + "/" + name, arguments)
        #expect(result.status == 0, "\(name) \(arguments.first ?? ""): \(result.stderr)", sourceLocation: sourceLocation)
        return result
    }

    @Test("the demo's path")
    func demoPath() throws {
        let tmp = try TemporaryFolder()
        let repository = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent().path
        let products = try FileManager.default.contentsOfDirectory(atPath: repository + "/content").filter { !$0.hasPrefix(".") }.sorted()
        #expect(products.count >= 2)

        // Pack every product and check each archive against its manifest.
        for product in products {
            _ = try tool("iap-pack", ["build", repository + "/content/" + product, "--output", tmp.sub("archives")])
            _ = try tool("iap-pack", ["verify", tmp.sub("archives/\(product)-1.0.zip")])
        }
        // A sandbox store, a server trusting it, and the archives published.
        _ = try tool("iap-sandbox", ["init", "--dir", tmp.sub("sandbox"), "--bundle-id", "com.example.demo"])
        for product in products {
            let published = try tool("iap-server", ["publish", "--data", tmp.sub("data"), tmp.sub("archives/\(product)-1.0.zip")])
            #expect(published.stdout.hasPrefix("published \(product) 1.0"))
        }
        let server = try ServerProcess(
            data: tmp.sub("data"),
            arguments: [
                "--bundle-id", "com.example.demo", "--trust-root", tmp.sub("sandbox/root.cer"), "--environment", "sandbox",
            ], folder: tmp)
        let catalog = try curl([server.base + "/v1/products/\(products[0])"], folder: tmp)
        #expect(catalog.status == 200 && catalog.json["contentVersion"] as? String == "1.0")

        // Buy every product: signed transactions queued, unfinished.
        var signed: [String: String] = [:]
        for product in products {
            signed[product] = try tool("iap-sandbox", ["purchase", "--dir", tmp.sub("sandbox"), "--product-id", product]).stdout
                .trimmingCharacters(in: .whitespacesAndNewlines)
        }
        #expect(try tool("iap-sandbox", ["transactions", "--dir", tmp.sub("sandbox")]).stdout.components(separatedBy: "UNFINISHED").count == products.count + 1)

        // Fetch: every product installed and identical, every transaction finished.
        let fetched = try tool("iap-fetch", ["run", "--server", server.base, "--queue", tmp.sub("sandbox/queue"), "--content-dir", tmp.sub("device")])
        #expect(fetched.stdout.components(separatedBy: "finished transaction").count == products.count + 1)
        for product in products {
            let installed = tmp.sub("device/\(product)/1.0")
            #expect(try run("diff", ["-r", repository + "/content/" + product, installed]).status == 0, "\(product) differs")
        }
        let listing = try tool("iap-sandbox", ["transactions", "--dir", tmp.sub("sandbox"), "--json"]).stdout
        let records = try JSONSerialization.jsonObject(with: Data(listing.utf8)) as? [[String: Any]] ?? []
        #expect(records.count == products.count && records.allSatisfy { $0["finishedAt"] != nil })

        // Refund the first purchase: its new grants are refused; the others still work.
        let refundedId = try #require(records.first { $0["productId"] as? String == products[0] }?["transactionId"] as? String)
        _ = try tool("iap-sandbox", ["refund", "--dir", tmp.sub("sandbox"), refundedId, "--notify", server.base + "/v1/notifications"])
        let refused = try postJSON(server.base + "/v1/downloads", ["signedTransaction": signed[products[0]]!], folder: tmp)
        #expect(refused.status == 403 && refused.errorCode == "revoked")
        let other = try postJSON(server.base + "/v1/downloads", ["signedTransaction": signed[products[1]]!], folder: tmp)
        #expect(other.status == 200)
        #expect(server.stop() == 0)
    }

    @Test("over IPv6: a server on [::1] hands out download URLs that name it as a URL must ([::1]); iap-fetch installs and finishes")
    func ipv6Loopback() throws {
        let tmp = try TemporaryFolder()
        let repository = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent().path
        let product = "com.example.cosmos.levels1"
        _ = try tool("iap-pack", ["build", repository + "/content/" + product, "--output", tmp.sub("archives")])
        _ = try tool("iap-sandbox", ["init", "--dir", tmp.sub("sandbox"), "--bundle-id", "com.example.demo"])
        _ = try tool("iap-server", ["publish", "--data", tmp.sub("data"), tmp.sub("archives/\(product)-1.0.zip")])
        // Bracketed, as in a URL: the server takes either form.
        let server = try ServerProcess(
            data: tmp.sub("data"),
            arguments: ["--host", "[::1]", "--bundle-id", "com.example.demo", "--trust-root", tmp.sub("sandbox/root.cer"), "--environment", "sandbox"],
            folder: tmp)
        let base = "http://[::1]:\(server.port)"
        #expect(try String(contentsOfFile: server.log, encoding: .utf8).contains("iap-server listening on \(base)"))
        _ = try tool("iap-sandbox", ["purchase", "--dir", tmp.sub("sandbox"), "--product-id", product])
        // The archive comes from the grant's URL, the server's default public URL: before, that
        // was http://::1:<port>/…, which no client parses, and the download failed.
        _ = try tool("iap-fetch", ["run", "--server", base, "--queue", tmp.sub("sandbox/queue"), "--content-dir", tmp.sub("device")])
        #expect(try run("diff", ["-r", repository + "/content/" + product, tmp.sub("device/\(product)/1.0")]).status == 0)
        let listing = try tool("iap-sandbox", ["transactions", "--dir", tmp.sub("sandbox"), "--json"]).stdout
        let records = try JSONSerialization.jsonObject(with: Data(listing.utf8)) as? [[String: Any]] ?? []
        #expect(records.count == 1 && records.allSatisfy { $0["finishedAt"] != nil })
        #expect(server.stop() == 0)
    }
}

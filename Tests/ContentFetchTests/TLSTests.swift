import ContentFetch
import Foundation
import IAPProtocol
import IAPTestSupport
import Testing
import TransactionQueue

/// iap-fetch over HTTPS, as in production: the shipped nginx configuration terminates TLS with a
/// certificate from an authority of the test's own (made with `openssl`), in front of the server.
@Suite("iap-fetch over HTTPS through the shipped nginx edge", .onTestThreads)
struct TLSTests {
    let product = "com.example.tls"

    struct World {
        let shop: Shop
        let edge: NginxServer
        let certificates: TestCertificates
    }

    /// A shop whose download URLs name an HTTPS edge in front of its server, offering HTTP/2 as
    /// well; the edge's certificate is for `names`.
    func world(names: [String] = ["IP:127.0.0.1", "DNS:localhost"], http: String = "") throws -> World {
        let edgePort = try freePort()
        let shop = try Shop(products: [product: .random(3 << 20)], serverArguments: ["--public-url", "https://127.0.0.1:\(edgePort)"])
        let certificates = try TestCertificates(folder: shop.tmp.sub("tls"))
        let edge = try NginxServer(
            replicaPorts: [shop.server.port], folder: shop.tmp, port: edgePort, http: http.replacingOccurrences(of: "EDGE_PORT", with: String(edgePort)),
            certificate: try certificates.server("edge", names: names), http2: true)
        return World(shop: shop, edge: edge, certificates: certificates)
    }

    func fetch(_ w: World, _ extra: [String]) throws -> ProcessResult {
        try run(productsDirectory() + "/iap-fetch", ["run", "--server", w.edge.base, "--queue", w.shop.queue, "--content-dir", w.shop.content, "--json"] + extra)
    }

    func updates(_ output: String) -> [[String: Any]] {
        output.split(separator: "\n").compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
    }

    @Test("given the edge's certificate authority (--ca-file), the grant and the archive come over HTTPS; installed, then finished")
    func trustedAuthority() throws {
        let w = try world()
        let purchase = try w.shop.store.purchase(productId: product)
        let result = try fetch(w, ["--ca-file", w.certificates.authority])
        #expect(result.status == 0, "\(result.stderr)")
        #expect(w.shop.installed(product) == w.shop.payloads[product])
        let id = try #require(purchase.transaction.transactionId)
        #expect(try FileTransactionQueue(folder: w.shop.queue).transaction(id)?.finishedAt != nil)
        // The archive came through the edge (its log names the request), whose only listener is
        // TLS, and on HTTP/1.1 although the edge offers HTTP/2 (curl takes it): one long response
        // gains nothing from HTTP/2, and its framing made the transfer half as fast.
        let log = try String(contentsOfFile: w.edge.accessLog, encoding: .utf8)
        #expect(log.contains("GET /v1/content/<grant>/\(product)-1.0.zip HTTP/1.1"), "\(log)")
        #expect(log.split(separator: "\n").allSatisfy { $0.contains("\"iap-fetch/\(IAPContentVersion.current)\"") }, "\(log)")
        let offered = try run("/usr/bin/curl", ["-s", "-o", "/dev/null", "-w", "%{http_version}", "--cacert", w.certificates.authority, w.edge.base + "/healthz"])
        #expect(offered.stdout == "2", "the edge should offer HTTP/2: \(offered.stdout) \(offered.stderr)")
    }

    @Test("a certificate from an authority the client does not trust fails with what to do, and is not tried again: nothing installed, unfinished")
    func untrustedAuthority() throws {
        let w = try world()
        let purchase = try w.shop.store.purchase(productId: product)
        let result = try fetch(w, [])
        #expect(result.status == 1)
        #expect(result.stderr.contains("the TLS certificate of 127.0.0.1:\(w.edge.port) is not trusted"), "\(result.stderr)")
        #expect(result.stderr.contains("--ca-file"), "\(result.stderr)")
        #expect(!result.stderr.contains("BoringSSL"), "the library's raw error is not the message: \(result.stderr)")
        // A refused certificate is refused again: no update says the download waits to retry.
        #expect(!updates(result.stdout).contains { $0["state"] as? String == "waiting" }, "\(result.stdout)")
        let failed = updates(result.stdout).first { $0["state"] as? String == "failed" }
        #expect((failed?["error"] as? [String: Any])?["code"] as? String == "tls", "\(result.stdout)")
        #expect(w.shop.installed(product) == nil)
        let id = try #require(purchase.transaction.transactionId)
        #expect(try FileTransactionQueue(folder: w.shop.queue).transaction(id)?.finishedAt == nil)
    }

    @Test("a trusted certificate for another name is refused, and the message says the name is wrong")
    func otherName() throws {
        let w = try world(names: ["DNS:content.example.com"])
        _ = try w.shop.store.purchase(productId: product)
        let result = try fetch(w, ["--ca-file", w.certificates.authority])
        #expect(result.status == 1)
        #expect(result.stderr.contains("127.0.0.1:\(w.edge.port)"), "\(result.stderr)")
        #expect(result.stderr.contains("for another name"), "\(result.stderr)")
        #expect(w.shop.installed(product) == nil)
    }

    @Test("a --server whose site redirects to HTTPS is named with the address to use instead; not tried again")
    func redirectedToHTTPS() throws {
        let plain = try freePort()
        // The usual move of a site to HTTPS: every plain-HTTP request is sent to the TLS address.
        let w = try world(http: "server { listen 127.0.0.1:\(plain); return 301 https://127.0.0.1:EDGE_PORT$request_uri; }")
        let purchase = try w.shop.store.purchase(productId: product)
        let result = try run(
            productsDirectory() + "/iap-fetch",
            ["run", "--server", "http://127.0.0.1:\(plain)", "--queue", w.shop.queue, "--content-dir", w.shop.content, "--json", "--ca-file", w.certificates.authority])
        #expect(result.status == 1)
        #expect(
            result.stderr.contains("http://127.0.0.1:\(plain)/v1/downloads redirects to https://127.0.0.1:\(w.edge.port)/v1/downloads: use --server https://127.0.0.1:\(w.edge.port)"),
            "\(result.stderr)")
        #expect(!updates(result.stdout).contains { $0["state"] as? String == "waiting" }, "\(result.stdout)")
        let id = try #require(purchase.transaction.transactionId)
        #expect(try FileTransactionQueue(folder: w.shop.queue).transaction(id)?.finishedAt == nil)
        // With the address it names, the same queue is fetched.
        #expect(try fetch(w, ["--ca-file", w.certificates.authority]).status == 0)
        #expect(w.shop.installed(product) == w.shop.payloads[product])
    }

    @Test("a --ca-file that is missing or holds no certificate is named before anything is fetched")
    func unreadableAuthority() throws {
        let w = try world()
        _ = try w.shop.store.purchase(productId: product)
        let missing = try fetch(w, ["--ca-file", w.shop.tmp.sub("nowhere.pem")])
        #expect(missing.status != 0)
        #expect(missing.stderr.contains("cannot read the certificate authority file \(w.shop.tmp.sub("nowhere.pem"))"), "\(missing.stderr)")
        let text = try w.shop.tmp.write("not-a-certificate.pem", "hello\n")
        let garbled = try fetch(w, ["--ca-file", text])
        #expect(garbled.status != 0)
        #expect(garbled.stderr.contains("\(text) holds no PEM certificate"), "\(garbled.stderr)")
        #expect(!FileManager.default.fileExists(atPath: w.shop.content), "a refused --ca-file makes no content folder")
    }
}

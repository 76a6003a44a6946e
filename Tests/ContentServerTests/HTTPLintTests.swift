import Foundation
import IAPProtocol
import IAPTestSupport
import SandboxStore
import Testing

/// Runs `tools/http-lint.py` (REDbot and httplint) over exchanges with a server and judges the notes.
enum HTTPLint {
    struct Exchange: Encodable {
        let name: String
        let method: String
        let target: String
        var headers: [[String]] = []
        var body: String? = nil
        /// Not sent: the status the server must answer with.
        var status = 200
        /// Not sent: the `WWW-Authenticate` the answer must carry, when the test names one.
        var challenge: String? = nil

        enum CodingKeys: String, CodingKey { case name, method, target, headers, body }
    }

    struct Probe: Encodable {
        let name: String
        let url: String
    }

    struct Plan: Encodable {
        let port: Int
        let exchanges: [Exchange]
        let probe: [Probe]
    }

    struct Note: Decodable {
        let level: String
        let id: String
        let summary: String
    }

    struct Result: Decodable {
        struct ByteRanges: Decodable {
            let parts: Int
            let withContentRange: Int
        }
        let name: String
        let status: Int
        let notes: [Note]
        let byteranges: ByteRanges?
        let challenge: String?
    }

    /// Notes that are the linter's limits, not the server's faults.
    static func expected(_ note: Note, in result: Result) -> Bool {
        switch note.id {
        // httplint warns on every 400 ("the server didn't understand the request"): these
        // requests are malformed on purpose.
        case "STATUS_BAD_REQUEST": result.status == 400
        // httplint wants Content-Range on every 206, but RFC 9110 §14.6 puts it in each part of a
        // multipart/byteranges body and not in the header section: allowed only when every part has one.
        case "PARTIAL_WITHOUT_RANGE": result.byteranges.map { $0.parts > 1 && $0.parts == $0.withContentRange } ?? false
        default: false
        }
    }

    /// The requests for an archive that every server in front of one must answer alike: the
    /// whole file, HEAD, ranges, and each precondition, with the status each must get.
    static func archiveExchanges(path: String, etag: String, lastModified: String) -> [Exchange] {
        [
            Exchange(name: "whole archive", method: "GET", target: path),
            Exchange(name: "HEAD", method: "HEAD", target: path),
            Exchange(name: "one range", method: "GET", target: path, headers: [["Range", "bytes=1000-1099"]], status: 206),
            Exchange(name: "suffix range", method: "GET", target: path, headers: [["Range", "bytes=-100"]], status: 206),
            Exchange(name: "two ranges", method: "GET", target: path, headers: [["Range", "bytes=0-9,100-199"]], status: 206),
            Exchange(name: "range past the end", method: "GET", target: path, headers: [["Range", "bytes=99999999-"]], status: 416),
            Exchange(name: "If-Range, same ETag", method: "GET", target: path, headers: [["Range", "bytes=0-9"], ["If-Range", etag]], status: 206),
            Exchange(name: "If-Range, other ETag", method: "GET", target: path, headers: [["Range", "bytes=0-9"], ["If-Range", "\"other\""]]),
            Exchange(name: "If-None-Match", method: "GET", target: path, headers: [["If-None-Match", etag]], status: 304),
            Exchange(name: "If-Modified-Since", method: "GET", target: path, headers: [["If-Modified-Since", lastModified]], status: 304),
            Exchange(name: "If-Match, same ETag", method: "GET", target: path, headers: [["If-Match", etag], ["Range", "bytes=0-9"]], status: 206),
            Exchange(name: "If-Match, other ETag", method: "GET", target: path, headers: [["If-Match", "\"other\""]], status: 412),
            Exchange(
                name: "If-Unmodified-Since, earlier", method: "GET", target: path,
                headers: [["If-Unmodified-Since", "Thu, 01 Jan 2015 00:00:00 GMT"]], status: 412),
            Exchange(name: "If-Unmodified-Since, same", method: "GET", target: path, headers: [["If-Unmodified-Since", lastModified]]),
            Exchange(
                name: "forged grant", method: "GET", target: "/v1/content/k1.Zm9yZ2Vk.Zm9yZ2Vk/x.zip", status: 401,
                challenge: Challenge.grant),
        ]
    }

    /// Lints every exchange and probe; fails the test when the linters cannot run.
    static func run(port: Int, exchanges: [Exchange], probes: [Probe], folder: TemporaryFolder) throws -> [Result] {
        let planPath = folder.sub("lint-plan-\(UUID().uuidString).json")
        try JSONEncoder().encode(Plan(port: port, exchanges: exchanges, probe: probes)).write(to: URL(fileURLWithPath: planPath))
        let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("tools/http-lint.py").path
        let linted = try IAPTestSupport.run("python3", [script, planPath])
        try #require(linted.status == 0, "tools/http-lint.py failed (is REDbot installed? tools/install-deps.sh installs it): \(linted.stderr)")
        let results = try JSONDecoder().decode([Result].self, from: Data(linted.stdout.utf8))
        try #require(results.count == exchanges.count + probes.count)
        return results
    }

    /// Expects each exchange's status, no warning or error the linters' limits do not explain, and
    /// REDbot's active checks (a range, If-None-Match, If-Modified-Since) passed on every probe.
    static func judge(_ results: [Result], exchanges: [Exchange], where place: String) {
        for (exchange, result) in zip(exchanges, results) {
            #expect(result.status == exchange.status, "\(place), \(exchange.name): \(result.status), expected \(exchange.status)")
            // RFC 9110 §15.5.2; httplint does not check it.
            if result.status == 401 { #expect(result.challenge != nil, "\(place), \(exchange.name): a 401 without WWW-Authenticate") }
            if let challenge = exchange.challenge { #expect(result.challenge == challenge, "\(place), \(exchange.name)") }
        }
        for result in results {
            for note in result.notes where note.level == "warn" || note.level == "bad" {
                #expect(expected(note, in: result), "\(place), \(result.name) (\(result.status)): \(note.level) \(note.id): \(note.summary)")
            }
        }
        for probe in results.dropFirst(exchanges.count) {
            let good = Set(probe.notes.filter { $0.level == "good" }.map(\.id))
            #expect(good.isSuperset(of: ["RANGE_CORRECT", "INM_304", "IMS_304", "CL_CORRECT"]), "\(place), \(probe.name): \(good.sorted())")
        }
    }
}

/// iap-server's responses judged by a real HTTP linter: mnot's REDbot and httplint (PyPI), run by
/// `tools/http-lint.py`. Every kind of answer the server gives, from a whole archive to a refused
/// grant, must draw no warning and no error, except the two `HTTPLint.expected` lists with the
/// reason each is a linter's limit and not the server's fault.
@Suite("HTTP lint (REDbot, httplint)", .serialized, .onTestThreads)
struct HTTPLintTests {
    typealias Exchange = HTTPLint.Exchange
    typealias Probe = HTTPLint.Probe

    @Test("every kind of response draws no warning: archives with ranges and preconditions, manifests, grants, errors, metrics")
    func lint() throws {
        let server = ServerTests()
        let tmp = try TemporaryFolder()
        let (store, process, _) = try server.start(tmp)
        defer { _ = process.stop() }
        let packed = try server.packSample(tmp)
        #expect(try server.upload(packed.archivePath, server: process, tmp: tmp, manifest: packed.manifest).status == 201)

        let purchase = try store.purchase(productId: server.product)
        let granted = try server.grant(purchase.signedTransaction, server: process, tmp: tmp)
        let download = try #require((granted.json["downloads"] as? [[String: Any]])?.first, "\(granted.text)")
        let url = try #require(download["url"] as? String), manifestURL = try #require(download["manifestURL"] as? String)
        let path = String(url.dropFirst(process.base.count)), manifestPath = String(manifestURL.dropFirst(process.base.count))
        let full = try curl([url], folder: tmp)
        let etag = try #require(full.headers["etag"]), lastModified = try #require(full.headers["last-modified"])

        // A second purchase, granted and then refunded: its URL answers 403.
        let refunded = try store.purchase(productId: server.product)
        let refundedGrant = try server.grant(refunded.signedTransaction, server: process, tmp: tmp)
        let refundedURL = try #require((refundedGrant.json["downloads"] as? [[String: Any]])?.first?["url"] as? String)
        let refund = try store.refund(transactionId: refunded.transaction.transactionId!)
        #expect(try postJSON(process.base + "/v1/notifications", ["signedPayload": refund.signedPayload], folder: tmp).status == 200)

        let json = [["Content-Type", "application/json"]]
        let exchanges =
            HTTPLint.archiveExchanges(path: path, etag: etag, lastModified: lastModified) + [
                Exchange(name: "absolute-form target", method: "GET", target: url, headers: [["Range", "bytes=0-99"]], status: 206),
                Exchange(name: "manifest", method: "GET", target: manifestPath),
                Exchange(name: "POST to content", method: "POST", target: path, body: "", status: 405),
                Exchange(name: "refunded grant", method: "GET", target: String(refundedURL.dropFirst(process.base.count)), status: 403),
                Exchange(name: "product", method: "GET", target: "/v1/products/\(server.product)"),
                Exchange(name: "unknown product", method: "GET", target: "/v1/products/com.example.none", status: 404),
                Exchange(name: "grant, empty body", method: "POST", target: "/v1/downloads", headers: json, body: "{}", status: 400),
                Exchange(
                    name: "grant, forged transaction", method: "POST", target: "/v1/downloads", headers: json,
                    body: "{\"signedTransaction\":\"eyJhbGciOiJFUzI1NiJ9.e30.AAAA\"}", status: 401,
                    challenge: Challenge.appStoreSignature),
                Exchange(name: "grant, refunded", method: "POST", target: "/v1/downloads", headers: json, body: "{\"signedTransaction\":\"\(refunded.signedTransaction)\"}", status: 403),
                Exchange(name: "GET grants", method: "GET", target: "/v1/downloads", status: 405),
                Exchange(name: "notification, empty body", method: "POST", target: "/v1/notifications", headers: json, body: "{}", status: 400),
                Exchange(
                    name: "notification, forged payload", method: "POST", target: "/v1/notifications", headers: json,
                    body: "{\"signedPayload\":\"eyJhbGciOiJFUzI1NiJ9.e30.AAAA\"}", status: 401, challenge: Challenge.appStoreSignature),
                Exchange(name: "admin, no token", method: "PUT", target: "/v1/admin/archives", body: "", status: 401, challenge: Challenge.admin(tokenSent: false)),
                Exchange(name: "metrics", method: "GET", target: "/metrics"),
                Exchange(name: "healthz", method: "GET", target: "/healthz"),
                Exchange(name: "readyz", method: "GET", target: "/readyz"),
                Exchange(name: "readyz for downloads", method: "GET", target: "/readyz?for=downloads"),
                Exchange(name: "readyz, unknown scope", method: "GET", target: "/readyz?for=grants", status: 400),
                Exchange(name: "no such path", method: "GET", target: "/nothing-here", status: 404),
                Exchange(name: "header flood", method: "GET", target: "/healthz", headers: (0..<150).map { ["X-Flood-\($0)", "y"] }, status: 431),
            ]
        let probes = [Probe(name: "REDbot: archive", url: url), Probe(name: "REDbot: manifest", url: manifestURL)]
        let results = try HTTPLint.run(port: process.port, exchanges: exchanges, probes: probes, folder: tmp)
        HTTPLint.judge(results, exchanges: exchanges, where: "iap-server")
        // The multipart response was checked part by part.
        #expect(results.first { $0.name == "two ranges" }?.byteranges?.withContentRange == 2)
    }
}

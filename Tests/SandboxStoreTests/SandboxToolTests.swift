import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import TransactionQueue

@Suite("iap-sandbox", .onTestThreads)
struct SandboxToolTests {
    @Test("purchases killed at random points leave a readable queue and unique, increasing ids")
    func killedWriters() throws {
        let tmp = try TemporaryFolder()
        let dir = tmp.sub("store")
        try SandboxStore.initialize(folder: dir, bundleId: "com.example.app")
        let tool = productsDirectory() + "/iap-sandbox"
        for attempt in 0..<12 {
            let process = try launch(tool, ["purchase", "--dir", dir, "--product-id", "p\(attempt)"])
            // Kill some mid-write; let the others finish.
            if attempt % 3 != 0 { usleep(UInt32(1_000 * (attempt * 7 % 20))); kill(process.processIdentifier, SIGKILL) }
            process.waitUntilExit()
        }
        let records = try SandboxStore(folder: dir).records()
        let ids = records.compactMap { UInt64($0.transactionId) }
        #expect(Set(ids).count == ids.count)
        #expect(records.count >= 4)
        let store = try SandboxStore(folder: dir)
        let next = try store.purchase(productId: "after")
        #expect(UInt64(next.transaction.transactionId!)! > ids.max()!)
    }

    @Test("purchase sells only what could be packed: a product id that could leave a folder or split a command line is refused, naming the rule")
    func productIdentifiers() throws {
        let tmp = try TemporaryFolder()
        let dir = tmp.sub("store")
        let store = try SandboxStore.initialize(folder: dir, bundleId: "com.example.app")
        let sandbox = productsDirectory() + "/iap-sandbox"
        for bad in ["", "../etc", "a b", ".hidden", "com.example.é", String(repeating: "a", count: 256)] {
            let result = try run(sandbox, ["purchase", "--dir", dir, "--product-id", bad])
            #expect(result.status == 1, "\(bad)")
            #expect(result.stderr.contains("product identifier '\(bad)'") && result.stderr.contains("reverse-DNS"), "\(result.stderr)")
        }
        #expect(try store.queue.all().isEmpty, "a refused purchase was queued")
        let good = try run(sandbox, ["purchase", "--dir", dir, "--product-id", "com.example.levels_1-a"])
        #expect(good.status == 0, "\(good.stderr)")
    }

    @Test("finish plays the app finishing a purchase it delivered itself: once, by id; an unknown id is named")
    func finishAsTheApp() throws {
        let tmp = try TemporaryFolder()
        let dir = tmp.sub("store")
        let store = try SandboxStore.initialize(folder: dir, bundleId: "com.example.app")
        let coins = try store.purchase(productId: "com.example.coins100", type: .consumable)
        let id = coins.transaction.transactionId!
        let sandbox = productsDirectory() + "/iap-sandbox"
        let first = try run(sandbox, ["finish", "--dir", dir, id])
        #expect(first.status == 0, "\(first.stderr)")
        #expect(first.stdout.contains("finished transaction \(id) (com.example.coins100)"))
        let at = try #require(try store.queue.transaction(id)?.finishedAt)
        let again = try run(sandbox, ["finish", "--dir", dir, id])
        #expect(again.status == 0 && again.stdout.contains("was already finished"))
        #expect(try store.queue.transaction(id)?.finishedAt == at, "finishing again kept the first time")
        let unknown = try run(sandbox, ["finish", "--dir", dir, "2000000000000999"])
        #expect(unknown.status == 1 && unknown.stderr.contains("was not bought in this sandbox store"))
        let garbage = try run(sandbox, ["finish", "--dir", dir, "../x"])
        #expect(garbage.status == 1 && garbage.stderr.contains("is not a transaction id"))
    }

    @Test("refund --notify POSTs {\"signedPayload\"} to a real HTTP endpoint")
    func notifyOverHTTP() throws {
        let tmp = try TemporaryFolder()
        let dir = tmp.sub("store")
        let store = try SandboxStore.initialize(folder: dir, bundleId: "com.example.app")
        let purchase = try store.purchase(productId: "com.example.levels1")
        // A one-shot HTTP receiver on an ephemeral port (Python's http.server, a real peer).
        let receiver = #"""
            import http.server, sys, threading
            out = sys.argv[1]
            class H(http.server.BaseHTTPRequestHandler):
                def do_POST(self):
                    body = self.rfile.read(int(self.headers['Content-Length']))
                    open(out, 'wb').write(self.path.encode() + b'\n' + self.headers.get('Content-Type', '').encode() + b'\n' + body)
                    self.send_response(200); self.end_headers()
                    threading.Thread(target=self.server.shutdown).start()
                def log_message(self, *a): pass
            s = http.server.HTTPServer(('127.0.0.1', 0), H)
            open(out + '.port', 'w').write(str(s.server_address[1]))
            s.timeout = 30
            s.serve_forever()
            """#
        try receiver.write(toFile: tmp.sub("recv.py"), atomically: true, encoding: .utf8)
        let python = Process()
        python.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        python.arguments = ["python3", tmp.sub("recv.py"), tmp.sub("body")]
        try python.run()
        defer { if python.isRunning { kill(python.processIdentifier, SIGKILL) } }
        var port: String?
        for _ in 0..<200 where port == nil {
            port = try? String(contentsOfFile: tmp.sub("body.port"), encoding: .utf8)
            if port == nil || port!.isEmpty { port = nil; usleep(25_000) }
        }
        let url = "http://127.0.0.1:\(try #require(port))/v1/notifications"
        let result = try run(productsDirectory() + "/iap-sandbox", ["refund", "--dir", dir, purchase.transaction.transactionId!, "--notify", url])
        #expect(result.status == 0, "\(result.stderr)")
        python.waitUntilExit()
        let received = try String(contentsOfFile: tmp.sub("body"), encoding: .utf8).split(separator: "\n", maxSplits: 2).map(String.init)
        #expect(received[0] == "/v1/notifications")
        #expect(received[1] == "application/json")
        let body = try JSONSerialization.jsonObject(with: Data(received[2].utf8)) as! [String: String]
        #expect(body["signedPayload"]?.split(separator: ".").count == 3)

        // The App Store refunds a purchase once: a second refund is refused and signs nothing.
        let again = try run(productsDirectory() + "/iap-sandbox", ["refund", "--dir", dir, purchase.transaction.transactionId!])
        #expect(again.status == 1)
        #expect(again.stderr.contains("was already refunded at") && again.stderr.contains("iap-server reconcile"))
        #expect(again.stdout.isEmpty, "no notification is printed")
        #expect(try store.notifications().count == 1)
    }
}

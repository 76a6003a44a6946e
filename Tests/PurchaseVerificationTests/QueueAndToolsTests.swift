import Foundation
import IAPTestSupport
import PurchaseVerification
import SandboxStore
import Testing
import TransactionQueue

@Suite("Transaction queue, sandbox store and tools")
struct QueueAndToolsTests {
    @Test("finishing is durable, idempotent and one-way")
    func finishing() async throws {
        let tmp = try TemporaryFolder()
        let queue = try FileTransactionQueue(folder: tmp.sub("q"))
        let first = QueuedTransaction(transactionId: "2000000000000001", productId: "p1", signedTransaction: "jws1", addedAt: Date(timeIntervalSince1970: 100))
        let second = QueuedTransaction(transactionId: "2000000000000002", productId: "p2", signedTransaction: "jws2", addedAt: Date(timeIntervalSince1970: 200))
        try queue.add(second)
        try queue.add(first)
        #expect(try await queue.unfinishedTransactions().map(\.transactionId) == ["2000000000000001", "2000000000000002"])

        let finished = try queue.finishNow("2000000000000001", at: Date(timeIntervalSince1970: 300.5))
        let again = try queue.finishNow("2000000000000001", at: Date(timeIntervalSince1970: 999))
        #expect(again.finishedAt == finished.finishedAt)
        #expect(finished.finishedAt == Date(timeIntervalSince1970: 300.5))
        // Re-adding a finished transaction does not make it unfinished again.
        try queue.add(first)
        #expect(try await queue.unfinishedTransactions().map(\.transactionId) == ["2000000000000002"])
        // A second queue object on the same folder (another process) sees the same state.
        let reopened = try FileTransactionQueue(folder: tmp.sub("q"))
        #expect(try reopened.transaction("2000000000000001")?.finishedAt == Date(timeIntervalSince1970: 300.5))
        #expect(throws: TransactionQueueError.self) { try queue.finishNow("9999") }
        #expect(throws: TransactionQueueError.self) { try queue.finishNow("../etc/passwd") }
        let leftovers = try FileManager.default.contentsOfDirectory(atPath: tmp.sub("q")).filter { $0.contains(".tmp-") }
        #expect(leftovers.isEmpty)
    }

    @Test("concurrent finishers agree on one finish time")
    func concurrentFinish() async throws {
        let tmp = try TemporaryFolder()
        let queue = try FileTransactionQueue(folder: tmp.sub("q"))
        try queue.add(QueuedTransaction(transactionId: "42", productId: "p", signedTransaction: "jws"))
        let times = try await withThrowingTaskGroup(of: Date?.self) { group in
            for i in 0..<16 {
                group.addTask { try FileTransactionQueue(folder: tmp.sub("q")).finishNow("42", at: Date(timeIntervalSince1970: Double(1000 + i))).finishedAt }
            }
            return try await group.reduce(into: Set<Date?>()) { $0.insert($1) }
        }
        #expect(times.count == 1)
    }

    @Test("purchases killed at random points leave a readable queue and unique, increasing ids")
    func killedWriters() throws {
        let tmp = try TemporaryFolder()
        let dir = tmp.sub("store")
        try SandboxStore.initialize(folder: dir, bundleId: "com.example.app")
        let tool = productsDirectory() + "/iap-sandbox"
        for attempt in 0..<12 {
            let process = Process()
            process.executableURL = URL(fileURLWithPath: tool)
            process.arguments = ["purchase", "--dir", dir, "--product-id", "p\(attempt)"]
            process.standardOutput = FileHandle.nullDevice
            process.standardError = FileHandle.nullDevice
            try process.run()
            // Kill some mid-write; let the others finish.
            if attempt % 3 != 0 { usleep(UInt32(1_000 * (attempt * 7 % 20))) ; kill(process.processIdentifier, SIGKILL) }
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

    @Test("iap-sandbox and iap-server verify work together from the command line")
    func commandLine() throws {
        let tmp = try TemporaryFolder()
        let sandbox = productsDirectory() + "/iap-sandbox", server = productsDirectory() + "/iap-server"
        let dir = tmp.sub("store")
        #expect(try run(sandbox, ["init", "--dir", dir, "--bundle-id", "com.example.app"]).status == 0)
        for name in ["root.key", "intermediate.key", "leaf.key"] {
            let mode = try FileManager.default.attributesOfItem(atPath: dir + "/" + name)[.posixPermissions] as? Int
            #expect(mode == 0o600, "\(name)")
        }
        let bought = try run(sandbox, ["purchase", "--dir", dir, "--product-id", "com.example.levels1", "--json"])
        #expect(bought.status == 0)
        let purchase = try JSONSerialization.jsonObject(with: Data(bought.stdout.utf8)) as! [String: Any]
        let token = purchase["signedTransaction"] as! String
        try token.write(toFile: tmp.sub("tx.jws"), atomically: true, encoding: .utf8)

        let ok = try run(server, ["verify", tmp.sub("tx.jws"), "--bundle-id", "com.example.app", "--trust-root", dir + "/root.cer", "--environment", "sandbox"])
        #expect(ok.status == 0, "\(ok.stderr)")
        let decoded = try JSONSerialization.jsonObject(with: Data(ok.stdout.utf8)) as! [String: Any]
        #expect(decoded["kind"] as? String == "transaction")
        #expect((decoded["payload"] as? [String: Any])?["productId"] as? String == "com.example.levels1")

        let untrusted = try run(server, ["verify", tmp.sub("tx.jws"), "--bundle-id", "com.example.app", "--environment", "sandbox"])
        #expect(untrusted.status == 1)
        #expect(untrusted.stderr.contains("untrusted-chain"))
        #expect(!untrusted.stderr.contains(token.prefix(40)))
        let production = try run(server, ["verify", "-", "--bundle-id", "com.example.app", "--trust-root", dir + "/root.cer"], stdin: token)
        #expect(production.status == 1)
        #expect(production.stderr.contains("wrong-environment"))

        let list = try run(sandbox, ["transactions", "--dir", dir])
        #expect(list.stdout.contains("UNFINISHED"))
        let id = purchase["transactionId"] as! String
        let refund = try run(sandbox, ["refund", "--dir", dir, id])
        #expect(refund.status == 0)
        try refund.stdout.write(toFile: tmp.sub("refund.json"), atomically: true, encoding: .utf8)
        let notification = try run(server, ["verify", tmp.sub("refund.json"), "--bundle-id", "com.example.app", "--trust-root", dir + "/root.cer", "--environment", "sandbox"])
        #expect(notification.status == 0)
        let n = try JSONSerialization.jsonObject(with: Data(notification.stdout.utf8)) as! [String: Any]
        #expect(n["kind"] as? String == "notification")
        #expect((n["transaction"] as? [String: Any])?["revocationDate"] != nil)
        #expect(try run(sandbox, ["transactions", "--dir", dir]).stdout.contains("refunded"))
        #expect(try run(sandbox, ["refund", "--dir", dir, "12345"]).status == 1)
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
    }
}

import Foundation
import IAPTestSupport
import PurchaseVerification
import SandboxStore
import Testing
import TransactionQueue

@Suite("iap-server verify", .onTestThreads)
struct VerifyToolTests {
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
}

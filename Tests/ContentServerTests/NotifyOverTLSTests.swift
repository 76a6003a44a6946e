import Foundation
import IAPTestSupport
import Testing

extension ServerTests {
    @Test(
        "iap-sandbox refund --notify to a server behind HTTPS with a private authority: refused naming --ca-file (TLS_ISSUE recorded), delivered with it; an unusable --ca-file refunds nothing"
    )
    func notifyOverHTTPS() async throws {
        let tmp = try TemporaryFolder()
        let (store, server, _) = try start(tmp)
        defer { _ = server.stop() }
        let packed = try packSample(tmp)
        #expect(try upload(packed.archivePath, server: server, tmp: tmp, manifest: packed.manifest).status == 201)
        let authority = try TestCertificates(folder: tmp.sub("ca"))
        let edge = try NginxServer(replicaPorts: [server.port], folder: tmp, certificate: try authority.server("edge", names: ["IP:127.0.0.1"]))
        let first = try store.purchase(productId: product), second = try store.purchase(productId: product)
        let notify = edge.base + "/v1/notifications"
        func refund(_ transactionId: String?, _ extra: [String] = []) throws -> ProcessResult {
            try run(productsDirectory() + "/iap-sandbox", ["refund", "--dir", store.folder, transactionId ?? "", "--notify", notify] + extra)
        }

        let refused = try refund(first.transaction.transactionId)
        #expect(refused.status == 1 && refused.stderr.contains("is not trusted") && refused.stderr.contains("--ca-file"), "\(refused.stderr)")
        #expect(try store.notifications().map { $0.sendAttempts.map(\.sendAttemptResult) } == [["TLS_ISSUE"]])

        let unusable = try refund(second.transaction.transactionId, ["--ca-file", tmp.sub("none.pem")])
        #expect(unusable.status == 1 && unusable.stderr.contains("--ca-file"), "\(unusable.stderr)")
        #expect(try store.notifications().count == 1, "a refund was made although --ca-file could not be used")

        let delivered = try refund(second.transaction.transactionId, ["--ca-file", authority.authority])
        #expect(delivered.status == 0 && delivered.stderr.contains("notified \(notify): 200"), "\(delivered.stderr)")
        #expect(try store.notifications().last?.sendAttempts.map(\.sendAttemptResult) == ["SUCCESS"])
        let regrant = try grant(second.signedTransaction, server: server, tmp: tmp)
        #expect(regrant.status == 403 && regrant.errorCode == "revoked", "\(regrant.text)")
    }
}

import AppStoreServerAPI
import AppStoreServerClient
import Base64URL
import Crypto
import Foundation
import IAPTestSupport
import PurchaseVerification
import SandboxStore
import SandboxStoreServer
import Testing

/// The sandbox's App Store Server API, read by Apple's official Python client and by ours.
@Suite("The sandbox's App Store Server API", .serialized, .onTestThreads)
struct StoreAPITests {
    let bundleId = "com.example.app"

    /// Apple's `AppStoreServerAPIClient` pointed at the sandbox (its documented base URL is
    /// replaced, as for `Environment.LOCAL_TESTING`); every signed answer checked with Apple's
    /// `SignedDataVerifier` against the sandbox root.
    static let appleClient = #"""
        import json, sys, time
        from appstoreserverlibrary.api_client import AppStoreServerAPIClient, APIException, GetTransactionHistoryVersion
        from appstoreserverlibrary.models.Environment import Environment
        from appstoreserverlibrary.models.NotificationHistoryRequest import NotificationHistoryRequest
        from appstoreserverlibrary.models.TransactionHistoryRequest import TransactionHistoryRequest, ProductType, Order
        from appstoreserverlibrary.signed_data_verifier import SignedDataVerifier

        cfg = json.load(open(sys.argv[1]))
        key = open(cfg['keyFile'], 'rb').read()
        def client(issuer=cfg['issuerId'], key_id=cfg['keyId'], bundle=cfg['bundleId']):
            c = AppStoreServerAPIClient(key, key_id, issuer, bundle, Environment.SANDBOX)
            c._base_url = cfg['url']
            return c
        api = client()
        verifier = SignedDataVerifier([open(cfg['root'], 'rb').read()], False, Environment.SANDBOX, cfg['bundleId'], None)
        out = {}
        t = verifier.verify_and_decode_signed_transaction(api.get_transaction_info(cfg['refunded']).signedTransactionInfo)
        out['info'] = {'transactionId': t.transactionId, 'productId': t.productId, 'revoked': t.revocationDate is not None}
        pages, revision = [], None
        while True:
            h = api.get_transaction_history(cfg['refunded'], revision, TransactionHistoryRequest(sort=Order.DESCENDING), GetTransactionHistoryVersion.V2)
            pages.append([verifier.verify_and_decode_signed_transaction(s).transactionId for s in h.signedTransactions])
            revision = h.revision
            out['historyEnvironment'] = h.rawEnvironment
            out['historyBundle'] = h.bundleId
            if not h.hasMore: break
        out['history'] = pages
        h = api.get_transaction_history(cfg['refunded'], None, TransactionHistoryRequest(revoked=True), GetTransactionHistoryVersion.V2)
        out['revokedOnly'] = [verifier.verify_and_decode_signed_transaction(s).transactionId for s in h.signedTransactions]
        h = api.get_transaction_history(cfg['refunded'], None, TransactionHistoryRequest(productTypes=[ProductType.AUTO_RENEWABLE]), GetTransactionHistoryVersion.V2)
        out['subscriptions'] = [verifier.verify_and_decode_signed_transaction(s).productId for s in h.signedTransactions]
        now = int(time.time() * 1000)
        n = api.get_notification_history(None, NotificationHistoryRequest(startDate=now - 86400000, endDate=now + 1000))
        items = []
        for item in n.notificationHistory:
            p = verifier.verify_and_decode_notification(item.signedPayload)
            tx = verifier.verify_and_decode_signed_transaction(p.data.signedTransactionInfo)
            items.append({'type': p.rawNotificationType, 'transactionId': tx.transactionId, 'attempts': [a.rawSendAttemptResult for a in item.sendAttempts]})
        out['notifications'] = items
        def status(call):
            try:
                call()
                return 'accepted'
            except APIException as e:
                return [e.http_status_code, e.raw_api_error]
        out['errors'] = {
            'unknownTransaction': status(lambda: api.get_transaction_info('9999999999999999')),
            'notATransactionId': status(lambda: api.get_transaction_info('abc')),
            'productionTransaction': status(lambda: api.get_transaction_info(cfg['production'])),
            'startTooOld': status(lambda: api.get_notification_history(None, NotificationHistoryRequest(startDate=now - 200 * 86400000, endDate=now))),
            'startAfterEnd': status(lambda: api.get_notification_history(None, NotificationHistoryRequest(startDate=now, endDate=now - 1000))),
            'badPaginationToken': status(lambda: api.get_notification_history('nonsense', NotificationHistoryRequest(startDate=now - 1000, endDate=now))),
            'wrongIssuer': status(lambda: client(issuer='00000000-0000-0000-0000-000000000000').get_transaction_info(cfg['refunded'])),
            'unknownKey': status(lambda: client(key_id='AAAAAAAAAA').get_transaction_info(cfg['refunded'])),
            'wrongBundle': status(lambda: client(bundle='com.example.other').get_transaction_info(cfg['refunded'])),
        }
        json.dump(out, sys.stdout)
        """#

    struct Sandbox {
        let tmp: TemporaryFolder
        let store: SandboxStore
        let key: SandboxStore.APIKey
        let keyFile: String
        let server: ServerProcess
    }

    func serve(_ tmp: TemporaryFolder, _ store: SandboxStore) throws -> Sandbox {
        let key = try store.createAPIKey()
        let keyFile = try tmp.write("AuthKey.p8", key.privateKeyPEM)
        let server = try ServerProcess(data: store.folder, arguments: [], folder: tmp, tool: "iap-sandbox", dataFlag: "--dir")
        return Sandbox(tmp: tmp, store: store, key: key, keyFile: keyFile, server: server)
    }

    @Test("Apple's AppStoreServerAPIClient reads transactions, history pages and notification history, and gets Apple's error codes")
    func appleClient() throws {
        let tmp = try TemporaryFolder()
        let store = try SandboxStore.initialize(folder: tmp.sub("store"), bundleId: bundleId)
        var ids: [String] = []
        for i in 0..<23 { ids.append(try store.purchase(productId: "com.example.levels\(i)").transaction.transactionId!) }
        let pass = try store.purchase(productId: "com.example.pass", type: .autoRenewable)
        ids.append(pass.transaction.transactionId!)
        let production = try store.purchase(productId: "com.example.levels1", environment: .production).transaction.transactionId!
        let refunded = ids[3]
        _ = try store.refund(transactionId: refunded)
        try store.recordSendAttempt(notificationUUID: try store.notifications()[0].notificationUUID, result: "NO_RESPONSE")
        let sandbox = try serve(tmp, store)
        defer { _ = sandbox.server.stop() }

        let config: [String: String] = [
            "url": sandbox.server.base, "keyFile": sandbox.keyFile, "keyId": sandbox.key.keyId, "issuerId": sandbox.key.issuerId,
            "bundleId": bundleId, "root": store.rootCertificatePath, "refunded": refunded, "production": production,
        ]
        let configFile = try tmp.write("config.json", String(decoding: try JSONSerialization.data(withJSONObject: config), as: UTF8.self))
        let script = try tmp.write("client.py", Self.appleClient)
        let result = try run("python3", [script, configFile])
        try #require(result.status == 0, "Apple's client failed: \(result.stderr)")
        let out = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any])

        let info = try #require(out["info"] as? [String: Any])
        #expect(info["transactionId"] as? String == refunded)
        #expect(info["productId"] as? String == "com.example.levels3")
        #expect(info["revoked"] as? Bool == true)
        // 24 sandbox transactions, newest first, in pages of 20; the production one is not here.
        let pages = try #require(out["history"] as? [[String]])
        #expect(pages.map(\.count) == [20, 4])
        #expect(pages.flatMap { $0 } == ids.reversed())
        #expect(out["historyEnvironment"] as? String == "Sandbox")
        #expect(out["historyBundle"] as? String == bundleId)
        #expect(out["revokedOnly"] as? [String] == [refunded])
        #expect(out["subscriptions"] as? [String] == ["com.example.pass"])
        let notifications = try #require(out["notifications"] as? [[String: Any]])
        #expect(notifications.count == 1)
        #expect(notifications.first?["type"] as? String == "REFUND")
        #expect(notifications.first?["transactionId"] as? String == refunded)
        #expect(notifications.first?["attempts"] as? [String] == ["NO_RESPONSE"])
        let errors = try #require(out["errors"] as? [String: Any])
        func status(_ name: String) -> [Int]? { errors[name] as? [Int] }
        #expect(status("unknownTransaction") == [404, StoreAPIError.transactionIdNotFound])
        #expect(status("notATransactionId") == [400, StoreAPIError.invalidTransactionId])
        #expect(status("productionTransaction") == [404, StoreAPIError.transactionIdNotFound])
        #expect(status("startTooOld") == [400, StoreAPIError.startDateTooFarInPast])
        #expect(status("startAfterEnd") == [400, StoreAPIError.startDateAfterEndDate])
        #expect(status("badPaginationToken") == [400, StoreAPIError.invalidPaginationToken])
        // Refused tokens get 401 without a body, as from Apple.
        for name in ["wrongIssuer", "unknownKey", "wrongBundle"] {
            #expect((errors[name] as? [Any])?.first as? Int == 401, "\(name): \(String(describing: errors[name]))")
        }
    }

    @Test("our client follows notification pages, filters by transaction and failures, and reports a refused key")
    func swiftClient() async throws {
        let tmp = try TemporaryFolder()
        let store = try SandboxStore.initialize(folder: tmp.sub("store"), bundleId: bundleId)
        var refunded: [String] = []
        for i in 0..<45 {
            let id = try store.purchase(productId: "com.example.levels\(i)").transaction.transactionId!
            let refund = try store.refund(transactionId: id)
            try store.recordSendAttempt(notificationUUID: refund.notification.notificationUUID!, result: i % 3 == 0 ? "SUCCESS" : "TIMED_OUT")
            refunded.append(id)
        }
        let sandbox = try serve(tmp, store)
        defer { _ = sandbox.server.stop() }
        let key = try StoreAPIKey(keyId: sandbox.key.keyId, issuerId: sandbox.key.issuerId, bundleId: bundleId, pemFile: sandbox.keyFile)
        let client = StoreAPIClient(baseURL: sandbox.server.base, key: key)
        let now = Date()
        let window = NotificationHistoryRequest(startDate: now.addingTimeInterval(-3600).storeAPIMilliseconds, endDate: now.storeAPIMilliseconds + 1000)

        let first = try await client.notificationHistory(window)
        #expect(first.notificationHistory.count == 20 && first.hasMore && first.paginationToken != nil)
        let all = try await client.allNotifications(window)
        #expect(all.count == 45)
        let verifier = SignedDataVerifier(
            configuration: .init(bundleId: bundleId, trustRoots: [try AppleRoots.load(path: store.rootCertificatePath)], environments: .sandbox))
        var seen: [String] = []
        for item in all { seen.append(try await verifier.verifyNotification(item.signedPayload).1?.transactionId ?? "") }
        #expect(seen == refunded)

        var failures = window
        failures.onlyFailures = true
        #expect(try await client.allNotifications(failures).count == 30)
        var one = window
        one.transactionId = refunded[7]
        let single = try await client.allNotifications(one)
        #expect(single.count == 1 && single[0].sendAttempts.map(\.sendAttemptResult) == ["TIMED_OUT"])
        let info = try await client.transactionInfo(refunded[0])
        #expect(try await verifier.verifyTransaction(info.signedTransactionInfo).revocationDate != nil)

        let stranger = StoreAPIClient(
            baseURL: sandbox.server.base, key: StoreAPIKey(keyId: sandbox.key.keyId, issuerId: sandbox.key.issuerId, bundleId: bundleId, privateKey: .init()))
        await #expect(throws: StoreAPIClientError.self) { _ = try await stranger.transactionInfo(refunded[0]) }
        do {
            _ = try await stranger.transactionInfo(refunded[0])
        } catch {
            #expect(error.code == .unauthorized && error.message.contains("--key-id"))
        }
        do {
            _ = try await client.transactionInfo("1")
        } catch {
            #expect(error.code == .notFound && error.message.contains("4040010"))
        }
    }

    @Test("bearer tokens: only an ES256 token of a known key, for this issuer, audience and app, within the hour")
    func bearerTokens() throws {
        let privateKey = P256.Signing.PrivateKey()
        let key = StoreAPIKey(keyId: "ABCDEFGHIJ", issuerId: "issuer-1", bundleId: bundleId, privateKey: privateKey)
        let checker = StoreAPIToken(issuerId: "issuer-1", bundleId: bundleId, keys: ["ABCDEFGHIJ": privateKey.publicKey])
        let now = Date()
        try checker.verify(authorization: "Bearer " + key.bearerToken(now: now), now: now)

        func refusal(_ authorization: String?, at date: Date = now) -> StoreAPITokenErrorCode? {
            do {
                try checker.verify(authorization: authorization, now: date)
                return nil
            } catch { return error.code }
        }
        let token = key.bearerToken(now: now)
        let parts = token.split(separator: ".").map(String.init)
        func b64(_ json: String) -> String { Base64URL.encode(Data(json.utf8)) }
        func signed(header: String, claims: String) -> String {
            let input = b64(header) + "." + b64(claims)
            return input + "." + Base64URL.encode(try! privateKey.signature(for: Data(input.utf8)).rawRepresentation)
        }
        let exp = Int64(now.timeIntervalSince1970) + 600
        let claims = #"{"iss":"issuer-1","exp":\#(exp),"aud":"appstoreconnect-v1","bid":"\#(bundleId)"}"#
        // Apple's Python client sends no iat: accepted.
        #expect(refusal("Bearer " + signed(header: #"{"alg":"ES256","kid":"ABCDEFGHIJ"}"#, claims: claims)) == nil)
        #expect(refusal(nil) == .missing)
        #expect(refusal("Basic abc") == .missing)
        #expect(refusal("Bearer " + parts[0] + "." + parts[1]) == .malformed)
        #expect(refusal("Bearer " + String(repeating: "a", count: 5000)) == .malformed)
        #expect(refusal("Bearer " + signed(header: #"{"alg":"none","kid":"ABCDEFGHIJ"}"#, claims: claims)) == .unsupportedAlgorithm)
        #expect(refusal("Bearer " + signed(header: #"{"alg":"HS256","kid":"ABCDEFGHIJ"}"#, claims: claims)) == .unsupportedAlgorithm)
        #expect(refusal("Bearer " + signed(header: #"{"alg":"ES256","kid":"OTHER"}"#, claims: claims)) == .unknownKey)
        #expect(refusal("Bearer " + parts[0] + "." + b64(claims) + "." + parts[2]) == .invalidSignature)
        #expect(refusal("Bearer " + signed(header: #"{"alg":"ES256","kid":"ABCDEFGHIJ"}"#, claims: claims.replacingOccurrences(of: "issuer-1", with: "x"))) == .wrongIssuer)
        #expect(
            refusal("Bearer " + signed(header: #"{"alg":"ES256","kid":"ABCDEFGHIJ"}"#, claims: claims.replacingOccurrences(of: "appstoreconnect-v1", with: "x")))
                == .wrongAudience)
        #expect(refusal("Bearer " + signed(header: #"{"alg":"ES256","kid":"ABCDEFGHIJ"}"#, claims: claims.replacingOccurrences(of: bundleId, with: "x"))) == .wrongBundleId)
        #expect(refusal("Bearer " + token, at: now.addingTimeInterval(3 * 3600)) == .expired)
        #expect(refusal("Bearer " + key.bearerToken(now: now, lifetime: 2 * 3600)) == .lifetimeTooLong)
        #expect(refusal("Bearer " + key.bearerToken(now: now.addingTimeInterval(600))) == .lifetimeTooLong)
    }
}

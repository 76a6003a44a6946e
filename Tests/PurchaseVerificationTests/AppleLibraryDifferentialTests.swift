import Foundation
import IAPTestSupport
import PurchaseVerification
import SandboxStore
import Testing
import X509

/// Apple's official App Store Server Library (Python, from PyPI) as the reference verifier: a
/// corpus of valid and mutated signed data is judged by both; where Apple accepts we accept with
/// the same decoded fields, where Apple refuses we refuse, and where we refuse alone the case is
/// one of the deliberate ones listed in the README.
@Suite("Agreement with Apple's App Store Server Library", .onTestThreads)
struct AppleLibraryDifferentialTests {
    static let judge = #"""
        import base64, json, sys
        from appstoreserverlibrary.models.Environment import Environment
        from appstoreserverlibrary.signed_data_verifier import SignedDataVerifier, VerificationException

        corpus = json.load(open(sys.argv[1]))
        roots = [open(path, 'rb').read() for path in corpus['roots']]
        verifier = SignedDataVerifier(roots, False, Environment.SANDBOX, corpus['bundleId'], None)
        verdicts = {}
        for item in corpus['items']:
            try:
                if item['kind'] == 'renewal':
                    decoded = verifier.verify_and_decode_renewal_info(item['token'])
                    fields = {'originalTransactionId': decoded.originalTransactionId, 'productId': decoded.productId,
                              'environment': decoded.rawEnvironment, 'renewalDate': decoded.renewalDate}
                elif item['kind'] == 'notification':
                    decoded = verifier.verify_and_decode_notification(item['token'])
                    fields = {'notificationUUID': decoded.notificationUUID, 'bundleId': decoded.data.bundleId if decoded.data else None}
                else:
                    decoded = verifier.verify_and_decode_signed_transaction(item['token'])
                    fields = {'transactionId': decoded.transactionId, 'originalTransactionId': decoded.originalTransactionId,
                              'productId': decoded.productId, 'bundleId': decoded.bundleId, 'purchaseDate': decoded.purchaseDate,
                              'environment': decoded.rawEnvironment}
                verdicts[item['name']] = {'accepted': True, 'fields': fields}
            except VerificationException as e:
                verdicts[item['name']] = {'accepted': False, 'status': str(e.status)}
            except Exception as e:
                verdicts[item['name']] = {'accepted': False, 'status': type(e).__name__}
        json.dump(verdicts, sys.stdout)
        """#

    struct Item: Codable {
        let name: String
        let kind: String
        let token: String
    }

    /// Where we refuse and Apple's library accepts, on purpose (the README lists them with the reason).
    static let deliberatelyStricter: Set<String> = ["duplicate-bundle-id", "duplicate-header-alg", "duplicate-escaped-name", "duplicate-renewal-product"]

    func base64URL(_ json: String) -> String { base64URLEncode(Data(json.utf8)) }

    /// Replaces the payload of a signed token with `payload` and signs it again with `authority`.
    func resigned(_ authority: SandboxCertificateAuthority, header: [String: Any]? = nil, payload: Data) throws -> String {
        let standard: [String: Any] = ["alg": "ES256", "x5c": authority.x5c]
        return try authority.signCompact(
            header: JSONSerialization.data(withJSONObject: header ?? standard, options: [.sortedKeys]), payload: payload)
    }

    @Test("a corpus of valid and mutated signed data: Apple's verdicts and ours agree, field for field")
    func differential() async throws {
        let tmp = try TemporaryFolder()
        let store = try SandboxStore.initialize(folder: tmp.sub("store"), bundleId: "com.example.app")
        let purchase = try store.purchase(productId: "com.example.levels1")
        let renewable = try store.purchase(productId: "com.example.pass", type: .autoRenewable, expires: Date().addingTimeInterval(86_400))
        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        let authority = store.authority
        let payload = try #require(Data(base64URLDecoded: purchase.signedTransaction.split(separator: ".")[1]))
        let payloadText = String(decoding: payload, as: UTF8.self)
        let foreign = try SandboxCertificateAuthority.generate()
        var expiredProfile = ChainProfile()
        expiredProfile.leafNotBefore = Date().addingTimeInterval(-10 * 86_400)
        expiredProfile.leafNotAfter = Date().addingTimeInterval(-5 * 86_400)
        let expired = try SandboxCertificateAuthority.generate(profile: expiredProfile)
        var noMarkerProfile = ChainProfile()
        noMarkerProfile.leafHasMarker = false
        let noMarker = try SandboxCertificateAuthority.generate(profile: noMarkerProfile)
        let parts = purchase.signedTransaction.split(separator: ".").map(String.init)
        var items: [Item] = [
            Item(name: "valid", kind: "transaction", token: purchase.signedTransaction),
            Item(name: "valid-auto-renewable", kind: "transaction", token: renewable.signedTransaction),
            Item(name: "valid-refunded", kind: "transaction", token: refund.signedTransaction),
            Item(name: "valid-notification", kind: "notification", token: refund.signedPayload),
            Item(
                name: "tampered-payload", kind: "transaction",
                token: parts[0] + "." + base64URL(payloadText.replacingOccurrences(of: "com.example.levels1", with: "com.example.levels2")) + "." + parts[2]),
            Item(name: "truncated-signature", kind: "transaction", token: parts[0] + "." + parts[1] + "." + String(parts[2].dropLast(4))),
            Item(name: "alg-none", kind: "transaction", token: try resigned(authority, header: ["alg": "none", "x5c": authority.x5c], payload: payload)),
            Item(name: "alg-hs256", kind: "transaction", token: try resigned(authority, header: ["alg": "HS256", "x5c": authority.x5c], payload: payload)),
            Item(name: "x5c-two", kind: "transaction", token: try resigned(authority, header: ["alg": "ES256", "x5c": Array(authority.x5c.prefix(2))], payload: payload)),
            Item(name: "x5c-missing", kind: "transaction", token: try resigned(authority, header: ["alg": "ES256"], payload: payload)),
            Item(name: "foreign-chain", kind: "transaction", token: try resigned(foreign, payload: payload)),
            Item(name: "expired-leaf", kind: "transaction", token: try resigned(expired, payload: payload)),
            Item(name: "leaf-without-marker", kind: "transaction", token: try resigned(noMarker, payload: payload)),
            Item(name: "wrong-bundle-id", kind: "transaction", token: try resigned(authority, payload: Data(payloadText.replacingOccurrences(of: "com.example.app", with: "com.example.other").utf8))),
            Item(name: "wrong-environment", kind: "transaction", token: try resigned(authority, payload: Data(payloadText.replacingOccurrences(of: "\"Sandbox\"", with: "\"Production\"").utf8))),
            Item(name: "crit-header", kind: "transaction", token: try resigned(authority, header: ["alg": "ES256", "x5c": authority.x5c, "crit": ["exp"], "exp": 1], payload: payload)),
            Item(name: "duplicate-bundle-id", kind: "transaction", token: try resigned(authority, payload: Data(("{\"bundleId\":\"com.example.other\"," + payloadText.dropFirst()).utf8))),
            Item(name: "duplicate-escaped-name", kind: "transaction", token: try resigned(authority, payload: Data(("{\"bundle\\u0049d\":\"com.example.other\"," + payloadText.dropFirst()).utf8))),
            Item(name: "not-json-payload", kind: "transaction", token: try resigned(authority, payload: Data("not json".utf8))),
            Item(name: "array-payload", kind: "transaction", token: try resigned(authority, payload: Data("[1,2]".utf8))),
        ]
        // Renewal info, as StoreKit signs it for an auto-renewable subscription.
        let now = Int64(Date().timeIntervalSince1970 * 1000)
        let renewal =
            #"{"autoRenewProductId":"com.example.pass","autoRenewStatus":1,"environment":"Sandbox","originalTransactionId":"\#(renewable.transaction.transactionId!)","productId":"com.example.pass","recentSubscriptionStartDate":\#(now - 86_400_000),"renewalDate":\#(now + 86_400_000),"signedDate":\#(now)}"#
        items += [
            Item(name: "valid-renewal-info", kind: "renewal", token: try resigned(authority, payload: Data(renewal.utf8))),
            Item(name: "renewal-info-wrong-environment", kind: "renewal", token: try resigned(authority, payload: Data(renewal.replacingOccurrences(of: "\"Sandbox\"", with: "\"Production\"").utf8))),
            Item(name: "renewal-info-foreign-chain", kind: "renewal", token: try resigned(foreign, payload: Data(renewal.utf8))),
            Item(name: "duplicate-renewal-product", kind: "renewal", token: try resigned(authority, payload: Data(("{\"productId\":\"com.example.other\"," + renewal.dropFirst()).utf8))),
        ]
        // A header naming alg twice: the second spelling is what a last-wins reader uses.
        let header = "{\"alg\":\"ES256\",\"alg\":\"ES256\",\"x5c\":[" + authority.x5c.map { "\"\($0)\"" }.joined(separator: ",") + "]}"
        items.append(Item(name: "duplicate-header-alg", kind: "transaction", token: try authority.signCompact(header: Data(header.utf8), payload: payload)))

        let corpus: [String: Any] = [
            "roots": [store.rootCertificatePath], "bundleId": "com.example.app",
            "items": try items.map { try JSONSerialization.jsonObject(with: JSONEncoder().encode($0)) },
        ]
        try JSONSerialization.data(withJSONObject: corpus).write(to: URL(fileURLWithPath: tmp.sub("corpus.json")))
        try Self.judge.write(toFile: tmp.sub("judge.py"), atomically: true, encoding: .utf8)
        let judged = try run("python3", [tmp.sub("judge.py"), tmp.sub("corpus.json")])
        #expect(judged.status == 0, "Apple's library could not run: \(judged.stderr)")
        let verdicts = try #require(try JSONSerialization.jsonObject(with: Data(judged.stdout.utf8)) as? [String: [String: Any]])

        let verifier = SignedDataVerifier(
            configuration: .init(
                bundleId: "com.example.app", trustRoots: [AppleRoots.rootCAG3, authority.root], environments: .sandbox))
        var acceptedByApple = 0
        for item in items {
            let apple = try #require(verdicts[item.name], "no verdict for \(item.name)")
            let appleAccepts = apple["accepted"] as? Bool == true
            let ours = await Self.ourVerdict(item, verifier: verifier)
            let refusal: String? = if case .failure(let error) = ours { error.code.rawValue } else { nil }
            if appleAccepts {
                acceptedByApple += 1
                if Self.deliberatelyStricter.contains(item.name) {
                    #expect(refusal != nil, "\(item.name): listed as deliberately stricter, but we accept it")
                    continue
                }
                #expect(refusal == nil, "\(item.name): Apple accepts, we refuse with \(refusal ?? "")")
                let fields = apple["fields"] as? [String: Any] ?? [:]
                let decoded = (try? ours.get()) ?? [:]
                for (name, value) in decoded {
                    let theirs = fields[name].flatMap { $0 is NSNull ? nil : "\($0)" } ?? ""
                    #expect(theirs == value, "\(item.name): \(name) is '\(value)' here, '\(theirs)' in Apple's library")
                }
            } else {
                #expect(refusal != nil, "\(item.name): Apple refuses (\(apple["status"] ?? "")), we accept")
                #expect(!Self.deliberatelyStricter.contains(item.name), "\(item.name) is refused by Apple too: not a deliberate difference")
            }
        }
        // The valid items must be valid for Apple, or the comparison proves nothing.
        #expect(acceptedByApple >= 5, "Apple's library accepted only \(acceptedByApple) items: \(verdicts)")
    }
}

extension AppleLibraryDifferentialTests {
    /// Our verifier's verdict on one item: the decoded fields compared with Apple's ("" for none).
    static func ourVerdict(_ item: Item, verifier: SignedDataVerifier) async -> Result<[String: String], VerificationError> {
        do {
            if item.kind == "renewal" {
                let info = try await verifier.verifyRenewalInfo(item.token)
                let renews = info.renewalDate.map { String(Int64(($0.timeIntervalSince1970 * 1000).rounded())) } ?? ""
                return .success([
                    "originalTransactionId": info.originalTransactionId ?? "", "productId": info.productId ?? "",
                    "environment": info.environment?.rawValue ?? "", "renewalDate": renews,
                ])
            }
            if item.kind == "notification" {
                let (notification, transaction) = try await verifier.verifyNotification(item.token)
                return .success(["notificationUUID": notification.notificationUUID ?? "", "bundleId": transaction?.bundleId ?? ""])
            }
            let t = try await verifier.verifyTransaction(item.token)
            let purchased = t.purchaseDate.map { String(Int64(($0.timeIntervalSince1970 * 1000).rounded())) } ?? ""
            return .success([
                "transactionId": t.transactionId ?? "", "originalTransactionId": t.originalTransactionId ?? "",
                "productId": t.productId ?? "", "bundleId": t.bundleId ?? "", "environment": t.environment?.rawValue ?? "",
                "purchaseDate": purchased,
            ])
        } catch {
            return .failure(error)
        }
    }
}

extension Data {
    init?(base64URLDecoded text: Substring) {
        var base64 = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while base64.count % 4 != 0 { base64 += "=" }
        self.init(base64Encoded: base64)
    }
}

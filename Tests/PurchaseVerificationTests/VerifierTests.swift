import Crypto
import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import X509

@testable import PurchaseVerification

@Suite("Signed data verification")
struct VerifierTests {
    @Test("a sandbox-signed transaction verifies and decodes every field")
    func happyPath() async throws {
        let f = try Fixture()
        var t = f.transaction()
        t.appAccountToken = UUID(uuidString: "7E3FB20B-4CDB-47CC-936D-99D65F608138")
        t.price = 1990
        t.currency = "EUR"
        t.storefront = "FRA"
        let token = try f.authority.sign(t)
        let verified = try await f.verifier().verifyTransaction(token)
        #expect(verified == t)
        #expect(verified.type == .nonConsumable)
        #expect(entitlement(for: verified, configuration: f.verifier().configuration) == .granted)
        // Dates travel as integer milliseconds since 1970.
        let parts = token.split(separator: ".")
        var b64 = String(parts[1]).replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while b64.count % 4 != 0 { b64 += "=" }
        let raw = try JSONSerialization.jsonObject(with: Data(base64Encoded: b64)!) as! [String: Any]
        #expect(raw["signedDate"] is Int)
    }

    @Test("Apple Root CA - G3 is built in with the documented fingerprint")
    func appleRoot() throws {
        let der = derBytes(AppleRoots.rootCAG3)
        let fingerprint = SHA256.hash(data: der).map { String(format: "%02X", $0) }.joined(separator: ":")
        #expect(fingerprint == "63:34:3A:BF:B8:9A:6A:03:EB:B5:7E:9B:3F:5F:A7:BE:7C:4F:5C:75:6F:30:17:B3:A8:C4:88:C3:65:3E:91:79")
        #expect(AppleRoots.rootCAG3.subject.description.contains("Apple Root CA - G3"))
    }

    @Test("alg other than ES256 is refused", arguments: ["none", "HS256", "ES384", "RS256"])
    func algorithms(alg: String) async throws {
        let f = try Fixture()
        let token = try f.token(header: ["alg": alg, "x5c": f.authority.x5c], payload: f.payloadJSON(f.transaction()))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(token) } == .unsupportedAlgorithm)
        let missing = try f.token(header: ["x5c": f.authority.x5c], payload: f.payloadJSON(f.transaction()))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(missing) } == .unsupportedAlgorithm)
    }

    @Test("x5c must hold exactly three certificates", arguments: [0, 1, 2, 4])
    func certificateCount(count: Int) async throws {
        let f = try Fixture()
        let chain = f.authority.x5c
        let x5c = count == 4 ? chain + [chain[2]] : Array(chain.prefix(count))
        let header: [String: Any] = count == 0 ? ["alg": "ES256"] : ["alg": "ES256", "x5c": x5c]
        let token = try f.token(header: header, payload: f.payloadJSON(f.transaction()))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(token) } == .invalidCertificateList)
    }

    @Test("a chain to an untrusted root is refused, even with that root inside the token")
    func untrustedRoot() async throws {
        let trusted = try Fixture(), attacker = try Fixture()
        let token = try attacker.authority.sign(attacker.transaction())
        // Trusts Apple's root and another sandbox root, not the attacker's (which x5c[2] carries).
        #expect(await VerificationErrorCode.of { _ = try await trusted.verifier().verifyTransaction(token) } == .untrustedChain)
        let appleOnly = trusted.verifier(roots: [AppleRoots.rootCAG3])
        #expect(await VerificationErrorCode.of { _ = try await appleOnly.verifyTransaction(token) } == .untrustedChain)
        // The attacker's intermediate swapped into a trusted chain fails as well.
        var x5c = trusted.authority.x5c
        x5c[1] = attacker.authority.x5c[1]
        let mixed = try trusted.token(header: ["alg": "ES256", "x5c": x5c], payload: trusted.payloadJSON(trusted.transaction()))
        #expect(await VerificationErrorCode.of { _ = try await trusted.verifier().verifyTransaction(mixed) } == .untrustedChain)
    }

    @Test("an intermediate or leaf without Apple's marker OID is refused")
    func markerOIDs() async throws {
        var noIntermediate = ChainProfile()
        noIntermediate.intermediateHasMarker = false
        let a = try Fixture(profile: noIntermediate)
        let tokenA = try a.authority.sign(a.transaction())
        #expect(await VerificationErrorCode.of { _ = try await a.verifier().verifyTransaction(tokenA) } == .missingMarkerOID)

        var noLeaf = ChainProfile()
        noLeaf.leafHasMarker = false
        let b = try Fixture(profile: noLeaf)
        let tokenB = try b.authority.sign(b.transaction())
        #expect(await VerificationErrorCode.of { _ = try await b.verifier().verifyTransaction(tokenB) } == .missingMarkerOID)
    }

    @Test("certificates are validated at the payload's signedDate")
    func validationTime() async throws {
        let now = Date(timeIntervalSince1970: Date().timeIntervalSince1970.rounded(.down))
        var profile = ChainProfile()
        profile.leafNotBefore = now.addingTimeInterval(-30 * 86_400)
        profile.leafNotAfter = now.addingTimeInterval(-10 * 86_400)
        let f = try Fixture(profile: profile)
        // Signed while the leaf was valid: accepted, though the leaf has expired since.
        let old = try f.authority.sign(f.transaction(signed: now.addingTimeInterval(-20 * 86_400)))
        #expect(try await f.verifier().verifyTransaction(old).transactionId == "2000000000000001")
        // Signed after the leaf expired: refused, even with the chain cached by the first token.
        let late = try f.authority.sign(f.transaction(signed: now))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(late) } == .untrustedChain)
        let verifier = f.verifier()
        _ = try await verifier.verifyTransaction(old)
        #expect(await VerificationErrorCode.of { _ = try await verifier.verifyTransaction(late) } == .untrustedChain)
    }

    @Test("a bad, DER-encoded or misplaced signature and a tampered payload are refused")
    func signatures() async throws {
        let f = try Fixture()
        let token = try f.authority.sign(f.transaction())
        var parts = token.split(separator: ".").map(String.init)

        var flipped = Array(Data(base64Encoded: b64(parts[2]))!)
        flipped[10] ^= 0x01
        let bad = parts[0] + "." + parts[1] + "." + base64URLEncode(flipped)
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(bad) } == .invalidSignature)

        let input = Data((parts[0] + "." + parts[1]).utf8)
        let der = try f.authority.leafKey.signature(for: input).derRepresentation
        let derToken = parts[0] + "." + parts[1] + "." + base64URLEncode(der)
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(derToken) } == .invalidSignature)

        var tampered = f.transaction()
        tampered.productId = "com.example.everything"
        parts[1] = base64URLEncode(try f.payloadJSON(tampered))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(parts.joined(separator: ".")) } == .invalidSignature)

        // Signed by the intermediate's key instead of the leaf's.
        let wrongKey = try f.authority.intermediateKey.signature(for: input).rawRepresentation
        let original: [String] = token.split(separator: ".").map(String.init)
        let wrongKeyToken: String = [original[0], original[1], base64URLEncode(wrongKey)].joined(separator: ".")
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(wrongKeyToken) } == .invalidSignature)
    }

    func b64(_ s: String) -> String {
        var t = s.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while t.count % 4 != 0 { t += "=" }
        return t
    }

    @Test("wrong bundle id and wrong environment are refused; Xcode and LocalTesting need an explicit setting")
    func bundleAndEnvironment() async throws {
        let f = try Fixture()
        let other = try f.authority.sign(f.transaction(bundle: "com.example.other"))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(other) } == .wrongBundleId)

        let production = try f.authority.sign(f.transaction(environment: .production))
        let sandbox = try f.authority.sign(f.transaction(environment: .sandbox))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier(environments: .sandbox).verifyTransaction(production) } == .wrongEnvironment)
        #expect(await VerificationErrorCode.of { _ = try await f.verifier(environments: .production).verifyTransaction(sandbox) } == .wrongEnvironment)
        #expect(try await f.verifier(environments: .productionAndSandbox).verifyTransaction(sandbox).environment == .sandbox)
        #expect(try await f.verifier(environments: .productionAndSandbox).verifyTransaction(production).environment == .production)

        let xcode = try f.authority.sign(f.transaction(environment: .xcode))
        #expect(await VerificationErrorCode.of { _ = try await f.verifier(environments: .productionAndSandbox).verifyTransaction(xcode) } == .wrongEnvironment)
        #expect(try await f.verifier(environments: EnvironmentPolicy.sandbox.allowingLocalTesting()).verifyTransaction(xcode).environment == .xcode)
    }

    @Test("a verifier for several apps takes each one's transactions and notifications, and names them all when refusing another")
    func severalApps() async throws {
        let f = try Fixture()
        let apps = BundlePolicy(accepting: [f.bundleId, "com.example.second", f.bundleId])
        #expect(apps.accepted == [f.bundleId, "com.example.second"])
        let verifier = SignedDataVerifier(configuration: .init(bundles: apps, trustRoots: [f.authority.root], environments: .sandbox))
        #expect(try await verifier.verifyTransaction(f.authority.sign(f.transaction())).bundleId == f.bundleId)
        #expect(try await verifier.verifyTransaction(f.authority.sign(f.transaction(bundle: "com.example.second"))).bundleId == "com.example.second")
        let third = try f.authority.sign(f.transaction(bundle: "com.example.third"))
        do {
            _ = try await verifier.verifyTransaction(third)
            Issue.record("a third app's transaction verified")
        } catch {
            #expect(error.code == .wrongBundleId)
            #expect(error.message == "the payload is for bundle id 'com.example.third', not one of the configured '\(f.bundleId)', 'com.example.second'")
        }
        #expect(entitlement(for: f.transaction(bundle: "com.example.second"), configuration: verifier.configuration) == .granted)
        #expect(entitlement(for: f.transaction(bundle: "com.example.third"), configuration: verifier.configuration) == .denied(.wrongBundleId("com.example.third")))

        let tmp = try TemporaryFolder()
        let second = try SandboxStore.initialize(folder: tmp.sub("store"), bundleId: "com.example.second")
        let refund = try second.refund(transactionId: second.purchase(productId: "com.example.second.levels").transaction.transactionId!)
        let both = SignedDataVerifier(configuration: .init(bundles: apps, trustRoots: [second.authority.root], environments: .sandbox))
        #expect(try await both.verifyNotification(refund.signedPayload).1?.bundleId == "com.example.second")
    }

    @Test("malformed base64 or JSON and oversized input are refused with their own codes")
    func malformed() async throws {
        let f = try Fixture()
        let good = try f.authority.sign(f.transaction())
        let parts = good.split(separator: ".").map(String.init)
        let cases = [
            "", "abc", "a.b", "a.b.c.d", "!!!." + parts[1] + "." + parts[2], parts[0] + ".%%%." + parts[2],
            base64URLEncode(Data("not json".utf8)) + "." + parts[1] + "." + parts[2],
            parts[0] + "." + base64URLEncode(Data("[1,2]".utf8)) + "." + parts[2],
            parts[0] + "." + base64URLEncode(Data(#"{"transactionId": 12}"#.utf8)) + "." + parts[2],
        ]
        for token in cases {
            #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(token) } == .malformed, "\(token.prefix(40))")
        }
        let huge = String(repeating: "A", count: SignedDataVerifier.maxTokenSize + 1)
        #expect(await VerificationErrorCode.of { _ = try await f.verifier().verifyTransaction(huge + "." + parts[1] + "." + parts[2]) } == .tooLarge)
    }

    @Test("unknown fields are ignored and unknown enumeration values kept")
    func forwardCompatible() async throws {
        let f = try Fixture()
        var object = try JSONSerialization.jsonObject(with: f.payloadJSON(f.transaction())) as! [String: Any]
        object["type"] = "Future-Product-Type"
        object["inAppOwnershipType"] = "SOMETHING_NEW"
        object["brandNewField"] = ["nested": [1, 2, 3]]
        object["revocationReason"] = nil
        let token = try f.token(header: ["alg": "ES256", "x5c": f.authority.x5c], payload: JSONSerialization.data(withJSONObject: object))
        let t = try await f.verifier().verifyTransaction(token)
        #expect(t.type?.rawValue == "Future-Product-Type")
        #expect(t.inAppOwnershipType?.rawValue == "SOMETHING_NEW")
    }

    @Test("the entitlement decision: revoked, wrong bundle or environment, expired subscription → no, with the reason")
    func entitlements() throws {
        let f = try Fixture()
        let config = f.verifier().configuration
        let now = Date()
        var t = f.transaction()
        #expect(entitlement(for: t, configuration: config) == .granted)
        t.revocationDate = now
        t.revocationReason = 1
        guard case .denied(.revoked(_, 1)) = entitlement(for: t, configuration: config) else { Issue.record("revoked was granted"); return }
        #expect(entitlement(for: f.transaction(bundle: "x.y"), configuration: config) == .denied(.wrongBundleId("x.y")))
        #expect(entitlement(for: f.transaction(environment: .production), configuration: config) == .denied(.wrongEnvironment(.production)))
        var sub = f.transaction()
        sub.type = .autoRenewable
        sub.expiresDate = now.addingTimeInterval(-60)
        #expect(entitlement(for: sub, configuration: config, now: now) == .denied(.expired(at: sub.expiresDate!)))
        sub.expiresDate = now.addingTimeInterval(3600)
        #expect(entitlement(for: sub, configuration: config, now: now) == .granted)
    }

    @Test("notifications: the REFUND from the sandbox verifies with its revoked transaction; data's bundle id is checked")
    func notifications() async throws {
        let tmp = try TemporaryFolder()
        let store = try SandboxStore.initialize(folder: tmp.sub("store"), bundleId: "com.example.app")
        let purchase = try store.purchase(productId: "com.example.levels1")
        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        let verifier = SignedDataVerifier(configuration: .init(bundleId: "com.example.app", trustRoots: [store.authority.root], environments: .sandbox))
        let (notification, transaction) = try await verifier.verifyNotification(refund.signedPayload)
        #expect(notification.notificationType == .refund)
        #expect(notification.notificationUUID == refund.notification.notificationUUID)
        #expect(transaction?.transactionId == purchase.transaction.transactionId)
        #expect(transaction?.revocationDate != nil)
        guard case .notification = try await verifier.verifyAny(refund.signedPayload) else { Issue.record("not recognised as a notification"); return }
        guard case .transaction = try await verifier.verifyAny(purchase.signedTransaction) else { Issue.record("not recognised as a transaction"); return }

        let otherApp = SignedDataVerifier(configuration: .init(bundleId: "com.example.other", trustRoots: [store.authority.root], environments: .sandbox))
        #expect(await VerificationErrorCode.of { _ = try await otherApp.verifyNotification(refund.signedPayload) } == .wrongBundleId)
    }

    @Test("verified chains are cached by their bytes, boundedly")
    func cache() async throws {
        let f = try Fixture()
        let verifier = f.verifier()
        for i in 0..<5 { _ = try await verifier.verifyTransaction(try f.authority.sign(f.transaction(id: "\(2_000_000_000_000_001 + i)"))) }
        #expect(verifier.cachedChainCount == 1)
        var roots = [f.authority.root]
        var tokens: [String] = []
        for _ in 0..<(ChainCache.capacity + 3) {
            let other = try Fixture()
            roots.append(other.authority.root)
            tokens.append(try other.authority.sign(other.transaction()))
        }
        let many = SignedDataVerifier(configuration: .init(bundleId: f.bundleId, trustRoots: roots, environments: .sandbox))
        for token in tokens { _ = try await many.verifyTransaction(token) }
        #expect(many.cachedChainCount == ChainCache.capacity)
    }
}

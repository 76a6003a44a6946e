import Foundation
import IAPTestSupport
import PurchaseVerification
import ReceiptVerification
import SandboxStore
import SwiftASN1
import Testing
import X509

/// One RSA chain for the suite: key generation is the slow part of these tests.
let sharedAuthority: SandboxReceiptAuthority = try! SandboxReceiptAuthority.generate()

func receipt(
    bundleId: String = "com.example.app", type: String? = "ProductionSandbox", created: Date = Date(), purchases: [InAppPurchase]? = nil
) -> AppReceipt {
    let now = Date()
    return AppReceipt(
        receiptType: type, bundleId: bundleId, appVersion: "2.1", originalAppVersion: "1.0", creationDate: created, expirationDate: nil,
        opaqueValue: [1, 2, 3], sha1Hash: Array(repeating: 7, count: 20),
        inAppPurchases: purchases ?? [
            InAppPurchase(productId: "com.example.levels1", transactionId: "1000000000000001", originalTransactionId: "1000000000000001", purchaseDate: now.addingTimeInterval(-60)),
            InAppPurchase(
                productId: "com.example.levels2", transactionId: "1000000000000002", originalTransactionId: "1000000000000002", purchaseDate: now.addingTimeInterval(-50),
                cancellationDate: now.addingTimeInterval(-10)),
            InAppPurchase(
                productId: "com.example.pass", transactionId: "1000000000000003", originalTransactionId: "1000000000000003", purchaseDate: now.addingTimeInterval(-40),
                expiresDate: now.addingTimeInterval(-5), webOrderLineItemId: 6_000_000_000_001),
        ])
}

func verifier(_ authority: SandboxReceiptAuthority = sharedAuthority, environments: EnvironmentPolicy = .sandbox) throws -> ReceiptVerifier {
    try ReceiptVerifier(bundleId: "com.example.app", trustRoots: [authority.root], environments: environments)
}

func refusal(_ bytes: [UInt8], _ verifier: ReceiptVerifier) -> VerificationErrorCode? {
    do {
        _ = try verifier.verify(bytes)
        return nil
    } catch { return error.code }
}

@Suite("App receipts: PKCS#7 with libcrypto, payload with swift-asn1", .onTestThreads)
struct ReceiptVerifierTests {
    @Test("a sandbox receipt verifies, field for field; BER with indefinite lengths, as Apple's; one entitlement decision for its purchases")
    func roundTrip() throws {
        let original = receipt()
        let signed = try sharedAuthority.sign(payload: try ReceiptPayload.encode(original))
        // 0x30 0x80: a SEQUENCE of indefinite length, the shape of real receipts.
        #expect(Array(signed.prefix(2)) == [0x30, 0x80])
        let decoded = try verifier().verify(signed)
        #expect(decoded.bundleId == "com.example.app" && decoded.appVersion == "2.1" && decoded.originalAppVersion == "1.0")
        #expect(decoded.environment == .sandbox)
        #expect(abs(decoded.creationDate.timeIntervalSince(original.creationDate)) < 1)
        #expect(decoded.inAppPurchases.map(\.transactionId) == original.inAppPurchases.map(\.transactionId))
        #expect(decoded.inAppPurchases[2].webOrderLineItemId == 6_000_000_000_001)
        #expect(decoded.opaqueValue == [1, 2, 3] && decoded.sha1Hash.count == 20)

        let configuration = VerifierConfiguration(bundleId: "com.example.app", trustRoots: [], environments: .sandbox)
        let decisions = decoded.transactions.map { entitlement(for: $0, configuration: configuration).isGranted }
        #expect(decisions == [true, false, false])  // bought; refunded; subscription expired
        #expect(decoded.transactions[1].revocationDate != nil)
        #expect(decoded.transactions[2].type == .autoRenewable)

        let base64 = Data(signed).base64EncodedString()
        #expect(try verifier().verify(base64: base64) == decoded)
    }

    @Test("SHA-1 receipts (Apple's before 2016) verify too")
    func sha1() throws {
        let signed = try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt()), sha1: true)
        #expect(try verifier().verify(signed).inAppPurchases.count == 3)
    }

    @Test("OpenSSL's own CLI verifies the sandbox's receipts and reads the same payload")
    func opensslAgrees() throws {
        let tmp = try TemporaryFolder()
        let payload = try ReceiptPayload.encode(receipt())
        let signed = try sharedAuthority.sign(payload: payload)
        let file = try tmp.write("receipt", Data(signed))
        let root = try tmp.write("root.cer", Data(derBytes(sharedAuthority.root)))
        _ = try run("openssl", ["x509", "-inform", "DER", "-in", root, "-out", tmp.sub("root.pem")])
        let result = try run(
            "openssl", ["cms", "-verify", "-inform", "DER", "-in", file, "-CAfile", tmp.sub("root.pem"), "-purpose", "any", "-binary", "-out", tmp.sub("content")])
        #expect(result.status == 0, "\(result.stderr)")
        #expect(Array(try Data(contentsOf: URL(fileURLWithPath: tmp.sub("content")))) == payload)
        let strict = try run(
            "openssl", ["verify", "-x509_strict", "-CAfile", tmp.sub("root.pem"), "-untrusted", tmp.write("i.pem", pem(sharedAuthority.intermediate)), tmp.write("l.pem", pem(sharedAuthority.leaf))])
        #expect(strict.status == 0, "\(strict.stdout)\(strict.stderr)")
    }

    func pem(_ certificate: Certificate) -> String {
        "-----BEGIN CERTIFICATE-----\n" + Data(derBytes(certificate)).base64EncodedString(options: .lineLength64Characters) + "\n-----END CERTIFICATE-----\n"
    }

    @Test("the chain is judged at the receipt's creation date: a receipt signed before the leaf expired stays valid, one dated after does not")
    func creationDate() throws {
        var profile = ReceiptChainProfile()
        profile.leafNotBefore = Date().addingTimeInterval(-10 * 86_400)
        profile.leafNotAfter = Date().addingTimeInterval(-5 * 86_400)
        let expired = try SandboxReceiptAuthority.generate(profile: profile)
        let check = try verifier(expired)
        let old = try expired.sign(payload: try ReceiptPayload.encode(receipt(created: Date().addingTimeInterval(-8 * 86_400))))
        #expect(refusal(old, check) == nil)
        // Warm cache: the same signer, dated outside its window, is still refused.
        let late = try expired.sign(payload: try ReceiptPayload.encode(receipt(created: Date())))
        #expect(refusal(late, check) == .untrustedChain)
        let early = try expired.sign(payload: try ReceiptPayload.encode(receipt(created: Date().addingTimeInterval(-12 * 86_400))))
        #expect(refusal(early, check) == .untrustedChain)
        #expect(refusal(old, check) == nil)
    }

    @Test("every check refuses with its code: signature, chain, markers, certificate set, bundle id, environment")
    func refusals() throws {
        let check = try verifier()
        let payload = try ReceiptPayload.encode(receipt())
        var tampered = try sharedAuthority.sign(payload: payload)
        // Change one letter of the bundle id inside the signed content: still valid ASN.1.
        let needle = Array("com.example.app".utf8)
        let at = try #require((0...(tampered.count - needle.count)).first { Array(tampered[$0..<$0 + needle.count]) == needle })
        tampered[at] = UInt8(ascii: "C")
        #expect(refusal(tampered, check) == .invalidSignature)
        // The same after a valid receipt warmed the verifier (the signature checked with the kept key).
        let warm = try verifier()
        #expect(refusal(try sharedAuthority.sign(payload: payload), warm) == nil)
        #expect(refusal(tampered, warm) == .invalidSignature)
        var badSignature = try sharedAuthority.sign(payload: payload)
        badSignature[badSignature.count - 40] ^= 1
        #expect(refusal(badSignature, warm) != nil)

        let foreign = try SandboxReceiptAuthority.generate()
        #expect(refusal(try foreign.sign(payload: payload), check) == .untrustedChain)
        var noLeafMarker = ReceiptChainProfile()
        noLeafMarker.leafHasMarker = false
        let unmarked = try SandboxReceiptAuthority.generate(profile: noLeafMarker)
        #expect(refusal(try unmarked.sign(payload: payload), try verifier(unmarked)) == .missingMarkerOID)
        var noIntermediateMarker = ReceiptChainProfile()
        noIntermediateMarker.intermediateHasMarker = false
        let unmarkedCA = try SandboxReceiptAuthority.generate(profile: noIntermediateMarker)
        #expect(refusal(try unmarkedCA.sign(payload: payload), try verifier(unmarkedCA)) == .missingMarkerOID)

        // Certificates missing (no intermediate to chain through) or far too many; the warm
        // verifier knows only the exact certificate set it verified, so it judges these in full.
        #expect(refusal(try sharedAuthority.sign(payload: payload, certificates: []), check) == .untrustedChain)
        #expect(refusal(try sharedAuthority.sign(payload: payload, certificates: []), warm) == .untrustedChain)
        let many = Array(repeating: sharedAuthority.intermediate, count: 12)
        #expect(refusal(try sharedAuthority.sign(payload: payload, certificates: many), check) == .invalidCertificateList)
        // A chain the leaf signs directly under the root (intermediate left out but root present).
        #expect(refusal(try sharedAuthority.sign(payload: payload, certificates: [sharedAuthority.root]), check) == .untrustedChain)

        #expect(refusal(try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt(bundleId: "com.example.other"))), check) == .wrongBundleId)
        // A server for several apps takes each one's receipts and names them all when refusing another.
        let apps = try ReceiptVerifier(
            bundles: BundlePolicy(accepting: ["com.example.app", "com.example.other"]), trustRoots: [sharedAuthority.root], environments: .sandbox)
        #expect(try apps.verify(try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt(bundleId: "com.example.other")))).bundleId == "com.example.other")
        #expect(try apps.verify(try sharedAuthority.sign(payload: payload)).bundleId == "com.example.app")
        let third = try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt(bundleId: "com.example.third")))
        do {
            _ = try apps.verify(third)
            Issue.record("a third app's receipt verified")
        } catch {
            #expect(error.message == "the receipt is for bundle id 'com.example.third', not one of the configured 'com.example.app', 'com.example.other'")
        }
        #expect(refusal(try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt(type: "Production"))), check) == .wrongEnvironment)
        #expect(refusal(try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt(type: nil))), check) == .wrongEnvironment)
        #expect(refusal(try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt(type: "Production"))), try verifier(environments: .production)) == nil)
    }
}

import Foundation
import IAPTestSupport
import PurchaseVerification
import ReceiptVerification
import SandboxStore
import Testing
import X509

/// OpenSSL's own `cms -verify` (the container, the chain at the creation date, the signature) and
/// Python's asn1crypto (the payload) judge a corpus of sandbox receipts and mutations beside the
/// module: the same accept/refuse and the same decoded fields, except where the module is
/// deliberately stricter (listed, with the reason, in the README).
@Suite("Receipts: agreement with openssl cms and asn1crypto", .onTestThreads)
struct ReceiptDifferentialTests {
    static let judge = #"""
        import json, subprocess, sys
        from asn1crypto.core import SetOf, Sequence, Integer, OctetString, load

        class Attribute(Sequence):
            _fields = [('type', Integer), ('version', Integer), ('value', OctetString)]

        class Attributes(SetOf):
            _child_spec = Attribute

        def value(raw):
            parsed = load(raw)
            return parsed.native

        def decode(payload):
            fields, purchases = {}, []
            for attribute in Attributes.load(payload):
                t = attribute['type'].native
                raw = attribute['value'].native
                if t == 17:
                    p = {}
                    for a in Attributes.load(raw):
                        p[a['type'].native] = value(a['value'].native)
                    purchases.append({'productId': p.get(1702), 'transactionId': p.get(1703), 'originalTransactionId': p.get(1705),
                                      'purchaseDate': p.get(1704), 'expiresDate': p.get(1708) or None, 'cancellationDate': p.get(1712) or None,
                                      'quantity': p.get(1701), 'webOrderLineItemId': p.get(1711)})
                elif t in (0, 2, 3, 12, 19):
                    fields[t] = value(raw)
            return {'receiptType': fields.get(0), 'bundleId': fields.get(2), 'appVersion': fields.get(3), 'creationDate': fields.get(12),
                    'originalAppVersion': fields.get(19), 'purchases': purchases}

        corpus = json.load(open(sys.argv[1]))
        verdicts = {}
        for item in corpus['items']:
            out = item['file'] + '.content'
            result = subprocess.run(['openssl', 'cms', '-verify', '-inform', 'DER', '-in', item['file'], '-CAfile', corpus['root'],
                                     '-purpose', 'any', '-binary', '-attime', str(item['attime']), '-out', out], capture_output=True)
            verdict = {'accepted': result.returncode == 0}
            if result.returncode == 0:
                try:
                    verdict['fields'] = decode(open(out, 'rb').read())
                except Exception as e:
                    verdict['parseError'] = type(e).__name__
            verdicts[item['name']] = verdict
        json.dump(verdicts, sys.stdout, default=str)
        """#

    /// Where openssl accepts (it checks no Apple marker and reads no payload) and we refuse, on purpose.
    static let deliberatelyStricter: Set<String> = ["leaf-without-marker", "intermediate-without-marker", "duplicate-bundle-id"]

    struct Item {
        let name: String
        let bytes: [UInt8]
        let created: Date
    }

    /// The payload with one more attribute appended to its outer SET: a field given twice.
    func payload(_ receipt: AppReceipt, duplicate: (Int, String)) throws -> [UInt8] {
        let bytes = try ReceiptPayload.encode(receipt)
        func tlv(_ tag: UInt8, _ content: [UInt8]) -> [UInt8] {
            precondition(content.count < 0x10000)
            return content.count < 128 ? [tag, UInt8(content.count)] + content : [tag, 0x82, UInt8(content.count >> 8), UInt8(content.count & 0xFF)] + content
        }
        let (type, text) = duplicate
        let attribute = tlv(0x30, [0x02, 0x01, UInt8(type)] + [0x02, 0x01, 0x01] + tlv(0x04, tlv(0x0C, Array(text.utf8))))
        let headerLength = bytes[1] < 0x80 ? 2 : 2 + Int(bytes[1] & 0x7F)
        return tlv(0x31, Array(bytes.dropFirst(headerLength)) + attribute)
    }

    @Test("a corpus of sandbox receipts and mutations: openssl's verdict and asn1crypto's fields match ours")
    func differential() async throws {
        let tmp = try TemporaryFolder()
        let now = Date(timeIntervalSince1970: (Date().timeIntervalSince1970).rounded(.down))
        let base = AppReceipt(
            receiptType: "ProductionSandbox", bundleId: "com.example.app", appVersion: "3.2", originalAppVersion: "1.0", creationDate: now,
            expirationDate: nil, opaqueValue: [9, 9], sha1Hash: Array(repeating: 1, count: 20),
            inAppPurchases: [
                InAppPurchase(quantity: 1, productId: "com.example.levels1", transactionId: "1000000000000001", originalTransactionId: "1000000000000001", purchaseDate: now.addingTimeInterval(-3600)),
                InAppPurchase(
                    quantity: 2, productId: "com.example.gems", transactionId: "1000000000000002", originalTransactionId: "1000000000000002",
                    purchaseDate: now.addingTimeInterval(-1800), cancellationDate: now.addingTimeInterval(-60)),
                InAppPurchase(
                    productId: "com.example.pass", transactionId: "1000000000000004", originalTransactionId: "1000000000000003",
                    purchaseDate: now.addingTimeInterval(-600), expiresDate: now.addingTimeInterval(86_400), webOrderLineItemId: 6_000_000_000_123),
            ])
        let authority = sharedAuthority
        let valid = try authority.sign(payload: try ReceiptPayload.encode(base))
        var items: [Item] = [
            Item(name: "valid-sha256", bytes: valid, created: now),
            Item(name: "valid-sha1", bytes: try authority.sign(payload: try ReceiptPayload.encode(base), sha1: true), created: now),
            Item(name: "valid-der", bytes: try der(valid, tmp), created: now),
        ]
        var tampered = valid
        let needle = Array("com.example.levels1".utf8)
        let at = try #require((0...(tampered.count - needle.count)).first { Array(tampered[$0..<$0 + needle.count]) == needle })
        tampered[at + 12] = UInt8(ascii: "X")
        items.append(Item(name: "tampered-payload", bytes: tampered, created: now))
        var badSignature = valid
        badSignature[badSignature.count - 30] ^= 0x01
        items.append(Item(name: "tampered-signature", bytes: badSignature, created: now))
        items.append(Item(name: "foreign-chain", bytes: try SandboxReceiptAuthority.generate().sign(payload: try ReceiptPayload.encode(base)), created: now))
        items.append(Item(name: "no-intermediate", bytes: try authority.sign(payload: try ReceiptPayload.encode(base), certificates: []), created: now))
        var expiredProfile = ReceiptChainProfile()
        expiredProfile.leafNotBefore = now.addingTimeInterval(-10 * 86_400)
        expiredProfile.leafNotAfter = now.addingTimeInterval(-5 * 86_400)
        let expired = try SandboxReceiptAuthority.generate(profile: expiredProfile)
        var old = base
        old.creationDate = now.addingTimeInterval(-8 * 86_400)
        var late = base
        late.creationDate = now
        var noLeafMarker = ReceiptChainProfile()
        noLeafMarker.leafHasMarker = false
        var noIntermediateMarker = ReceiptChainProfile()
        noIntermediateMarker.intermediateHasMarker = false
        let extraAuthorities = [
            ("expired-leaf-signed-in-time", expired, old), ("expired-leaf-signed-late", expired, late),
            ("leaf-without-marker", try SandboxReceiptAuthority.generate(profile: noLeafMarker), base),
            ("intermediate-without-marker", try SandboxReceiptAuthority.generate(profile: noIntermediateMarker), base),
        ]
        for (name, signer, receipt) in extraAuthorities {
            items.append(Item(name: name, bytes: try signer.sign(payload: try ReceiptPayload.encode(receipt)), created: receipt.creationDate))
        }
        items.append(Item(name: "duplicate-bundle-id", bytes: try authority.sign(payload: try payload(base, duplicate: (2, "com.example.evil"))), created: now))

        // Each item judged by openssl + asn1crypto, with every root the module trusts.
        var rootsPEM = ""
        var roots: [Certificate] = [authority.root]
        for (_, signer, _) in extraAuthorities { roots.append(signer.root) }
        for root in roots { rootsPEM += pem(root) }
        let rootFile = try tmp.write("roots.pem", rootsPEM)
        var corpus: [[String: Any]] = []
        for item in items {
            let file = try tmp.write(item.name + ".receipt", Data(item.bytes))
            corpus.append(["name": item.name, "file": file, "attime": Int(item.created.timeIntervalSince1970)])
        }
        let corpusFile = try tmp.write("corpus.json", String(decoding: try JSONSerialization.data(withJSONObject: ["root": rootFile, "items": corpus]), as: UTF8.self))
        let script = try tmp.write("judge.py", Self.judge)
        let result = try run("python3", [script, corpusFile])
        try #require(result.status == 0, "\(result.stderr)")
        let verdicts = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: [String: Any]])

        let verifier = try ReceiptVerifier(bundleId: "com.example.app", trustRoots: roots, environments: .sandbox)
        for item in items {
            let theirs = try #require(verdicts[item.name], "\(item.name) missing")
            let accepted = theirs["accepted"] as? Bool ?? false
            let mine: AppReceipt?
            do { mine = try verifier.verify(item.bytes) } catch { mine = nil }
            if Self.deliberatelyStricter.contains(item.name) {
                #expect(accepted && mine == nil, "\(item.name): openssl \(accepted), ours \(mine != nil)")
                continue
            }
            #expect(accepted == (mine != nil), "\(item.name): openssl \(accepted), ours \(mine != nil)")
            guard let mine, let fields = theirs["fields"] as? [String: Any] else { continue }
            #expect(fields["bundleId"] as? String == mine.bundleId, "\(item.name)")
            #expect(fields["appVersion"] as? String == mine.appVersion && fields["originalAppVersion"] as? String == mine.originalAppVersion, "\(item.name)")
            #expect(fields["receiptType"] as? String == mine.receiptType, "\(item.name)")
            #expect(fields["creationDate"] as? String == mine.creationDate.formatted(.iso8601), "\(item.name)")
            let purchases = fields["purchases"] as? [[String: Any]] ?? []
            #expect(purchases.count == mine.inAppPurchases.count, "\(item.name)")
            for (p, m) in zip(purchases, mine.inAppPurchases) {
                #expect(p["productId"] as? String == m.productId && p["transactionId"] as? String == m.transactionId, "\(item.name)")
                #expect(p["originalTransactionId"] as? String == m.originalTransactionId, "\(item.name)")
                #expect(p["purchaseDate"] as? String == m.purchaseDate.formatted(.iso8601), "\(item.name)")
                #expect((p["cancellationDate"] as? String) == m.cancellationDate?.formatted(.iso8601), "\(item.name)")
                #expect((p["expiresDate"] as? String) == m.expiresDate?.formatted(.iso8601), "\(item.name)")
                #expect(p["quantity"] as? Int == m.quantity, "\(item.name)")
                #expect((p["webOrderLineItemId"] as? Int).map(Int64.init) == m.webOrderLineItemId, "\(item.name)")
            }
        }
        // The three valid encodings decode to the same receipt.
        let decoded = try items.prefix(3).map { try verifier.verify($0.bytes) }
        #expect(decoded[0] == decoded[1] && decoded[1] == decoded[2])
    }

    func der(_ ber: [UInt8], _ tmp: TemporaryFolder) throws -> [UInt8] {
        let input = try tmp.write("ber.p7", Data(ber))
        let converted = try run("openssl", ["pkcs7", "-inform", "DER", "-in", input, "-outform", "DER", "-out", tmp.sub("der.p7")])
        try #require(converted.status == 0, "\(converted.stderr)")
        let bytes = Array(try Data(contentsOf: URL(fileURLWithPath: tmp.sub("der.p7"))))
        #expect(bytes.prefix(2) != [0x30, 0x80])
        return bytes
    }

    func pem(_ certificate: Certificate) -> String {
        "-----BEGIN CERTIFICATE-----\n" + Data(derBytes(certificate)).base64EncodedString(options: .lineLength64Characters) + "\n-----END CERTIFICATE-----\n"
    }
}

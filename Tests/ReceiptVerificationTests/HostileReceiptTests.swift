import Foundation
import IAPTestSupport
import PurchaseVerification
import ReceiptVerification
import SandboxStore
import SwiftASN1
import Testing

/// Hostile containers and hostile payloads (validly signed, so the payload parser is what
/// judges them): a clear error with a code, never a crash, in bounded time and memory.
@Suite("Hostile receipts", .onTestThreads)
struct HostileReceiptTests {
    func attribute(_ type: Int, _ value: [UInt8]) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.appendConstructedNode(identifier: .sequence) { s in
            try s.serialize(type)
            try s.serialize(1)
            try s.serialize(ASN1OctetString(contentBytes: value[...]))
        }
        return serializer.serializedBytes
    }

    func set(_ elements: [[UInt8]]) -> [UInt8] { tlv(0x31, elements.flatMap { $0 }) }

    func tlv(_ tag: UInt8, _ content: [UInt8]) -> [UInt8] {
        var length: [UInt8]
        if content.count < 128 {
            length = [UInt8(content.count)]
        } else {
            var n = content.count, bytes: [UInt8] = []
            while n > 0 {
                bytes.insert(UInt8(n & 0xFF), at: 0)
                n >>= 8
            }
            length = [0x80 | UInt8(bytes.count)] + bytes
        }
        return [tag] + length + content
    }

    func utf8(_ s: String) -> [UInt8] { tlv(0x0C, Array(s.utf8)) }
    func ia5(_ s: String) -> [UInt8] { tlv(0x16, Array(s.utf8)) }

    func base(_ extra: [[UInt8]] = [], bundle: [UInt8]? = nil) throws -> [[UInt8]] {
        [
            try attribute(0, utf8("ProductionSandbox")), try attribute(2, bundle ?? utf8("com.example.app")), try attribute(3, utf8("1.0")),
            try attribute(12, ia5(Date().formatted(.iso8601))),
        ] + extra
    }

    func signedRefusal(_ payload: [UInt8]) throws -> (VerificationErrorCode?, String) {
        let signed = try sharedAuthority.sign(payload: payload)
        let check = try verifier()
        do {
            _ = try check.verify(signed)
            return (nil, "")
        } catch { return (error.code, error.message) }
    }

    @Test("hostile payloads under a valid signature: duplicates, non-UTF-8, lying and truncated lengths, deep nesting, wrong shapes")
    func payloads() throws {
        let purchase = set([try attribute(1702, utf8("p")), try attribute(1703, utf8("1")), try attribute(1704, ia5("2026-01-01T00:00:00Z"))])
        #expect(try signedRefusal(set(try base([try attribute(17, purchase)]))).0 == nil)

        var cases: [(String, [UInt8])] = [
            ("bundle id twice", set(try base([try attribute(2, utf8("com.example.other"))]))),
            (
                "product id twice in a purchase",
                set(
                    try base([
                        try attribute(17, set([try attribute(1702, utf8("a")), try attribute(1702, utf8("b")), try attribute(1703, utf8("1")), try attribute(1704, ia5("2026-01-01T00:00:00Z"))]))
                    ]))
            ),
            ("non-UTF-8 bundle id", set(try base(bundle: tlv(0x0C, [0x63, 0xFF, 0xFE])))),
            ("bundle id as an INTEGER", set(try base(bundle: [0x02, 0x01, 0x05]))),
            ("date that is not RFC 3339", set(try base([try attribute(17, set([try attribute(1702, utf8("a")), try attribute(1703, utf8("1")), try attribute(1704, ia5("yesterday"))]))]))),
            ("purchase without a transaction id", set(try base([try attribute(17, set([try attribute(1702, utf8("a")), try attribute(1704, ia5("2026-01-01T00:00:00Z"))]))]))),
            ("purchase that is not a SET", set(try base([try attribute(17, utf8("nested"))]))),
            ("no creation date", set([try attribute(0, utf8("ProductionSandbox")), try attribute(2, utf8("com.example.app")), try attribute(3, utf8("1.0"))])),
            ("not a SET", tlv(0x30, [])),
            ("an attribute of two parts", set([tlv(0x30, [0x02, 0x01, 0x02, 0x02, 0x01, 0x01])])),
            (
                "quantity beyond 64 bits",
                set(
                    try base([
                        try attribute(
                            17,
                            set([
                                try attribute(1701, tlv(0x02, [0x01] + Array(repeating: 0, count: 16))), try attribute(1702, utf8("a")), try attribute(1703, utf8("1")),
                                try attribute(1704, ia5("2026-01-01T00:00:00Z")),
                            ]))
                    ]))
            ),
        ]
        // A length that claims more bytes than there are, and one cut short.
        var lying = set(try base())
        lying[1] = 0x84
        lying.insert(contentsOf: [0x7F, 0xFF, 0xFF], at: 2)
        cases.append(("a length of 2 GiB", lying))
        cases.append(("truncated", Array(set(try base()).dropLast(5))))
        // 5,000 nested SETs inside the purchase field.
        var deep: [UInt8] = [0x05, 0x00]
        for _ in 0..<5_000 { deep = tlv(0x31, deep) }
        cases.append(("5,000 levels of nesting", set(try base([try attribute(17, deep)]))))
        for (name, payload) in cases {
            let (code, message) = try signedRefusal(payload)
            #expect(code == .malformed, "\(name): \(String(describing: code)) \(message)")
            #expect(!message.isEmpty)
        }
    }

    @Test("hostile containers: random bytes, truncation at every tenth byte, another PKCS#7 type, oversize, bad base64")
    func containers() throws {
        let check = try verifier()
        let signed = try sharedAuthority.sign(payload: try ReceiptPayload.encode(receipt()))
        // Warm: damaged copies of a known receipt meet the warm path first.
        _ = try check.verify(signed)
        for cut in stride(from: 0, to: signed.count, by: 10) {
            #expect(refusal(Array(signed.prefix(cut)), check) != nil, "cut at \(cut)")
        }
        var generator = SystemRandomNumberGenerator()
        for _ in 0..<200 {
            let noise = (0..<Int.random(in: 0...600, using: &generator)).map { _ in UInt8.random(in: 0...255, using: &generator) }
            #expect(refusal([0x30, 0x80] + noise, check) == .malformed)
        }
        // Flipped bytes anywhere never crash; a flip inside the signed payload or the signature
        // is always refused, by the warm path as by a cold verifier.
        let payloadBytes = try ReceiptPayload.encode(receipt())
        let cold = try verifier()
        // Every byte of the container's framing and signer info; every 7th byte of the payload and certificates.
        let positions = Set(Array(0..<120) + Array(stride(from: 120, to: signed.count - 600, by: 7)) + Array((signed.count - 600)..<signed.count))
        for i in positions.sorted() {
            var flipped = signed
            flipped[i] ^= 0x5A
            let warmVerdict = refusal(flipped, check)
            #expect((warmVerdict == nil) == (refusal(flipped, cold) == nil), "byte \(i)")
            if warmVerdict == nil { #expect(try check.verify(flipped).inAppPurchases.count == 3) }
        }
        _ = payloadBytes
        #expect(refusal([UInt8](repeating: 0, count: ReceiptVerifier.maximumSize + 1), check) == .tooLarge)
        #expect(throws: VerificationError.self) { _ = try check.verify(base64: "not base64 at all!!") }
        // A PKCS#7 "data" object instead of SignedData: 06 09 (pkcs7-data OID) with content.
        let dataOID: [UInt8] = [0x06, 0x09, 0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x07, 0x01]
        let dataObject = [0x30, UInt8(dataOID.count + 6)] + dataOID + [0xA0, 0x04, 0x04, 0x02, 0x41, 0x42]
        #expect(refusal(dataObject, check) == .malformed)
    }
}

import DownloadGrants
import Foundation
import Testing

@Suite("Download grants")
struct GrantTests {
    let grant = Grant(
        transactionId: "2000000000000001", productId: "com.example.levels1", contentVersion: "1.0",
        sha256: String(repeating: "a", count: 64), expiresAt: Int64(Date().timeIntervalSince1970) + 600)

    @Test("grants round-trip; forged, expired, unknown-key and malformed ones are refused")
    func grants() throws {
        let ring = GrantKeyRing.generate()
        let token = ring.mint(grant)
        #expect(try ring.verify(Substring(token)).get() == grant)

        var bytes = Array(token.utf8)
        let i = bytes.count / 2
        bytes[i] = bytes[i] == UInt8(ascii: "A") ? UInt8(ascii: "B") : UInt8(ascii: "A")
        let tampered = String(decoding: bytes, as: UTF8.self)
        #expect(ring.verify(Substring(tampered)) == .failure(.forged) || ring.verify(Substring(tampered)) == .failure(.malformed))

        let other = GrantKeyRing.generate()
        #expect(other.verify(Substring(token)) == .failure(.forged))
        #expect(GrantKeyRing.generate(keyId: "k2").verify(Substring(token)) == .failure(.unknownKey("k1")))
        #expect(ring.verify(Substring(token), now: Date(timeIntervalSince1970: TimeInterval(grant.expiresAt + 1))) == .failure(.expired(at: grant.expiresAt)))
        for junk in ["", "a.b", "k1..", "k1.!!!.abc", String(repeating: "x", count: 5000)] {
            #expect((try? ring.verify(Substring(junk)).get()) == nil)
        }
    }

    @Test("the key file is created 0600 and keys rotate: old grants still verify under a new active key")
    func keyFile() throws {
        let dir = FileManager.default.temporaryDirectory.path + "/grant-keys-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = dir + "/keys.json"
        let first = try GrantKeyRing.loadOrCreate(path: path)
        #expect(try FileManager.default.attributesOfItem(atPath: path)[.posixPermissions] as? Int == 0o600)
        let token = first.mint(grant)
        #expect(try GrantKeyRing.loadOrCreate(path: path).verify(Substring(token)).get() == grant)

        var file = try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: path))) as! [String: Any]
        var keys = file["keys"] as! [String: String]
        keys["k2"] = Data((0..<32).map { _ in UInt8.random(in: 0...255) }).base64EncodedString()
        file["keys"] = keys
        file["active"] = "k2"
        try JSONSerialization.data(withJSONObject: file).write(to: URL(fileURLWithPath: path))
        let rotated = try GrantKeyRing.loadOrCreate(path: path)
        #expect(rotated.activeKeyId == "k2")
        #expect(try rotated.verify(Substring(token)).get() == grant)
        #expect(rotated.mint(grant).hasPrefix("k2."))
    }
}

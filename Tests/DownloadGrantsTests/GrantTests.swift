import DownloadGrants
import Foundation
import IAPTestSupport
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
        let tmp = try TemporaryFolder()
        let path = tmp.path + "/keys.json"
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

    @Test("rotation by edits: add (accepted, not signing), activate, retire; each refusal names the fix; the file stays 0600")
    func rotationEdits() throws {
        let tmp = try TemporaryFolder()
        let path = tmp.path + "/grant-keys.json"
        let first = try GrantKeyFile.loadOrCreate(path: path)
        #expect(first.ids == ["k1"] && first.active == "k1")
        let old = first.ring.mint(grant)

        let added = try GrantKeyFile.edit(path: path) { file throws(GrantKeyFileError) in try file.adding() }
        #expect(added == "k2")
        var file = try GrantKeyFile.load(path: path)
        #expect(file.ids == ["k1", "k2"] && file.active == "k1")
        #expect(try FileManager.default.attributesOfItem(atPath: path)[.posixPermissions] as? Int == 0o600)

        file = try file.activating("k2")
        try file.write(to: path)
        let rotated = try GrantKeyFile.load(path: path).ring
        #expect(rotated.mint(grant).hasPrefix("k2."))
        #expect(try rotated.verify(Substring(old)).get() == grant)

        file = try file.retiring("k1")
        #expect(file.ring.verify(Substring(old)) == .failure(.unknownKey("k1")))
        #expect(file.ring.keyIds == ["k2"])

        // Each step refuses to come too soon, and says from when it may.
        let now = Date()
        let (withK3, _) = try file.adding("k3", now: now)
        let early = try #require(throws: GrantKeyFileError.self) { try withK3.activating("k3", now: now.addingTimeInterval(3), settle: 10) }
        #expect(early.code == .tooSoon && early.message.contains("was added 3 s ago") && early.message.contains("--now"), "\(early.message)")
        let k3Active = try withK3.activating("k3", now: now.addingTimeInterval(11), settle: 10)
        #expect(k3Active.signedUntil["k2"] == now.addingTimeInterval(11))
        let stillValid = try #require(throws: GrantKeyFileError.self) { try k3Active.retiring("k2", now: now.addingTimeInterval(600), tokenTTL: 900) }
        #expect(stillValid.code == .tooSoon && stillValid.message.contains("stay valid for --token-ttl (900 s)"), "\(stillValid.message)")
        #expect(try k3Active.retiring("k2", now: now.addingTimeInterval(912), tokenTTL: 900).ids == ["k3"])
        #expect(try k3Active.retiring("k2", now: now.addingTimeInterval(600)).ids == ["k3"])
        // The dates survive the file, and a file written before they were kept still reads.
        try k3Active.write(to: path)
        let reread = try GrantKeyFile.load(path: path)
        #expect(reread.ids == k3Active.ids && reread.active == "k3" && reread.signedUntil["k2"].map { abs($0.timeIntervalSince(now) - 11) < 1 } == true)
        try Data("{\"active\": \"k1\", \"keys\": {\"k1\": \"\(Data(count: 32).base64EncodedString())\"}}".utf8).write(to: URL(fileURLWithPath: path))
        #expect(try GrantKeyFile.load(path: path).added.isEmpty)

        for (edit, expected) in [
            ({ _ = try file.retiring("k2") }, "'k2' is the active key, which signs every new grant: activate another key first"),
            ({ _ = try file.activating("k7") }, "there is no key 'k7' (keys: k2): add one first"),
            ({ _ = try file.adding("k2") }, "there is a key 'k2' already"),
            ({ _ = try file.adding("Key 2") }, "'Key 2' is not a key id"),
        ] as [(() throws -> Void, String)] {
            let error = try #require(throws: GrantKeyFileError.self) { try edit() }
            #expect(error.message.contains(expected), "\(error.message)")
        }
        // Numbered after the highest, not the count: k10 after k9.
        #expect(try GrantKeyFile(active: "k9", keys: ["k9": Data(count: 32)]).adding().id == "k10")
    }

    @Test("a server's keys are read again only when the file changes; a broken file leaves the keys in force and is said once")
    func reloading() throws {
        let tmp = try TemporaryFolder()
        let path = tmp.path + "/grant-keys.json"
        let keys = try GrantKeys(path: path)
        let before = keys.current
        #expect(keys.reloadIfChanged() == nil)

        _ = try GrantKeyFile.edit(path: path) { file throws(GrantKeyFileError) in try file.adding() }
        let reread = try #require(keys.reloadIfChanged())
        #expect(try reread.get().keyIds == ["k1", "k2"])
        #expect(keys.current.generation == before.generation + 1)
        #expect(keys.reloadIfChanged() == nil)

        try Data("{\"active\": \"k3\"".utf8).write(to: URL(fileURLWithPath: path))
        let broken = try #require(keys.reloadIfChanged())
        #expect(throws: GrantKeyFileError.self) { try broken.get() }
        #expect(keys.reloadIfChanged() == nil)
        #expect(keys.ring.keyIds == ["k1", "k2"] && keys.ring.activeKeyId == "k1")
    }
}

import ContentArchive
import ContentCatalog
import DownloadGrants
import Foundation
import Testing

@Suite("Download grants and the catalog")
struct GrantAndCatalogTests {
    let grant = Grant(transactionId: "2000000000000001", productId: "com.example.levels1", contentVersion: "1.0",
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

    @Test("publishing: newer versions only, identical bytes are a no-op, anything else conflicts; lies are refused")
    func publishing() throws {
        let dir = FileManager.default.temporaryDirectory.path + "/catalog-" + UUID().uuidString
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let content = dir + "/content"
        try FileManager.default.createDirectory(atPath: content, withIntermediateDirectories: true)
        try Data("level data\n".utf8).write(to: URL(fileURLWithPath: content + "/level.json"))
        let id = try ProductIdentifier("com.example.levels1")
        func pack(_ version: String, _ out: String) throws -> PackResult {
            try ArchivePacker.pack(folder: content, options: .init(productId: id, contentVersion: try ContentVersion(version), outputDirectory: dir + "/" + out))
        }
        let v1 = try pack("1.0", "a"), v2 = try pack("1.2", "a")
        let store = try ContentStore(dataDirectory: dir + "/data")
        guard case .published = try store.publish(archiveAt: v1.archivePath, manifest: v1.manifest) else { Issue.record("not published"); return }
        guard case .unchanged = try store.publish(archiveAt: v1.archivePath) else { Issue.record("republish was not a no-op"); return }
        guard case .published = try store.publish(archiveAt: v2.archivePath) else { Issue.record("1.2 not published"); return }
        #expect(try store.versions(productId: id.rawValue).map(\.contentVersion) == ["1.2", "1.0"])
        #expect(FileManager.default.fileExists(atPath: store.archivePath(sha256: v1.manifest.archiveSHA256)))

        let older = try pack("1.1", "b")
        let conflict = try #require(throws: CatalogError.self) { try store.publish(archiveAt: older.archivePath) }
        #expect(conflict.code == .conflict)
        #expect(conflict.message.contains("not newer than the latest published version 1.2"))

        try Data("changed\n".utf8).write(to: URL(fileURLWithPath: content + "/level.json"))
        let changed = try pack("1.2", "c")
        let immutable = try #require(throws: CatalogError.self) { try store.publish(archiveAt: changed.archivePath) }
        #expect(immutable.code == .conflict)

        var lying = changed.manifest
        lying.entries[1].sha256 = String(repeating: "0", count: 64)
        let liar = try #require(throws: CatalogError.self) { try store.publish(archiveAt: changed.archivePath, manifest: lying) }
        #expect(liar.code == .invalidArchive)
        try Data("not a zip".utf8).write(to: URL(fileURLWithPath: dir + "/junk.zip"))
        #expect((try? store.publish(archiveAt: dir + "/junk.zip")) == nil)
        // Refused uploads leave no files in the store.
        #expect(try FileManager.default.contentsOfDirectory(atPath: dir + "/data/archives").count == 2)
    }

    @Test("notifications apply once per UUID; REFUND_REVERSED restores access")
    func ledger() throws {
        let dir = FileManager.default.temporaryDirectory.path + "/ledger-" + UUID().uuidString
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let store = try ContentStore(dataDirectory: dir)
        #expect(try store.apply(notificationUUID: "n1", type: "REFUND", subtype: nil, transactionId: "t1", revoke: true, revokedAt: Date(), signedPayload: "x") == .applied)
        #expect(try store.apply(notificationUUID: "n1", type: "REFUND", subtype: nil, transactionId: "t1", revoke: true, revokedAt: Date(), signedPayload: "x") == .duplicate)
        #expect(try store.isRevoked(transactionId: "t1"))
        #expect(try store.apply(notificationUUID: "n2", type: "REFUND_REVERSED", subtype: nil, transactionId: "t1", revoke: false, revokedAt: Date(), signedPayload: "y") == .applied)
        #expect(try !store.isRevoked(transactionId: "t1"))
        // A replay of the old REFUND changes nothing.
        #expect(try store.apply(notificationUUID: "n1", type: "REFUND", subtype: nil, transactionId: "t1", revoke: true, revokedAt: Date(), signedPayload: "x") == .duplicate)
        #expect(try !store.isRevoked(transactionId: "t1"))
        #expect(try store.notificationCount() == 2)
        // State survives reopening.
        #expect(try ContentStore(dataDirectory: dir).notificationCount() == 2)
    }
}

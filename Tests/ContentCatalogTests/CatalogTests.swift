import ContentArchive
import ContentCatalog
import Foundation
import Testing

@Suite("The catalog")
struct CatalogTests {
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
        // Refused uploads leave no files in the store: two archives, each with the manifest computed from it.
        let stored = try FileManager.default.contentsOfDirectory(atPath: dir + "/data/archives")
        #expect(stored.filter { $0.hasSuffix(".zip") }.count == 2)
        #expect(stored.filter { $0.hasSuffix(".manifest.json") }.count == 2)
        #expect(stored.count == 4)
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

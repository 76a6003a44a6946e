import Crypto
import DurableFiles
import Foundation

/// The grant key file every replica shares: `{"active": "<id>", "keys": {"<id>": "<base64>"}}`.
///
/// Rotation is three edits, each picked up by running servers within their refresh interval:
/// ``adding()`` a key that is not yet active (every replica learns to accept it), then
/// ``activating(_:)`` it (new grants are signed with it, and every replica already accepts them),
/// then, once the old key's grants have expired (the token TTL), ``retiring(_:)`` the old one.
public struct GrantKeyFile: Sendable, Equatable {
    public private(set) var active: String
    /// Each key's secret (at least 32 bytes), by id.
    public private(set) var keys: [String: Data]

    public init(active: String, keys: [String: Data]) {
        (self.active, self.keys) = (active, keys)
    }

    /// A file with one fresh 256-bit key, `k1`.
    public static func generate() -> GrantKeyFile {
        GrantKeyFile(active: "k1", keys: ["k1": Self.freshSecret()])
    }

    /// The ring servers sign and check with.
    public var ring: GrantKeyRing {
        GrantKeyRing(activeKeyId: active, keys: keys.mapValues { SymmetricKey(data: $0) })
    }

    /// Key ids in order: `k2` after `k1`, `k10` after `k9`.
    public var ids: [String] { keys.keys.sorted { $0.compare($1, options: .numeric) == .orderedAscending } }

    /// The file with a fresh key under `id` (default: the next `k<n>`), not active yet.
    public func adding(_ id: String? = nil) throws(GrantKeyFileError) -> (file: GrantKeyFile, id: String) {
        let id = id ?? nextId
        guard Self.isValidId(id) else { throw GrantKeyFileError(.invalid, "'\(id)' is not a key id: use lowercase letters, digits and '-'") }
        guard keys[id] == nil else { throw GrantKeyFileError(.invalid, "there is a key '\(id)' already: choose another id, or leave --id out") }
        var copy = self
        copy.keys[id] = Self.freshSecret()
        return (copy, id)
    }

    /// The file with `id` active: new grants are signed with it.
    public func activating(_ id: String) throws(GrantKeyFileError) -> GrantKeyFile {
        guard keys[id] != nil else { throw GrantKeyFileError(.invalid, "there is no key '\(id)' (keys: \(ids.joined(separator: ", "))): add one first") }
        var copy = self
        copy.active = id
        return copy
    }

    /// The file without `id`: grants signed with it are refused from then on.
    public func retiring(_ id: String) throws(GrantKeyFileError) -> GrantKeyFile {
        guard keys[id] != nil else { throw GrantKeyFileError(.invalid, "there is no key '\(id)' (keys: \(ids.joined(separator: ", ")))") }
        guard id != active else {
            throw GrantKeyFileError(.invalid, "'\(id)' is the active key, which signs every new grant: activate another key first")
        }
        var copy = self
        copy.keys[id] = nil
        return copy
    }

    private var nextId: String {
        let numbers = keys.keys.compactMap { $0.hasPrefix("k") ? Int($0.dropFirst()) : nil }
        return "k\((numbers.max() ?? 0) + 1)"
    }

    static func isValidId(_ id: String) -> Bool {
        !id.isEmpty && id.utf8.count <= 64 && id.utf8.allSatisfy { ($0 >= 0x30 && $0 <= 0x39) || ($0 >= 0x61 && $0 <= 0x7A) || $0 == 0x2D }
    }

    private static func freshSecret() -> Data {
        SymmetricKey(size: .bits256).withUnsafeBytes { Data($0) }
    }

    // MARK: The file

    private struct Stored: Codable {
        let active: String
        let keys: [String: String]
    }

    /// The file at `path`, checked: every key at least 32 bytes under a valid id, the active one
    /// among them.
    public static func load(path: String) throws(GrantKeyFileError) -> GrantKeyFile {
        guard let data = FileManager.default.contents(atPath: path) else {
            guard FileManager.default.fileExists(atPath: path) else {
                throw GrantKeyFileError(
                    .io, "there is no grant key file at \(path): iap-server serve makes it on its first start; check --data or --grant-keys")
            }
            throw GrantKeyFileError(.io, "cannot read the grant key file \(path): run as the user the server runs as (the file is mode 0600)")
        }
        return try parse(data, path: path)
    }

    static func parse(_ data: Data, path: String) throws(GrantKeyFileError) -> GrantKeyFile {
        guard let stored = try? JSONDecoder().decode(Stored.self, from: data) else {
            throw GrantKeyFileError(
                .invalid, "\(path) is not a grant key file ({\"active\": id, \"keys\": {id: base64}}): fix it or remove it to generate a new key (outstanding grants then stop working)")
        }
        var keys: [String: Data] = [:]
        for (id, secret) in stored.keys {
            guard let bytes = Data(base64Encoded: secret), bytes.count >= 32, isValidId(id) else {
                throw GrantKeyFileError(.invalid, "key '\(id)' in \(path) must be at least 32 bytes of base64 under an id of lowercase letters, digits and '-'")
            }
            keys[id] = bytes
        }
        guard keys[stored.active] != nil else {
            throw GrantKeyFileError(.invalid, "the active key '\(stored.active)' is not among the keys in \(path)")
        }
        return GrantKeyFile(active: stored.active, keys: keys)
    }

    /// The file's bytes: readable JSON, keys in order.
    public var encoded: Data {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        // A dictionary of strings always encodes.
        return (try! encoder.encode(Stored(active: active, keys: keys.mapValues { $0.base64EncodedString() }))) + Data("\n".utf8)
    }

    /// Replaces the file at `path` atomically (mode 0600): a server reading it sees the old
    /// file or the new one, never half of one.
    public func write(to path: String) throws(GrantKeyFileError) {
        do {
            try AtomicFile.write(encoded, to: path, permissions: 0o600)
        } catch {
            throw GrantKeyFileError(.io, error.message)
        }
    }

    /// Loads the file at `path`, changes it with `change` and writes it back, holding
    /// `<path>.lock` so that two edits at once do not lose one.
    public static func edit<T>(
        path: String, _ change: (GrantKeyFile) throws(GrantKeyFileError) -> (GrantKeyFile, T)
    ) throws(GrantKeyFileError) -> T {
        let lock: FileLock
        do { lock = try FileLock(exclusive: path + ".lock") } catch { throw GrantKeyFileError(.io, error.message) }
        defer { withExtendedLifetime(lock) {} }
        let (changed, result) = try change(try load(path: path))
        try changed.write(to: path)
        return result
    }
}

import Crypto
import DurableFiles
import Foundation

/// The grant key file every replica shares: `{"active": "<id>", "keys": {"<id>": "<base64>"}}`.
///
/// Rotation is three edits, each picked up by running servers within their refresh interval:
/// ``adding(_:now:)`` a key that is not yet active (every replica learns to accept it), then
/// ``activating(_:now:settle:)`` it (new grants are signed with it, and every replica already accepts
/// them), then, once the old key's grants have expired, ``retiring(_:now:tokenTTL:)`` the old one.
/// The file records when each key was added and until when it signed, so that each step refuses
/// to come too soon: a key activated before the replicas read it, or retired while URLs it signed
/// are still valid, would have refused downloads.
public struct GrantKeyFile: Sendable, Equatable {
    public private(set) var active: String
    /// Each key's secret (at least 32 bytes), by id.
    public private(set) var keys: [String: Data]
    /// When each key was added (keys of files written before these dates were kept: absent).
    public private(set) var added: [String: Date]
    /// Until when each key that is no longer active signed grants.
    public private(set) var signedUntil: [String: Date]

    public init(active: String, keys: [String: Data], added: [String: Date] = [:], signedUntil: [String: Date] = [:]) {
        (self.active, self.keys, self.added, self.signedUntil) = (active, keys, added, signedUntil)
    }

    /// A file with one fresh 256-bit key, `k1`.
    public static func generate(now: Date = Date()) -> GrantKeyFile {
        GrantKeyFile(active: "k1", keys: ["k1": Self.freshSecret()], added: ["k1": now])
    }

    /// The ring servers sign and check with.
    public var ring: GrantKeyRing {
        GrantKeyRing(activeKeyId: active, keys: keys.mapValues { SymmetricKey(data: $0) })
    }

    /// Key ids in order: `k2` after `k1`, `k10` after `k9`.
    public var ids: [String] { keys.keys.sorted { $0.compare($1, options: .numeric) == .orderedAscending } }

    /// The file with a fresh key under `id` (default: the next `k<n>`), not active yet.
    public func adding(_ id: String? = nil, now: Date = Date()) throws(GrantKeyFileError) -> (file: GrantKeyFile, id: String) {
        let id = id ?? nextId
        guard Self.isValidId(id) else { throw GrantKeyFileError(.invalid, "'\(id)' is not a key id: use lowercase letters, digits and '-'") }
        guard keys[id] == nil else { throw GrantKeyFileError(.invalid, "there is a key '\(id)' already: choose another id, or leave --id out") }
        var copy = self
        copy.keys[id] = Self.freshSecret()
        copy.added[id] = now
        return (copy, id)
    }

    /// The file with `id` active: new grants are signed with it. Refused within `settle` of the
    /// key's adding (nil: no wait), since a replica that has not read the file yet would refuse
    /// what the key signs.
    public func activating(_ id: String, now: Date = Date(), settle: TimeInterval? = nil) throws(GrantKeyFileError) -> GrantKeyFile {
        try requireKey(id, fix: ": add one first")
        guard id != active else { return self }
        if let settle, let added = added[id], now < added + settle {
            throw GrantKeyFileError(
                .tooSoon,
                "'\(id)' was added \(Self.seconds(now.timeIntervalSince(added))) ago: servers read the key file again every --revocation-refresh (2 s by default), and one that has not would refuse the URLs '\(id)' signs; activate it from \(Self.time(added + settle)), or with --now once every replica has logged that it accepts '\(id)'"
            )
        }
        var copy = self
        copy.signedUntil[active] = now
        copy.signedUntil[id] = nil
        copy.active = id
        return copy
    }

    /// The file without `id`: grants signed with it are refused from then on. Refused while
    /// grants it signed may still be valid (`tokenTTL` after it stopped signing; nil: no wait).
    public func retiring(_ id: String, now: Date = Date(), tokenTTL: TimeInterval? = nil) throws(GrantKeyFileError) -> GrantKeyFile {
        try requireKey(id)
        guard id != active else {
            throw GrantKeyFileError(.invalid, "'\(id)' is the active key, which signs every new grant: activate another key first")
        }
        if let tokenTTL, let until = signedUntil[id], now < until + tokenTTL {
            throw GrantKeyFileError(
                .tooSoon,
                "'\(id)' signed grants until \(Self.time(until)), and those stay valid for --token-ttl (\(Self.seconds(tokenTTL))): retiring it now would refuse downloads under way; retire it from \(Self.time(until + tokenTTL)), or with --now to refuse them (a leaked key)"
            )
        }
        var copy = self
        copy.keys[id] = nil
        copy.added[id] = nil
        copy.signedUntil[id] = nil
        return copy
    }

    private func requireKey(_ id: String, fix: String = "") throws(GrantKeyFileError) {
        guard keys[id] == nil else { return }
        throw GrantKeyFileError(.invalid, "there is no key '\(id)' (keys: \(ids.joined(separator: ", ")))" + fix)
    }

    private static func time(_ date: Date) -> String { date.formatted(.iso8601) }

    private static func seconds(_ interval: TimeInterval) -> String { "\(Int(interval.rounded())) s" }

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
        /// Optional, so files written before these dates were kept still read.
        var added: [String: Date]?
        var signedUntil: [String: Date]?
    }

    private static func decoder() -> JSONDecoder {
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .iso8601
        return decoder
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
        guard let stored = try? decoder().decode(Stored.self, from: data) else {
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
        // Dates of keys no longer in the file are dropped.
        return GrantKeyFile(
            active: stored.active, keys: keys, added: (stored.added ?? [:]).filter { keys[$0.key] != nil },
            signedUntil: (stored.signedUntil ?? [:]).filter { keys[$0.key] != nil })
    }

    /// The file's bytes: readable JSON, keys in order.
    public var encoded: Data {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        let stored = Stored(
            active: active, keys: keys.mapValues { $0.base64EncodedString() }, added: added.isEmpty ? nil : added,
            signedUntil: signedUntil.isEmpty ? nil : signedUntil)
        // Strings and dates always encode.
        return (try! encoder.encode(stored)) + Data("\n".utf8)
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

extension GrantKeyFile {
    /// The file at `path`, created (mode 0600) with one fresh key when missing.
    public static func loadOrCreate(path: String) throws(GrantKeyFileError) -> GrantKeyFile {
        if let data = FileManager.default.contents(atPath: path) { return try parse(data, path: path) }
        let file = generate()
        do {
            try AtomicFile.create(file.encoded, at: path, permissions: 0o600)
        } catch  where error.code == .exists {
            // Another replica sharing the folder created it first: use its key.
            return try loadOrCreate(path: path)
        } catch {
            throw GrantKeyFileError(.io, error.message)
        }
        return file
    }
}

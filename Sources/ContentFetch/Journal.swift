import Foundation
import TransactionQueue

/// A download's state, in StoreKit's vocabulary (`SKDownloadState`).
public enum DownloadState: String, Codable, Sendable {
    case waiting, active, paused, finished, failed, cancelled

    /// finished, failed and cancelled end a run; waiting, active and paused do not.
    public var isFinal: Bool { self == .finished || self == .failed || self == .cancelled }
}

/// Why a download failed; `code` is stable for programs, `message` is for people.
public struct FetchError: Error, Codable, Sendable, Equatable, CustomStringConvertible {
    public enum Code: String, Codable, Sendable {
        /// The purchase was refunded or revoked: nothing will be downloaded for it.
        case revoked
        /// The server refused the proof of purchase (400/401/403).
        case refused
        /// No content is published for the product (404).
        case noContent = "no-content"
        /// Network or server errors persisted through every retry.
        case network
        /// The bytes did not match the grant's SHA-256 through every retry.
        case integrity
        /// The archive could not be installed (disk full, read-only folder, invalid archive).
        case install
        case cancelled
    }

    public let code: Code
    public let message: String

    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { message }
}

/// The durable record of one download (one product of one transaction), written atomically so
/// that a kill at any moment leaves a state to continue from.
public struct DownloadRecord: Codable, Sendable, Equatable {
    /// `<transactionId>-<productId>`.
    public var id: String
    public var transactionId: String
    public var productId: String
    public var contentVersion: String
    /// SHA-256 of the archive, from the grant.
    public var sha256: String
    public var expectedLength: Int64
    /// The grant URL in use (replaced when it expires).
    public var url: String
    /// The validator of the bytes on disk, sent back as `If-Range`.
    public var etag: String?
    /// Bytes of the partial file that are synced to disk.
    public var verifiedLength: Int64
    public var state: DownloadState
    public var error: FetchError?
    public var updatedAt: Date
    public var installedAt: Date?
    /// Where the content was installed (the `contentURL`), once finished.
    public var contentPath: String?
}

/// The journal folder: `<content-dir>/.iap-fetch/` holding `<id>.json` records and `<id>.partial`
/// archives. It is state, not a cache: deleting it loses resumable progress, never content.
public struct DownloadJournal: Sendable {
    public let folder: String

    public init(contentDirectory: String) throws(FetchError) {
        folder = contentDirectory + "/.iap-fetch"
        do {
            try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        } catch {
            throw FetchError(.install, "cannot create \(folder): \(error.localizedDescription); choose a writable --content-dir")
        }
    }

    public func partialPath(_ id: String) -> String { folder + "/" + id + ".partial" }
    private func recordPath(_ id: String) -> String { folder + "/" + id + ".json" }

    public func load(_ id: String) -> DownloadRecord? {
        guard let data = FileManager.default.contents(atPath: recordPath(id)) else { return nil }
        return try? Self.decoder.decode(DownloadRecord.self, from: data)
    }

    public func save(_ record: DownloadRecord) throws(FetchError) {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
        encoder.dateEncodingStrategy = .millisecondsSince1970
        do {
            try atomicWrite(try encoder.encode(record), to: recordPath(record.id), permissions: 0o644)
        } catch let error as TransactionQueueError {
            throw FetchError(.install, "cannot save the download journal: \(error.message)")
        } catch {
            throw FetchError(.install, "cannot save the download journal: \(error)")
        }
    }

    public func all() -> [DownloadRecord] {
        let names = (try? FileManager.default.contentsOfDirectory(atPath: folder)) ?? []
        return names.filter { $0.hasSuffix(".json") }.compactMap { load(String($0.dropLast(5))) }.sorted { $0.updatedAt < $1.updatedAt }
    }

    private static let decoder: JSONDecoder = {
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .millisecondsSince1970
        return decoder
    }()
}

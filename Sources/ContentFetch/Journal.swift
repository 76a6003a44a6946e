import DurableFiles
import Foundation
import IAPProtocol
import TransactionQueue

/// A download's state, in StoreKit's vocabulary (`SKDownloadState`).
public enum DownloadState: String, Codable, Sendable {
    case waiting, active, paused, finished, failed, cancelled

    /// finished, failed and cancelled end a run; waiting, active and paused do not.
    public var isFinal: Bool { self == .finished || self == .failed || self == .cancelled }
}

/// Why a download failed; stable for programs.
public enum FetchErrorCode: String, ErrorCode {
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
    /// Another iap-fetch process is downloading the same content into the same folder.
    case busy
    /// An `https://` server's certificate was not accepted (untrusted, expired, for another
    /// name), or the certificate authorities given to trust could not be read. Not retried: the
    /// same certificate fails the same way until the server or the configuration changes.
    case tls
    case cancelled
}

/// Why a download failed: `code` for programs, `message` for people.
public typealias FetchError = CodedError<FetchErrorCode>

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
    /// Bytes of the partial file recorded as written (with several connections, the sum over
    /// `segments`): all of them survive a killed process; `durable` says which survive a power cut.
    public var recordedLength: Int64
    /// With several connections: the ranges being fetched and how much of each is on disk.
    var segments: [Segment]? = nil
    /// The boot during which `recordedLength` and `segments` were recorded. Those bytes were
    /// written but not all synced: they survive a killed process (the page cache keeps them) but
    /// not a power cut, so after a reboot only `durable` is trusted.
    var bootId: String? = nil
    /// The segments as of the last fsync of the partial file.
    var durable: [Segment]? = nil
    /// The folder (in the product's) of the extraction that holds the bytes of the stored files
    /// the partial file left out (``LeftOutRanges``): after a kill, the next run copies them back.
    public internal(set) var streamedInto: String? = nil
    public var state: DownloadState
    public var error: FetchError?
    public var updatedAt: Date
    public var installedAt: Date?
    /// Where the content was installed (the `contentURL`), once finished.
    public var contentPath: String?
    /// A delta update: only these ranges are fetched, the rest comes from the installed version.
    public var delta: DeltaPlan? = nil
    /// SHA-256 of the manifest the grant named (saved as `<id>.manifest.json`): its chunk hashes
    /// locate damaged bytes, so that only what follows them is fetched again.
    public var manifestSHA256: String? = nil
}

/// Identifies the running boot of the machine, so that the journal can tell a killed process
/// (page cache intact) from a reboot (only synced bytes are safe).
enum BootID {
    static let current: String? = {
        #if os(Linux)
            guard let text = try? String(contentsOfFile: "/proc/sys/kernel/random/boot_id", encoding: .utf8) else { return nil }
            let id = text.trimmingCharacters(in: .whitespacesAndNewlines)
            return id.isEmpty ? nil : id
        #else
            return nil
        #endif
    }()
}

/// What `DownloadJournal.cancel` did.
public enum CancelOutcome: Sendable, Equatable {
    case cancelled
    /// A running iap-fetch holds the download; it was asked to cancel it.
    case requested
    case alreadyFinished(String)
    case unknown
}

extension DownloadRecord {
    /// Forgets every byte on disk: the next transfer starts from zero.
    mutating func discardBytes() {
        recordedLength = 0
        segments = nil
        durable = nil
        etag = nil
        delta = nil
        streamedInto = nil
    }

    /// Keeps only the bytes below `offset` as written: the partial file lacks those after it.
    mutating func keepBytes(below offset: Int64) {
        func clamp(_ segments: [Segment]?) -> [Segment]? {
            segments?.map { segment in
                var segment = segment
                segment.done = min(segment.done, max(0, offset - segment.start))
                return segment
            }
        }
        segments = clamp(segments)
        durable = clamp(durable)
        recordedLength = segments.map { $0.reduce(0) { $0 + $1.done } } ?? min(recordedLength, offset)
    }
}

/// The journal folder: `<content-dir>/.iap-fetch/` holding `<id>.json` records and `<id>.partial`
/// archives. It is state, not a cache: deleting it loses resumable progress, never content.
public struct DownloadJournal: Sendable {
    public let folder: String

    /// The journal of `contentDirectory`, creating the content folder and the journal folder.
    public init(contentDirectory: String) throws(FetchError) {
        folder = contentDirectory + "/.iap-fetch"
        // The content folder first, so that a path naming a file is reported as that.
        do {
            try Directory.create(contentDirectory)
            try Directory.create(folder)
        } catch {
            throw FetchError(.install, "the content folder (--content-dir): \(error.message)")
        }
    }

    /// The journal of `contentDirectory` if that folder exists, creating nothing: for commands
    /// that only look (a mistyped `--content-dir` must not leave a folder behind). nil when it
    /// does not exist.
    public static func existing(contentDirectory: String) throws(FetchError) -> DownloadJournal? {
        var isFolder: ObjCBool = false
        guard FileManager.default.fileExists(atPath: contentDirectory, isDirectory: &isFolder) else { return nil }
        guard isFolder.boolValue else {
            throw FetchError(.install, "the content folder (--content-dir): \(contentDirectory) exists and is not a folder")
        }
        return DownloadJournal(folder: contentDirectory + "/.iap-fetch")
    }

    private init(folder: String) { self.folder = folder }

    /// Where the archive of download `id` grows until it is verified.
    public func partialPath(_ id: String) -> String { folder + "/" + id + ".partial" }
    /// The manifest of the version being downloaded, checked against the grant's SHA-256.
    public func manifestPath(_ id: String) -> String { folder + "/" + id + ".manifest.json" }
    /// A file whose presence asks the process downloading `id` to cancel it (see `requestCancel`).
    func cancelRequestPath(_ id: String) -> String { folder + "/" + id + ".cancel" }
    private func recordPath(_ id: String) -> String { folder + "/" + id + ".json" }

    /// The record of download `id`, or nil when there is none or it cannot be read: a damaged
    /// record is treated as no record, so it never stops the other downloads.
    public func load(_ id: String) -> DownloadRecord? {
        guard let data = FileManager.default.contents(atPath: recordPath(id)) else { return nil }
        return try? Self.decoder.decode(DownloadRecord.self, from: data)
    }

    /// Writes `record` atomically, surviving what `durability` says.
    public func save(_ record: DownloadRecord, durability: Durability = .powerLoss) throws(FetchError) {
        let data: Data
        do { data = try Self.encoder.encode(record) } catch {
            throw FetchError(.install, "cannot encode the download journal: \(error)")
        }
        do {
            try AtomicFile.write(data, to: recordPath(record.id), permissions: 0o644, durability: durability)
        } catch {
            throw FetchError(.install, "cannot save the download journal: \(error.message)")
        }
    }

    /// Cancels download `id`: its partial file is deleted and its state is `cancelled`; its
    /// transaction stays unfinished. When another process is downloading it (it holds a lock on
    /// the partial file), that process is asked instead and stops at its next journal sync;
    /// the result says which happened.
    public func cancel(_ id: String) throws(FetchError) -> CancelOutcome {
        guard var record = load(id) else { return .unknown }
        guard record.state != .finished else { return .alreadyFinished(record.contentPath ?? "") }
        let fd = open(partialPath(id), O_RDWR | O_CLOEXEC)
        if fd >= 0 {
            defer { close(fd) }
            if flock(fd, LOCK_EX | LOCK_NB) != 0 {
                do {
                    try AtomicFile.write(Data(), to: cancelRequestPath(id), permissions: 0o644)
                } catch {
                    throw FetchError(.install, "cannot ask the running download to cancel: \(error.message)")
                }
                return .requested
            }
        }
        unlink(cancelRequestPath(id))
        try markCancelled(&record)
        return .cancelled
    }

    /// The one way a download becomes `cancelled`: its partial file goes, the record forgets
    /// its bytes (the next start downloads from zero) and is saved.
    func markCancelled(_ record: inout DownloadRecord) throws(FetchError) {
        removeBytes(record.id)
        record.discardBytes()
        record.state = .cancelled
        record.error = nil
        record.updatedAt = Date()
        try save(record)
    }

    /// The bytes the file system has allocated to download `id`'s partial archive (its blocks,
    /// reserved ahead of the bytes written: `PartialArchive.reserve`), or 0 without one.
    func partialAllocatedBytes(_ id: String) -> Int64 {
        var status = stat()
        return stat(partialPath(id), &status) == 0 ? Int64(status.st_blocks) * 512 : 0
    }

    /// Deletes what download `id` fetched (its partial archive and the manifest kept beside it),
    /// once its record no longer counts on them.
    func removeBytes(_ id: String) {
        unlink(partialPath(id))
        unlink(manifestPath(id))
    }

    /// Whether another process asked to cancel `id`; the request is consumed.
    func takeCancelRequest(_ id: String) -> Bool {
        unlink(cancelRequestPath(id)) == 0
    }

    /// Every readable record, oldest update first (what `iap-fetch status` lists).
    public func all() -> [DownloadRecord] { (try? listed()) ?? [] }

    /// Every record, oldest first, for a reader that must tell "none" from "cannot read the
    /// journal": a journal folder that exists but cannot be listed throws, naming it.
    public func listed() throws(FetchError) -> [DownloadRecord] {
        let names: [String]
        do {
            names = try FileManager.default.contentsOfDirectory(atPath: folder)
        } catch {
            guard FileManager.default.fileExists(atPath: folder) else { return [] }
            let reason = access(folder, R_OK | X_OK) == 0 ? error.localizedDescription : String(cString: strerror(errno)).lowercased()
            throw FetchError(.install, "cannot read the download journal \(folder) (\(reason)): run as the user that downloads, or fix its permissions")
        }
        return names.filter { $0.hasSuffix(".json") }.compactMap { load(String($0.dropLast(5))) }.sorted { $0.updatedAt < $1.updatedAt }
    }

    /// Made once: a record is saved every 1 MiB received.
    private static let encoder: JSONEncoder = {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
        encoder.dateEncodingStrategy = .millisecondsSince1970
        return encoder
    }()

    private static let decoder: JSONDecoder = {
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .millisecondsSince1970
        return decoder
    }()
}

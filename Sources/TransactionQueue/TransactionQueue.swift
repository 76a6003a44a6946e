import Foundation
import SystemPackage
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A transaction waiting on the device to be processed and finished.
public struct QueuedTransaction: Codable, Sendable, Equatable {
    public var transactionId: String
    public var productId: String
    /// The signed transaction (JWS), the proof of purchase sent to the content server.
    public var signedTransaction: String
    public var addedAt: Date
    /// When the transaction was finished; nil while unfinished.
    public var finishedAt: Date?

    public init(transactionId: String, productId: String, signedTransaction: String, addedAt: Date = Date(), finishedAt: Date? = nil) {
        self.transactionId = transactionId
        self.productId = productId
        self.signedTransaction = signedTransaction
        self.addedAt = addedAt
        self.finishedAt = finishedAt
    }

    public var isFinished: Bool { finishedAt != nil }
}

/// Where a downloader gets transactions from and reports them finished: the file-backed queue
/// here, or StoreKit's `Transaction.unfinished` on Apple platforms.
public protocol TransactionSource: Sendable {
    /// Transactions not finished yet, oldest first.
    func unfinishedTransactions() async throws -> [QueuedTransaction]
    /// Finishes a transaction. Finishing one already finished changes nothing.
    func finish(transactionId: String) async throws
}

/// An error from the transaction queue, naming the problem and the fix.
public struct TransactionQueueError: Error, Sendable, CustomStringConvertible {
    public let message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}

/// The device's transaction queue, kept in a folder: one JSON file per transaction.
///
/// Every change is written to a temporary file, synced, and renamed over the old one (then the
/// folder is synced), so a kill at any point leaves either the old or the new state. Changes take
/// an exclusive `flock` on `<folder>/.lock`, so several processes can share a queue. A finished
/// transaction can never become unfinished again.
public struct FileTransactionQueue: TransactionSource {
    public let folder: String

    public init(folder: String) throws(TransactionQueueError) {
        self.folder = folder
        if mkdir(folder, 0o700) != 0 && errno != EEXIST {
            throw TransactionQueueError("cannot create the transaction queue folder \(folder): \(String(cString: strerror(errno)))")
        }
    }

    /// Adds an unfinished transaction. Adding one that is already queued changes nothing (and
    /// never turns a finished one back into unfinished).
    @discardableResult
    public func add(_ transaction: QueuedTransaction) throws(TransactionQueueError) -> QueuedTransaction {
        try Self.validate(id: transaction.transactionId)
        return try locked { () throws(TransactionQueueError) in
            if let existing = try read(transaction.transactionId) { return existing }
            var fresh = transaction
            fresh.finishedAt = nil
            try write(fresh)
            return fresh
        }
    }

    /// Every transaction, finished or not, oldest first.
    public func all() throws(TransactionQueueError) -> [QueuedTransaction] {
        let names: [String]
        do {
            names = try FileManager.default.contentsOfDirectory(atPath: folder)
        } catch {
            throw TransactionQueueError("cannot list the transaction queue \(folder): \(error.localizedDescription)")
        }
        var result: [QueuedTransaction] = []
        for name in names where name.hasSuffix(".json") && !name.hasPrefix(".") {
            if let transaction = try read(String(name.dropLast(5))) { result.append(transaction) }
        }
        return result.sorted { ($0.addedAt, $0.transactionId) < ($1.addedAt, $1.transactionId) }
    }

    public func transaction(_ id: String) throws(TransactionQueueError) -> QueuedTransaction? {
        try Self.validate(id: id)
        return try read(id)
    }

    public func unfinishedTransactions() async throws -> [QueuedTransaction] {
        try all().filter { !$0.isFinished }
    }

    public func finish(transactionId: String) async throws {
        try finishNow(transactionId)
    }

    /// Finishes a transaction durably and returns it; idempotent: finishing again keeps the first time.
    @discardableResult
    public func finishNow(_ id: String, at date: Date = Date()) throws(TransactionQueueError) -> QueuedTransaction {
        try Self.validate(id: id)
        return try locked { () throws(TransactionQueueError) in
            guard var transaction = try read(id) else {
                throw TransactionQueueError("transaction \(id) is not in the queue at \(folder)")
            }
            if transaction.isFinished { return transaction }
            transaction.finishedAt = date
            try write(transaction)
            return transaction
        }
    }

    private static func validate(id: String) throws(TransactionQueueError) {
        guard !id.isEmpty, id.utf8.count <= 64, id.utf8.allSatisfy({ ($0 >= 0x30 && $0 <= 0x39) || ($0 >= 0x41 && $0 <= 0x5A) || ($0 >= 0x61 && $0 <= 0x7A) || $0 == 0x2D || $0 == 0x5F }) else {
            throw TransactionQueueError("'\(id)' is not a transaction id (letters, digits, '-' and '_', at most 64)")
        }
    }

    private func path(_ id: String) -> String { folder + "/" + id + ".json" }

    private func read(_ id: String) throws(TransactionQueueError) -> QueuedTransaction? {
        guard let data = FileManager.default.contents(atPath: path(id)) else { return nil }
        do {
            let decoder = JSONDecoder()
            decoder.dateDecodingStrategy = .iso8601withFractions
            return try decoder.decode(QueuedTransaction.self, from: data)
        } catch {
            throw TransactionQueueError("\(path(id)) is not a valid queued transaction: restore it from a backup or remove it")
        }
    }

    private func write(_ transaction: QueuedTransaction) throws(TransactionQueueError) {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
        encoder.dateEncodingStrategy = .iso8601withFractions
        let data: Data
        do { data = try encoder.encode(transaction) } catch { throw TransactionQueueError("cannot encode transaction \(transaction.transactionId)") }
        try atomicWrite(data, to: path(transaction.transactionId))
        syncFolder(folder)
    }

    private func locked<T>(_ body: () throws(TransactionQueueError) -> T) throws(TransactionQueueError) -> T {
        let fd = open(folder + "/.lock", O_CREAT | O_RDWR | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw TransactionQueueError("cannot lock the transaction queue \(folder): \(String(cString: strerror(errno)))") }
        defer { close(fd) }
        while flock(fd, LOCK_EX) != 0 {
            guard errno == EINTR else { throw TransactionQueueError("cannot lock the transaction queue \(folder): \(String(cString: strerror(errno)))") }
        }
        return try body()
    }
}

/// Writes a file so that a crash leaves the old contents or the new, never a mix: a temporary
/// file in the same folder, fsync, rename. Permissions 0600.
///
/// With `durable: false` the fsync is skipped: the rename still makes the replacement atomic for
/// a killed process, but after a power cut the file may hold the previous contents.
public func atomicWrite(_ data: Data, to path: String, permissions: mode_t = 0o600, durable: Bool = true) throws(TransactionQueueError) {
    let temp = path + ".tmp-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
    let fd = open(temp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, permissions)
    guard fd >= 0 else { throw TransactionQueueError("cannot write \(path): \(String(cString: strerror(errno))); check the folder exists and is writable") }
    var writeErrno: Int32 = 0
    var ok = data.withUnsafeBytes { raw -> Bool in
        do {
            _ = try FileDescriptor(rawValue: fd).writeAll(raw)
            return true
        } catch {
            writeErrno = (error as? Errno)?.rawValue ?? EIO
            return false
        }
    }
    ok = ok && (!durable || fsync(fd) == 0)
    close(fd)
    guard ok, rename(temp, path) == 0 else {
        let code = ok ? errno : writeErrno
        unlink(temp)
        throw TransactionQueueError("cannot write \(path): \(String(cString: strerror(code))); free disk space or fix permissions")
    }
}

func syncFolder(_ path: String) {
    let fd = open(path, O_RDONLY | O_DIRECTORY)
    guard fd >= 0 else { return }
    fsync(fd)
    close(fd)
}

extension JSONEncoder.DateEncodingStrategy {
    /// ISO 8601 with milliseconds, so finish times order precisely.
    static let iso8601withFractions = JSONEncoder.DateEncodingStrategy.custom { date, encoder in
        var container = encoder.singleValueContainer()
        try container.encode(date.formatted(.iso8601.year().month().day().time(includingFractionalSeconds: true).timeZone(separator: .omitted)))
    }
}

extension JSONDecoder.DateDecodingStrategy {
    static let iso8601withFractions = JSONDecoder.DateDecodingStrategy.custom { decoder in
        let container = try decoder.singleValueContainer()
        let text = try container.decode(String.self)
        if let date = try? Date(text, strategy: .iso8601.year().month().day().time(includingFractionalSeconds: true).timeZone(separator: .omitted)) {
            return date
        }
        if let date = try? Date(text, strategy: .iso8601) { return date }
        throw DecodingError.dataCorruptedError(in: container, debugDescription: "not an ISO 8601 date: \(text)")
    }
}

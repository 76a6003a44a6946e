import DurableFiles
import Foundation
import IAPProtocol
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
    /// A StoreKit 1 transaction: the app receipt file (the device's `appStoreReceiptURL`) whose
    /// purchase with this transaction id is the proof sent to the server instead of a JWS.
    public var receiptPath: String?

    public init(
        transactionId: String, productId: String, signedTransaction: String, addedAt: Date = Date(), finishedAt: Date? = nil, receiptPath: String? = nil
    ) {
        self.transactionId = transactionId
        self.productId = productId
        self.signedTransaction = signedTransaction
        self.addedAt = addedAt
        self.finishedAt = finishedAt
        self.receiptPath = receiptPath
    }

    /// StoreKit 1 (an app receipt proves it) rather than StoreKit 2 (a signed transaction).
    public var isStoreKit1: Bool { receiptPath != nil }

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

/// What went wrong with the transaction queue.
public enum TransactionQueueErrorCode: String, ErrorCode {
    /// The queue folder or a file in it cannot be read, written or locked.
    case io
    /// A queued transaction's file is damaged.
    case damaged
    /// No such transaction, or not a transaction id.
    case notFound = "not-found"
}

/// An error from the transaction queue, naming the problem and the fix.
public typealias TransactionQueueError = CodedError<TransactionQueueErrorCode>

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
            throw TransactionQueueError(.io, "cannot create the transaction queue folder \(folder): \(String(cString: strerror(errno)))")
        }
    }

    /// Opens a queue folder that must exist already, creating nothing: for a reader of a queue
    /// that another made (`iap-fetch run` over iap-sandbox's), where a mistyped path is to be
    /// said, not made into an empty queue that reports nothing to do.
    public static func existing(folder: String) throws(TransactionQueueError) -> FileTransactionQueue {
        var info = stat()
        guard stat(folder, &info) == 0 else {
            let code = errno
            if code == ENOENT {
                throw TransactionQueueError(
                    .notFound, "the transaction queue folder \(folder) does not exist: pass the queue a store fills (iap-sandbox's <dir>/queue)")
            }
            throw TransactionQueueError(.io, ioFailureMessage(code, action: "open the transaction queue folder", path: folder))
        }
        guard info.st_mode & S_IFMT == S_IFDIR else {
            throw TransactionQueueError(
                .notFound, "the transaction queue folder \(folder) is not a folder: pass the queue a store fills (iap-sandbox's <dir>/queue)")
        }
        return FileTransactionQueue(existing: folder)
    }

    private init(existing folder: String) { self.folder = folder }

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
            throw TransactionQueueError(.io, "cannot list the transaction queue \(folder): \(error.localizedDescription)")
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
                throw TransactionQueueError(.notFound, "transaction \(id) is not in the queue at \(folder)")
            }
            if transaction.isFinished { return transaction }
            transaction.finishedAt = date
            try write(transaction)
            return transaction
        }
    }

    private static func validate(id: String) throws(TransactionQueueError) {
        guard !id.isEmpty, id.utf8.count <= 64, id.utf8.allSatisfy({ ($0 >= 0x30 && $0 <= 0x39) || ($0 >= 0x41 && $0 <= 0x5A) || ($0 >= 0x61 && $0 <= 0x7A) || $0 == 0x2D || $0 == 0x5F }) else {
            throw TransactionQueueError(.notFound, "'\(id)' is not a transaction id (letters, digits, '-' and '_', at most 64)")
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
            throw TransactionQueueError(.damaged, "\(path(id)) is not a valid queued transaction: restore it from a backup or remove it")
        }
    }

    private func write(_ transaction: QueuedTransaction) throws(TransactionQueueError) {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
        encoder.dateEncodingStrategy = .iso8601withFractions
        let data: Data
        do { data = try encoder.encode(transaction) } catch { throw TransactionQueueError(.io, "cannot encode transaction \(transaction.transactionId)") }
        do {
            try AtomicFile.write(data, to: path(transaction.transactionId))
        } catch {
            throw TransactionQueueError(.io, error.message)
        }
    }

    private func locked<T>(_ body: () throws(TransactionQueueError) -> T) throws(TransactionQueueError) -> T {
        let lock: FileLock
        do { lock = try FileLock(exclusive: folder + "/.lock") } catch {
            throw TransactionQueueError(.io, "cannot lock the transaction queue: \(error.message)")
        }
        defer { lock.release() }
        return try body()
    }
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

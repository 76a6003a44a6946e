import Base64URL
import Foundation

/// Every purchase in a queue that can own content, finished or not: the source of a run that
/// brings installed content up to date. Owners are not told of a new content version (neither
/// were they by Apple's hosted content); the app asks again with each purchase, and the server's
/// grant says which version that purchase gets now. A run over this source downloads only where
/// the granted archive is not the one installed (as a delta update when it can), and finishing a
/// finished transaction again changes nothing.
///
/// Consumables are left out (their content, if any, was delivered once). Which purchases are
/// consumables is read from each signed transaction's payload without verifying it: the server
/// verifies every purchase it is sent.
public struct OwnedTransactions: TransactionSource {
    public let queue: FileTransactionQueue

    public init(queue: FileTransactionQueue) {
        self.queue = queue
    }

    public func unfinishedTransactions() async throws -> [QueuedTransaction] {
        try queue.all().filter { !Self.isConsumable($0.signedTransaction) }
    }

    public func finish(transactionId: String) async throws {
        try queue.finishNow(transactionId)
    }

    /// Whether a signed transaction's payload says `"type": "Consumable"`.
    static func isConsumable(_ jws: String) -> Bool {
        let parts = jws.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let payload = Base64URL.decode(parts[1].utf8),
            let object = try? JSONSerialization.jsonObject(with: Data(payload)) as? [String: Any]
        else { return false }
        return object["type"] as? String == "Consumable"
    }
}

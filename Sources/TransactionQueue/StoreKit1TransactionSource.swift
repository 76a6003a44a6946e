#if canImport(StoreKit)
    import Foundation
    import StoreKit

    /// The device's queue for StoreKit 1 apps (the apps that used Apple-hosted content):
    /// `SKPaymentQueue`'s purchased and restored transactions, each proven to the content server
    /// by the app receipt at `Bundle.main.appStoreReceiptURL` and finished with
    /// `finishTransaction` only once the content is installed.
    ///
    /// Compiles on Apple platforms only; it is not built or tested on Linux, where the sandbox's
    /// `purchase --storekit 1` and ``FileTransactionQueue`` play its part. A restored transaction
    /// is queued under its original transaction id, the one the receipt holds.
    @available(iOS 13.0, macOS 10.15, tvOS 13.0, watchOS 6.2, visionOS 1.0, *)
    public final class StoreKit1TransactionSource: NSObject, TransactionSource, SKPaymentTransactionObserver, @unchecked Sendable {
        // @unchecked: SKPaymentQueue is thread-safe; this object holds no other state.
        private let queue: SKPaymentQueue

        /// Registers as an observer: StoreKit delivers transactions only to a queue that has one.
        public init(queue: SKPaymentQueue = .default()) {
            self.queue = queue
            super.init()
            queue.add(self)
        }

        deinit { queue.remove(self) }

        public func paymentQueue(_ queue: SKPaymentQueue, updatedTransactions transactions: [SKPaymentTransaction]) {
            // Read on demand by unfinishedTransactions(); the app's own observer shows UI.
        }

        public func unfinishedTransactions() async throws -> [QueuedTransaction] {
            guard let receipt = Bundle.main.appStoreReceiptURL?.path else { return [] }
            return queue.transactions.compactMap { transaction -> QueuedTransaction? in
                guard transaction.transactionState == .purchased || transaction.transactionState == .restored,
                    let id = transaction.original?.transactionIdentifier ?? transaction.transactionIdentifier
                else { return nil }
                return QueuedTransaction(
                    transactionId: id, productId: transaction.payment.productIdentifier, signedTransaction: "",
                    addedAt: transaction.transactionDate ?? Date(), receiptPath: receipt)
            }.sorted { $0.addedAt < $1.addedAt }
        }

        public func finish(transactionId: String) async throws {
            for transaction in queue.transactions
            where transaction.transactionIdentifier == transactionId || transaction.original?.transactionIdentifier == transactionId {
                queue.finishTransaction(transaction)
            }
        }
    }
#endif

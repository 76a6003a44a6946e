#if canImport(StoreKit)
    import StoreKit

    /// The device's real queue on Apple platforms: StoreKit 2's unfinished transactions.
    ///
    /// Compiles on Apple platforms only (it is not built or tested on Linux). An app creates a
    /// `ContentFetcher` with this source at launch, calls `start()`, and again for every element of
    /// `Transaction.updates`; the content server verifies each transaction's `jwsRepresentation`, so
    /// the local verification result is not trusted here. Purchases of products the server has no
    /// hosted content for (consumables, subscriptions) come back in `RunSummary.withoutContent`,
    /// and refunded ones in `RunSummary.revoked`, both unfinished: the app delivers (or withdraws)
    /// what they bought and finishes them itself.
    @available(iOS 15.0, macOS 12.0, tvOS 15.0, watchOS 8.0, visionOS 1.0, *)
    public struct StoreKitTransactionSource: TransactionSource {
        public init() {}

        public func unfinishedTransactions() async throws -> [QueuedTransaction] {
            await StoreKitTransactions.queued(StoreKit.Transaction.unfinished)
        }

        public func finish(transactionId: String) async throws {
            await StoreKitTransactions.finish(transactionId, in: StoreKit.Transaction.unfinished)
        }
    }

    /// StoreKit 2's current entitlements, finished transactions included: the source of a run
    /// that brings installed content up to date when a new content version is out (see
    /// ``OwnedTransactions``, the same over a queue folder). Compiles on Apple platforms only.
    @available(iOS 15.0, macOS 12.0, tvOS 15.0, watchOS 8.0, visionOS 1.0, *)
    public struct StoreKitEntitlementSource: TransactionSource {
        public init() {}

        public func unfinishedTransactions() async throws -> [QueuedTransaction] {
            await StoreKitTransactions.queued(StoreKit.Transaction.currentEntitlements)
        }

        public func finish(transactionId: String) async throws {
            await StoreKitTransactions.finish(transactionId, in: StoreKit.Transaction.currentEntitlements)
        }
    }

    /// What both sources do with one of StoreKit's sequences of transactions.
    @available(iOS 15.0, macOS 12.0, tvOS 15.0, watchOS 8.0, visionOS 1.0, *)
    enum StoreKitTransactions {
        static func queued(_ transactions: StoreKit.Transaction.Transactions) async -> [QueuedTransaction] {
            var result: [QueuedTransaction] = []
            for await verification in transactions {
                let transaction = verification.unsafePayloadValue
                result.append(
                    QueuedTransaction(
                        transactionId: String(transaction.id), productId: transaction.productID,
                        signedTransaction: verification.jwsRepresentation, addedAt: transaction.purchaseDate))
            }
            return result.sorted { $0.addedAt < $1.addedAt }
        }

        static func finish(_ transactionId: String, in transactions: StoreKit.Transaction.Transactions) async {
            for await verification in transactions where String(verification.unsafePayloadValue.id) == transactionId {
                await verification.unsafePayloadValue.finish()
            }
        }
    }
#endif

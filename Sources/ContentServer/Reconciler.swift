import AppStoreServerAPI
import AppStoreServerClient
import ContentCatalog
import Foundation
import IAPProtocol
import PurchaseVerification

/// Catches up on notifications the server missed (it was down, or Apple gave up retrying): asks
/// the App Store Server API's Get Notification History for a time window and applies every
/// notification through ``NotificationLedger``, as if it had been POSTed. Each signed payload is
/// verified exactly like a POSTed one; the API's TLS is not what makes it trusted.
public struct Reconciler: Sendable {
    public let ledger: NotificationLedger
    public let verifier: SignedDataVerifier
    /// One per App Store environment queried (Apple runs production and sandbox on two hosts).
    public let clients: [StoreAPIClient]

    public init(store: ContentStore, verifier: SignedDataVerifier, clients: [StoreAPIClient]) {
        self.ledger = NotificationLedger(store: store)
        self.verifier = verifier
        self.clients = clients
    }

    /// What a reconciliation found and did.
    public struct Report: Sendable, Codable, Equatable {
        /// Notifications the history held for the window.
        public var fetched = 0
        /// New to the ledger and applied now.
        public var applied = 0
        /// Already in the ledger (delivered before, or an earlier reconcile).
        public var duplicates = 0
        /// Transactions whose access was cut by the applied ones.
        public var revoked: [String] = []
        /// Transactions whose access came back (a reversed refund).
        public var restored: [String] = []
        /// Payloads that failed verification, with the reason; never applied.
        public var refused: [String] = []
    }

    /// Reconciles `[since, until]`. Throws only when the API or the ledger fails; a payload
    /// that does not verify is reported and skipped.
    public func run(since: Date, until: Date = Date()) async throws(ReconcileError) -> Report {
        var report = Report()
        let request = NotificationHistoryRequest(startDate: since.storeAPIMilliseconds, endDate: until.storeAPIMilliseconds)
        for client in clients {
            let items: [NotificationHistoryItem]
            do { items = try await client.allNotifications(request) } catch { throw ReconcileError(.api, error.message) }
            report.fetched += items.count
            for item in items {
                let notification: NotificationPayload, transaction: Transaction?
                do { (notification, transaction) = try await verifier.verifyNotification(item.signedPayload) } catch {
                    report.refused.append("\(error.code.rawValue): \(error.message)")
                    continue
                }
                let outcome: NotificationOutcome
                do { outcome = try await ledger.record(notification, transaction: transaction, signedPayload: item.signedPayload) } catch {
                    throw ReconcileError(.storage, error.message)
                }
                guard outcome == .applied else {
                    report.duplicates += 1
                    continue
                }
                report.applied += 1
                if let id = transaction?.transactionId, let revoke = NotificationLedger.revokes(notification.notificationType ?? .init(rawValue: "")) {
                    if revoke { report.revoked.append(id) } else { report.restored.append(id) }
                }
            }
        }
        return report
    }
}

/// Why a reconciliation stopped.
public enum ReconcileErrorCode: String, ErrorCode {
    /// The App Store Server API could not be asked (credentials, URL, outage).
    case api
    /// The ledger could not be written.
    case storage
}

public typealias ReconcileError = CodedError<ReconcileErrorCode>

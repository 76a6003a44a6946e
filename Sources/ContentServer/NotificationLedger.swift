import ContentCatalog
import Foundation
import PurchaseVerification

/// Turns verified App Store Server Notifications into ledger changes: the one path shared by
/// `POST /v1/notifications` and `iap-server reconcile`, so a notification has the same effect
/// however it arrives, and only once per `notificationUUID`.
public struct NotificationLedger: Sendable {
    public let store: ContentStore

    public init(store: ContentStore) { self.store = store }

    /// What a notification type does to access: cut it (refund, revoke), give it back (a
    /// reversed refund), or nothing.
    public static func revokes(_ type: NotificationType) -> Bool? {
        switch type {
        case .refund, .revoke: true
        case .refundReversed: false
        default: nil
        }
    }

    /// Stores the notification and applies it in one database transaction.
    public func record(_ notification: NotificationPayload, transaction: Transaction?, signedPayload: String, now: Date = Date()) async throws(CatalogError)
        -> NotificationOutcome
    {
        let type = notification.notificationType ?? NotificationType(rawValue: "UNKNOWN")
        return try await store.apply(
            notificationUUID: notification.notificationUUID ?? "", type: type.rawValue, subtype: notification.subtype,
            transactionId: transaction?.transactionId, revoke: Self.revokes(type), revokedAt: transaction?.revocationDate ?? now,
            signedPayload: signedPayload, now: now)
    }
}

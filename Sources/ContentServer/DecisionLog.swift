import Logging
import PurchaseVerification

/// One log line for each decision an operator may be asked about: a download granted or refused
/// (and why, under which transaction), a notification applied or refused, a catalog change through
/// the admin API. "I bought it and cannot download" is answered by searching the log for the
/// transaction id; the metrics only count outcomes.
///
/// Grants and notifications are `info`, catalog changes `notice`, and what points at a
/// misconfiguration or a probe (a notification that does not verify, a wrong admin token)
/// `warning`. Nothing secret is logged: no signed payload, receipt, grant token or download URL.
/// Text that came from a request is logged with its control characters escaped and cut to 300
/// characters, so that it cannot forge a line of its own.
struct DecisionLog: Sendable {
    let logger: Logger

    /// The proof of purchase a grant was asked with.
    enum Proof: String {
        case signedTransaction = "signed-transaction"
        case receipt
    }

    func granted(_ transaction: Transaction, contentVersion: String, proof: Proof) {
        var metadata = Self.describe(transaction, proof: proof)
        metadata["contentVersion"] = .string(Self.safe(contentVersion))
        logger.info("download granted", metadata: metadata)
    }

    /// A refusal; `transaction` is nil when the proof itself did not verify.
    func refused(code: String, reason: String, transaction: Transaction?, proof: Proof) {
        var metadata = transaction.map { Self.describe($0, proof: proof) } ?? ["proof": .string(proof.rawValue)]
        metadata["code"] = .string(Self.safe(code))
        metadata["reason"] = .string(Self.safe(reason))
        logger.info("download refused", metadata: metadata)
    }

    /// A verified notification the ledger took: `applied` (new) or a duplicate. `revokes` is the
    /// ledger's reading of its type (``NotificationLedger/revokes(_:)``): true cuts access, false
    /// restores it (REFUND_REVERSED), nil changes nothing.
    func notification(_ payload: NotificationPayload, transaction: Transaction?, applied: Bool, revokes: Bool?) {
        let outcome =
            switch (applied, revokes) {
            case (false, _): "duplicate"
            case (true, true?): "applied: access revoked"
            case (true, false?): "applied: access restored"
            case (true, nil): "recorded"
            }
        var metadata: Logger.Metadata = [
            "type": .string(Self.safe(payload.notificationType?.rawValue ?? "UNKNOWN")),
            "notificationUUID": .string(Self.safe(payload.notificationUUID ?? "")),
            "outcome": .string(outcome),
        ]
        if let subtype = payload.subtype { metadata["subtype"] = .string(Self.safe(subtype)) }
        if let transaction {
            for (key, value) in Self.describe(transaction, proof: nil) { metadata[key] = value }
        }
        logger.info("App Store notification", metadata: metadata)
    }

    func notificationRefused(code: String, reason: String) {
        logger.warning(
            "notification refused: it did not verify (if it came from Apple, which sends it again, check --bundle-id, --environment and the trust roots)",
            metadata: ["code": .string(Self.safe(code)), "reason": .string(Self.safe(reason))])
    }

    /// The ledger could not record a verified notification; it is not acknowledged.
    func notificationNotRecorded(reason: String) {
        logger.error("notification not recorded; Apple will send it again", metadata: ["reason": .string(Self.safe(reason))])
    }

    func catalogChanged(_ change: String, productId: String, contentVersion: String, _ extra: Logger.Metadata = [:]) {
        var metadata: Logger.Metadata = ["productId": .string(Self.safe(productId)), "contentVersion": .string(Self.safe(contentVersion))]
        metadata.merge(extra) { $1 }
        logger.notice("\(change)", metadata: metadata)
    }

    func adminRefused(_ reason: String, path: String) {
        logger.warning("admin request refused", metadata: ["reason": .string(reason), "path": .string(Self.safe(path))])
    }

    private static func describe(_ transaction: Transaction, proof: Proof?) -> Logger.Metadata {
        var metadata: Logger.Metadata = [:]
        if let proof { metadata["proof"] = .string(proof.rawValue) }
        if let id = transaction.transactionId { metadata["transactionId"] = .string(safe(id)) }
        if let id = transaction.originalTransactionId, id != transaction.transactionId { metadata["originalTransactionId"] = .string(safe(id)) }
        if let product = transaction.productId { metadata["productId"] = .string(safe(product)) }
        if let bundle = transaction.bundleId { metadata["bundleId"] = .string(safe(bundle)) }
        if let environment = transaction.environment { metadata["environment"] = .string(safe(environment.rawValue)) }
        return metadata
    }

    /// `text` with control characters escaped (`\n`, `\u{1B}`), cut to 300 characters.
    private static func safe(_ text: String) -> String {
        var out = ""
        for scalar in text.unicodeScalars.prefix(300) {
            if scalar.properties.generalCategory == .control || scalar == "\u{2028}" || scalar == "\u{2029}" {
                out += scalar.escaped(asASCII: true)
            } else {
                out.unicodeScalars.append(scalar)
            }
        }
        return text.unicodeScalars.count > 300 ? out + "…" : out
    }
}

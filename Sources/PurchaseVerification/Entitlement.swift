import Foundation

/// Whether a verified transaction entitles its holder to the product's content, and if not, why.
public enum EntitlementDecision: Sendable, Equatable {
    case granted
    case denied(DenialReason)

    public var isGranted: Bool { self == .granted }
}

/// Why a transaction grants nothing.
public enum DenialReason: Sendable, Equatable, CustomStringConvertible {
    case revoked(at: Date, reason: Int?)
    case wrongBundleId(String?)
    case wrongEnvironment(AppStoreEnvironment?)
    case expired(at: Date)

    public var code: String {
        switch self {
        case .revoked: "revoked"
        case .wrongBundleId: "wrong-bundle-id"
        case .wrongEnvironment: "wrong-environment"
        case .expired: "expired"
        }
    }

    public var description: String {
        switch self {
        case .revoked(let date, let reason):
            "the transaction was refunded or revoked on \(date)\(reason.map { " (reason \($0))" } ?? "")"
        case .wrongBundleId(let id): "the transaction is for bundle id '\(id ?? "none")'"
        case .wrongEnvironment(let env): "the transaction's environment '\(env?.rawValue ?? "none")' is not accepted"
        case .expired(let date): "the subscription expired on \(date)"
        }
    }
}

/// The one place that decides whether a transaction grants content: revoked → no; wrong bundle or
/// environment → no; an auto-renewable subscription past `expiresDate` → no; otherwise yes.
public func entitlement(for transaction: Transaction, configuration: VerifierConfiguration, now: Date = Date()) -> EntitlementDecision {
    if let revoked = transaction.revocationDate {
        return .denied(.revoked(at: revoked, reason: transaction.revocationReason))
    }
    guard let bundleId = transaction.bundleId, configuration.bundles.contains(bundleId) else {
        return .denied(.wrongBundleId(transaction.bundleId))
    }
    guard let environment = transaction.environment, configuration.environments.accepted.contains(environment) else {
        return .denied(.wrongEnvironment(transaction.environment))
    }
    if transaction.type == .autoRenewable, let expires = transaction.expiresDate, expires <= now {
        return .denied(.expired(at: expires))
    }
    return .granted
}

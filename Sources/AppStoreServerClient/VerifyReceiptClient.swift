import AppStoreServerAPI
import AsyncHTTPClient
import Foundation
import IAPProtocol
import NIOCore

/// Why `verifyReceipt` did not confirm a receipt.
public enum VerifyReceiptErrorCode: String, ErrorCode {
    /// No answer from the service.
    case unreachable
    /// 21000, 21002: the receipt (or the request) is malformed.
    case malformed
    /// 21003: the receipt could not be authenticated.
    case notAuthenticated = "not-authenticated"
    /// 21004: the shared secret is wrong (a server configuration problem).
    case wrongSharedSecret = "wrong-shared-secret"
    /// 21005, 21009, 21100-21199, HTTP 5xx: try again later.
    case unavailable
    /// 21007 when sandbox receipts are not accepted here; 21008.
    case wrongEnvironment = "wrong-environment"
    /// 21010: the App Store no longer knows the account.
    case accountNotFound = "account-not-found"
    /// An answer that is not Apple's JSON, or a status Apple does not document.
    case malformedResponse = "malformed-response"
}

public typealias VerifyReceiptError = CodedError<VerifyReceiptErrorCode>

/// Posts receipts to `verifyReceipt` as Apple asks servers to: production first, and the sandbox
/// when production answers 21007 (a sandbox receipt: App Review, TestFlight), so one server
/// serves both without knowing in advance. Every documented status is mapped to an error a
/// caller can act on.
public struct VerifyReceiptClient: Sendable {
    public let productionURL: String
    public let sandboxURL: String
    /// The app-specific shared secret, sent as `password`.
    public let sharedSecret: String?
    public let timeout: Duration
    let http: HTTPClient
    static let maximumResponse = 8 << 20

    public init(
        productionURL: String = VerifyReceiptStatus.productionURL, sandboxURL: String = VerifyReceiptStatus.sandboxURL, sharedSecret: String? = nil,
        timeout: Duration = .seconds(15), httpClient: HTTPClient = .shared
    ) {
        self.productionURL = productionURL
        self.sandboxURL = sandboxURL
        self.sharedSecret = sharedSecret
        self.timeout = timeout
        self.http = httpClient
    }

    /// Verifies a base64 receipt; returns Apple's decoded receipt (status 0, or 21006 whose
    /// receipt is valid but names an expired subscription: expiry is the entitlement's to judge).
    public func verify(_ receipt: String, allowSandbox: Bool) async throws(VerifyReceiptError) -> VerifyReceiptResponse {
        let production = try await post(receipt, to: productionURL)
        if production.status == VerifyReceiptStatus.sandboxReceipt {
            guard allowSandbox else {
                throw VerifyReceiptError(.wrongEnvironment, "the receipt is a sandbox receipt (21007) and this server accepts production only (--environment)")
            }
            return try Self.judge(try await post(receipt, to: sandboxURL))
        }
        return try Self.judge(production)
    }

    /// Maps a status to the answer or an error.
    public static func judge(_ response: VerifyReceiptResponse) throws(VerifyReceiptError) -> VerifyReceiptResponse {
        switch response.status {
        case VerifyReceiptStatus.valid, VerifyReceiptStatus.subscriptionExpired:
            guard response.receipt != nil else { throw VerifyReceiptError(.malformedResponse, "verifyReceipt answered \(response.status) without a receipt") }
            return response
        case VerifyReceiptStatus.badRequest, VerifyReceiptStatus.malformedReceipt:
            throw VerifyReceiptError(.malformed, "verifyReceipt could not read the receipt (\(response.status)): send the app receipt's bytes, base64")
        case VerifyReceiptStatus.notAuthenticated:
            throw VerifyReceiptError(.notAuthenticated, "verifyReceipt could not authenticate the receipt (21003)")
        case VerifyReceiptStatus.wrongSharedSecret:
            throw VerifyReceiptError(.wrongSharedSecret, "verifyReceipt refused the shared secret (21004): check --receipt-shared-secret-file against App Store Connect")
        case VerifyReceiptStatus.unavailable, VerifyReceiptStatus.internalError, VerifyReceiptStatus.internalRange:
            throw VerifyReceiptError(.unavailable, "verifyReceipt is temporarily unavailable (\(response.status)): try again")
        case VerifyReceiptStatus.sandboxReceipt:
            throw VerifyReceiptError(.wrongEnvironment, "the sandbox service says this is a sandbox receipt sent to production (21007): check the URLs")
        case VerifyReceiptStatus.productionReceipt:
            throw VerifyReceiptError(.wrongEnvironment, "a production receipt was sent to the sandbox service (21008): check --verify-receipt-url")
        case VerifyReceiptStatus.accountNotFound:
            throw VerifyReceiptError(.accountNotFound, "the App Store cannot find the receipt's account, or it was deleted (21010)")
        default:
            throw VerifyReceiptError(.malformedResponse, "verifyReceipt answered status \(response.status), which Apple does not document")
        }
    }

    private func post(_ receipt: String, to url: String) async throws(VerifyReceiptError) -> VerifyReceiptResponse {
        var request = HTTPClientRequest(url: url)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        let body: Data
        do { body = try JSONEncoder().encode(VerifyReceiptRequest(receiptData: receipt, password: sharedSecret, excludeOldTransactions: false)) } catch {
            throw VerifyReceiptError(.malformed, "cannot encode the request")
        }
        request.body = .bytes(ByteBuffer(bytes: body))
        let status: UInt, data: Data
        do {
            let response = try await http.execute(request, timeout: .init(timeout))
            status = response.status.code
            data = Data((try await response.body.collect(upTo: Self.maximumResponse)).readableBytesView)
        } catch {
            throw VerifyReceiptError(.unreachable, "cannot reach \(url): \(error); check --verify-receipt-url and the network")
        }
        guard (200..<300).contains(status) else {
            throw VerifyReceiptError(.unavailable, "\(url) answered HTTP \(status): try again")
        }
        do { return try JSONDecoder().decode(VerifyReceiptResponse.self, from: data) } catch {
            throw VerifyReceiptError(.malformedResponse, "\(url) answered with a body that is not verifyReceipt's JSON")
        }
    }
}

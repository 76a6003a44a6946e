import AsyncHTTPClient
import Foundation
import IAPProtocol
import NIOCore
import TransactionQueue

/// Asks the content server for download grants: `POST /v1/downloads` with the proof of purchase,
/// in the contract's types. One request per call; retries are the caller's (``RetryPolicy``).
struct GrantClient: Sendable {
    let server: String
    let client: HTTPClient
    let userAgent: String
    /// The longest `Retry-After` honoured.
    var maxRetryAfter: Duration = .seconds(60)

    /// The grants for `transaction`'s content. Throws a `FetchError`: `.network` for what is worth
    /// retrying (no answer, 5xx, a garbled answer), and `.revoked`, `.noContent`, `.refused` or
    /// `.tls` for what is not; ``RetryLater`` for a 503 or 429 that says when to ask again; or
    /// ``Unreachable`` when no connection could be made.
    func request(_ transaction: QueuedTransaction) async throws -> DownloadGrants {
        var request = HTTPClientRequest(url: server + Route.downloads)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        request.headers.add(name: "User-Agent", value: userAgent)
        let proof: DownloadRequest
        if let receiptPath = transaction.receiptPath {
            // StoreKit 1: the device's app receipt, read fresh each time (StoreKit rewrites it).
            guard let receipt = FileManager.default.contents(atPath: receiptPath), !receipt.isEmpty else {
                throw FetchError(
                    .refused, "cannot read the app receipt \(receiptPath) for transaction \(transaction.transactionId): refresh it (SKReceiptRefreshRequest)")
            }
            proof = DownloadRequest(receipt: receipt.base64EncodedString(), transactionId: transaction.transactionId)
        } else {
            proof = DownloadRequest(signedTransaction: transaction.signedTransaction)
        }
        let body: Data
        do { body = try WireJSON.encoder().encode(proof) } catch {
            throw FetchError(.refused, "cannot encode the request for transaction \(transaction.transactionId): \(error)")
        }
        request.body = .bytes(ByteBuffer(bytes: body))
        let status: UInt, data: ByteBuffer, retryAfter: String?, redirected: String?
        do {
            let response = try await client.execute(request, timeout: .seconds(60))
            status = response.status.code
            retryAfter = response.headers.first(name: "retry-after")
            redirected = response.history.count > 1 ? (response.url?.absoluteString ?? "") : nil
            data = try await response.body.collect(upTo: 1 << 20)
        } catch {
            throw connectionFailure(error, url: server) ?? FetchError(.network, "cannot reach \(server): \(Self.describe(error))")
        }
        // A site that moved to HTTPS answers POST with 301 or 302, which AsyncHTTPClient follows
        // as a GET (without the proof): its 405 said only that GET is wrong. Said as what it is,
        // and not tried again: every try is redirected the same way. (A 307 or 308 is followed
        // with the proof, and a grant got that way is taken.)
        if let redirected, status != 200 { throw Self.redirect(to: redirected, server: server) }
        if (300..<400).contains(status) {
            throw FetchError(.refused, "\(server)\(Route.downloads) answered \(status), a redirect without a usable Location: check --server")
        }
        guard status != 200 else {
            guard let grants = try? WireJSON.decoder().decode(DownloadGrants.self, from: Data(data.readableBytesView)) else {
                throw FetchError(.network, "the server's grant is not valid JSON")
            }
            return grants
        }
        if let later = RetryLater.from(status: status, retryAfter: retryAfter, cap: maxRetryAfter, what: "the grant of transaction \(transaction.transactionId)") {
            throw later
        }
        throw Self.failure(status: status, body: data.readableBytesView, transaction: transaction)
    }

    /// The error for a grant request that was redirected to `url`: the server to use instead is
    /// `url` less the route, when it ends with it.
    static func redirect(to url: String, server: String) -> FetchError {
        let base = url.hasSuffix(Route.downloads) ? String(url.dropLast(Route.downloads.count)) : nil
        return FetchError(
            .refused,
            "\(server)\(Route.downloads) redirects to \(url): "
                + (base.map { "use --server \($0)" } ?? "use the content server's own address as --server"))
    }

    /// A connection error in words a user can act on. NIO's read "connection reset (error set):
    /// Connection refused) (errno: 111)" for a server that is not running.
    static func describe(_ error: any Error) -> String {
        if let io = error as? IOError {
            let reason = String(cString: strerror(io.errnoCode)).lowercased()
            switch io.errnoCode {
            case ECONNREFUSED: return "\(reason): is the server running, and listening at that address and port?"
            case EHOSTUNREACH, ENETUNREACH: return "\(reason): check the network and the server's address"
            default: return reason
            }
        }
        if let client = error as? HTTPClientError {
            switch client {
            case .connectTimeout: return "no connection within the timeout: check the server's address and the network"
            case .deadlineExceeded: return "no answer within 60 s; it is retried"
            case .readTimeout: return "the server stopped sending; it is retried"
            case .remoteConnectionClosed: return "the server closed the connection before answering; it is retried"
            default: return "\(client)"
            }
        }
        let text = "\(error)"
        // NIO's resolver error arrives wrapped (its connection error's DNS results).
        if error is SocketAddressError || error is SocketAddressError.UnknownHost || text.contains("UnknownHost") {
            return "the host name does not resolve: check the --server URL and the network's DNS"
        }
        return text
    }

    /// What an error answer means for the download.
    static func failure(status: UInt, body: some Collection<UInt8>, transaction: QueuedTransaction) -> FetchError {
        let envelope = ErrorEnvelope.read(body)
        let message = envelope.error.message
        switch status {
        case 403 where envelope.code() == .revoked:
            // The server's own words name the transaction and why, when it sent any.
            return FetchError(
                .revoked,
                message.contains(transaction.transactionId) ? message : "transaction \(transaction.transactionId) was refunded or revoked: \(message)")
        case 404 where envelope.code() == .notInReceipt:
            return FetchError(.refused, "the app receipt does not hold transaction \(transaction.transactionId) yet: refresh it (SKReceiptRefreshRequest): \(message)")
        case 404 where envelope.code() == .noContent:
            return FetchError(.noContent, message.isEmpty ? "no hosted content is published for product \(transaction.productId)" : message)
        case 404:
            // Not the content server's answer (a proxy's, or another server's at that address):
            // taking it for "no content" would leave purchases undelivered without a failure.
            return FetchError(
                .refused,
                "the server answered 404 (\(envelope.error.code.isEmpty ? "no error envelope" : envelope.error.code)) to \(Route.downloads): check that --server is the content server's address: \(message)"
            )
        case 400, 401, 403:
            return FetchError(.refused, "the server refused the purchase (\(status) \(envelope.error.code)): \(message)")
        default:
            return FetchError(.network, "the server answered \(status): \(message)")
        }
    }
}

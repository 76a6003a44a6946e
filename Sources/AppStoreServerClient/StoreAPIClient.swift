import AppStoreServerAPI
import AsyncHTTPClient
import CertificateTrust
import Foundation
import IAPProtocol
import NIOCore
import NIOHTTP1

/// What went wrong calling the App Store Server API.
public enum StoreAPIClientErrorCode: String, ErrorCode {
    /// No answer: the URL is wrong or the service is down.
    case unreachable
    /// The API's TLS certificate was refused: a proxy or private authority signs it, or it is
    /// for another name.
    case tls
    /// 401: the key id, issuer id, bundle id or key file is wrong.
    case unauthorized
    /// 4xx with Apple's error code: the request itself is wrong.
    case refused
    /// 404 for a transaction id.
    case notFound = "not-found"
    /// 429 or 5xx after retries.
    case unavailable
    /// The answer is not the JSON Apple documents.
    case malformedResponse = "malformed-response"
}

/// An error from the App Store Server API client, naming the problem and the fix.
public typealias StoreAPIClientError = CodedError<StoreAPIClientErrorCode>

/// A client for the App Store Server API endpoints a content server reconciles with: Get
/// Transaction Info, Get Transaction History (v2) and Get Notification History. It signs a
/// fresh bearer token per request, retries 429 and 5xx a few times, and never reads an answer
/// larger than `maximumResponse`.
public struct StoreAPIClient: Sendable {
    public let baseURL: String
    public let key: StoreAPIKey
    /// How long one request may take, connecting included (AsyncHTTPClient keeps retrying a
    /// refused connection until then, so an unreachable API fails after this long, once).
    public let timeout: Duration
    let http: HTTPClient
    /// Apple's pages are at most 20 signed items (~100 KiB); 8 MiB leaves room and bounds memory.
    public static let maximumResponse = 8 << 20
    static let retryDelays: [Duration] = [.milliseconds(250), .seconds(1), .seconds(3)]

    /// `baseURL` is Apple's (``StoreAPIRoute/productionURL``, ``StoreAPIRoute/sandboxURL``) or a
    /// sandbox's, such as `http://127.0.0.1:9090`.
    public init(baseURL: String, key: StoreAPIKey, timeout: Duration = .seconds(30), httpClient: HTTPClient = .shared) {
        self.baseURL = baseURL.hasSuffix("/") ? String(baseURL.dropLast()) : baseURL
        self.key = key
        self.timeout = timeout
        self.http = httpClient
    }

    /// Get Transaction Info.
    public func transactionInfo(_ transactionId: String) async throws(StoreAPIClientError) -> TransactionInfoResponse {
        try await send(.GET, StoreAPIRoute.transactionInfoPrefix + escaped(transactionId), body: nil, as: TransactionInfoResponse.self)
    }

    /// Get Transaction History (v2), one page; pass the previous page's `revision` for the next.
    public func transactionHistory(_ transactionId: String, revision: String? = nil) async throws(StoreAPIClientError) -> HistoryResponse {
        var path = StoreAPIRoute.historyPrefix + escaped(transactionId)
        if let revision { path += "?revision=" + escaped(revision) }
        return try await send(.GET, path, body: nil, as: HistoryResponse.self)
    }

    /// Get Notification History, one page.
    public func notificationHistory(_ request: NotificationHistoryRequest, paginationToken: String? = nil) async throws(StoreAPIClientError)
        -> NotificationHistoryResponse
    {
        var path = StoreAPIRoute.notificationHistory
        if let paginationToken { path += "?paginationToken=" + escaped(paginationToken) }
        let body: Data
        do { body = try JSONEncoder().encode(request) } catch { throw StoreAPIClientError(.malformedResponse, "cannot encode the request: \(error)") }
        return try await send(.POST, path, body: body, as: NotificationHistoryResponse.self)
    }

    /// Every notification the request matches, following pages; stops at `maximumPages` so a
    /// service that always says `hasMore` cannot keep the caller forever.
    public func allNotifications(_ request: NotificationHistoryRequest, maximumPages: Int = 10_000) async throws(StoreAPIClientError) -> [NotificationHistoryItem] {
        var items: [NotificationHistoryItem] = []
        var token: String?
        for _ in 0..<maximumPages {
            let page = try await notificationHistory(request, paginationToken: token)
            items += page.notificationHistory
            guard page.hasMore, let next = page.paginationToken, next != token else { return items }
            token = next
        }
        throw StoreAPIClientError(.malformedResponse, "\(baseURL) still had more notifications after \(maximumPages) pages: narrow --since")
    }

    private func escaped(_ value: String) -> String {
        value.addingPercentEncoding(withAllowedCharacters: .alphanumerics.union(CharacterSet(charactersIn: "-._~"))) ?? value
    }

    private func send<T: Decodable>(_ method: HTTPMethod, _ path: String, body: Data?, as type: T.Type) async throws(StoreAPIClientError) -> T {
        var attempt = 0
        while true {
            let outcome = await once(method, path, body: body)
            switch outcome {
            case .success(let (status, data)):
                if (200..<300).contains(status) {
                    do { return try JSONDecoder().decode(T.self, from: data) } catch {
                        let why = (error as? DecodingError)?.plainDescription ?? "\(error)"
                        throw StoreAPIClientError(.malformedResponse, "\(baseURL)\(path) answered \(status) with a body that is not a \(T.self): \(why)")
                    }
                }
                let apple = try? JSONDecoder().decode(StoreAPIError.self, from: data)
                let detail = apple.map { " (errorCode \($0.errorCode): \($0.errorMessage))" } ?? ""
                switch status {
                case 401:
                    throw StoreAPIClientError(.unauthorized, "\(baseURL) refused the API key (401): check --key-id, --issuer-id, --bundle-id and the .p8 file")
                case 404:
                    throw StoreAPIClientError(.notFound, "\(baseURL)\(path) was not found (404)\(detail)")
                case 429, 500...599:
                    guard attempt < Self.retryDelays.count else {
                        throw StoreAPIClientError(.unavailable, "\(baseURL) answered \(status)\(detail) \(attempt + 1) times: try again later")
                    }
                default:
                    throw StoreAPIClientError(.refused, "\(baseURL)\(path) refused the request (\(status))\(detail)")
                }
            case .failure(let error):
                // Connection failures were already retried until the deadline.
                throw error
            }
            do { try await Task.sleep(for: Self.retryDelays[attempt]) } catch { throw StoreAPIClientError(.unreachable, "cancelled") }
            attempt += 1
        }
    }

    /// A request that got no answer, said with what to change: a refused certificate names
    /// `--ca-file` (a TLS-inspecting proxy or a private authority signs it) or the URL's name.
    static func failure(_ error: any Error, baseURL: String) -> StoreAPIClientError {
        let server = URL(string: baseURL).flatMap { url in url.host.map { URLHost.inURL($0) + ":\(url.port ?? 443)" } } ?? baseURL
        switch CertificateRefusal(error) {
        case .untrusted:
            return StoreAPIClientError(
                .tls,
                "the TLS certificate of \(baseURL) is not trusted: when a proxy that inspects TLS or a private certificate authority signs it, pass that authority's certificate (PEM) with --ca-file (IAP_CA_FILES); `openssl s_client -connect \(server) -showcerts` shows who signed it"
            )
        case .otherName:
            return StoreAPIClientError(.tls, "the TLS certificate of \(baseURL) is for another name: give --api-url with a name the certificate holds")
        case nil:
            return StoreAPIClientError(.unreachable, "cannot reach \(baseURL): \(error); check the URL and the network")
        }
    }

    private func once(_ method: HTTPMethod, _ path: String, body: Data?) async -> Result<(Int, Data), StoreAPIClientError> {
        var request = HTTPClientRequest(url: baseURL + path)
        request.method = method
        request.headers.add(name: "Authorization", value: "Bearer " + key.bearerToken())
        request.headers.add(name: "Accept", value: "application/json")
        request.headers.add(name: "User-Agent", value: "iap-content")
        if let body {
            request.headers.add(name: "Content-Type", value: "application/json")
            request.body = .bytes(ByteBuffer(bytes: body))
        }
        do {
            let response = try await http.execute(request, timeout: .init(timeout))
            let buffer = try await response.body.collect(upTo: Self.maximumResponse)
            return .success((Int(response.status.code), Data(buffer.readableBytesView)))
        } catch let error as NIOTooManyBytesError {
            _ = error
            return .failure(StoreAPIClientError(.malformedResponse, "\(baseURL)\(path) answered with more than \(Self.maximumResponse) bytes"))
        } catch {
            return .failure(Self.failure(error, baseURL: baseURL))
        }
    }
}

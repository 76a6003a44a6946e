import AppStoreServerAPI
import Foundation
import HTTPTypes
import Hummingbird
import Logging
import NIOCore
import PurchaseVerification
import SandboxStore
import ServerStartup
import Synchronization

/// Serves ``SandboxStoreAPI`` over HTTP at Apple's paths, so a backend (or Apple's own
/// `AppStoreServerAPIClient`) pointed at it works unchanged. Every `/inApps` request needs a
/// bearer token signed with one of the store's API keys; refusals are 401 with no body, as
/// Apple's are. `POST /verifyReceipt` is the legacy receipt endpoint.
public enum SandboxAPIServer {
    /// Largest request body (a notification-history filter is a few hundred bytes).
    static let maximumBody = 64 * 1024
    /// A receipt of ~10,000 purchases in base64 and JSON.
    static let maximumReceiptBody = 8 << 20

    /// Runs until SIGTERM or SIGINT; a port it cannot listen on is a ``ServerStartError``.
    public static func run(
        api: SandboxStoreAPI, host: String, port: Int, logger: Logger,
        onListening: @escaping @Sendable (Int) async -> Void = { _ in }
    ) async throws {
        let router = Router(context: BasicRequestContext.self)
        // verifyReceipt authenticates by the receipt itself (and a shared secret), not a bearer token.
        router.post("/verifyReceipt") { request, _ in
            let body: Data
            do { body = Data((try await request.body.collect(upTo: maximumReceiptBody)).readableBytesView) } catch {
                return json(.ok, VerifyReceiptResponse(status: VerifyReceiptStatus.malformedReceipt))
            }
            return json(.ok, api.verifyReceipt(body))
        }
        let inApps = router.group("inApps").add(middleware: BearerTokenMiddleware(store: api.store, logger: logger))
        inApps.get("v1/transactions/:transactionId") { _, context in
            respond(api.transactionInfo(try context.parameters.require("transactionId")))
        }
        inApps.get("v2/history/:transactionId") { request, context in
            let parameters = request.uri.queryParameters
            var query = SandboxStoreAPI.HistoryQuery()
            query.revision = parameters["revision"].map(String.init)
            query.startDate = parameters["startDate"].map(String.init)
            query.endDate = parameters["endDate"].map(String.init)
            query.productIds = parameters.getAll("productId").map { String($0) }
            query.productTypes = parameters.getAll("productType").map { String($0) }
            query.sort = parameters["sort"].map(String.init)
            query.revoked = parameters["revoked"].map(String.init)
            query.inAppOwnershipType = parameters["inAppOwnershipType"].map(String.init)
            return respond(api.history(try context.parameters.require("transactionId"), query))
        }
        inApps.post("v1/notifications/history") { request, _ in
            let body: NotificationHistoryRequest
            do {
                let buffer = try await request.body.collect(upTo: maximumBody)
                body = try JSONDecoder().decode(NotificationHistoryRequest.self, from: Data(buffer.readableBytesView))
            } catch {
                return respond(
                    .error(status: 400, StoreAPIError(StoreAPIError.generalBadRequest, "the body must be JSON like {\"startDate\": 1700000000000, \"endDate\": 1700086400000}")))
            }
            return respond(api.notificationHistory(body, paginationToken: request.uri.queryParameters["paginationToken"].map(String.init)))
        }
        let listening = Mutex(false)
        let app = Application(
            router: router,
            configuration: .init(address: .hostname(host, port: port), serverName: "iap-sandbox"),
            onServerRunning: { channel in
                listening.withLock { $0 = true }
                await onListening(channel.localAddress?.port ?? port)
            },
            logger: logger)
        do {
            try await app.runService()
        } catch {
            throw ServerStartError.reported(error, listening: listening.withLock { $0 }, host: host, port: port)
        }
    }

    static func respond(_ answer: SandboxStoreAPI.Answer) -> Response {
        switch answer {
        case .ok(let value): json(.ok, value)
        case .error(let status, let error): json(HTTPResponse.Status(code: status), error)
        }
    }

    static func json(_ status: HTTPResponse.Status, _ value: any Encodable) -> Response {
        var headers = HTTPFields()
        // Exactly this: Apple's Python client reads error bodies only under `application/json`.
        headers[.contentType] = "application/json"
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        let data = (try? encoder.encode(value)) ?? Data("{}".utf8)
        return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }
}

/// Refuses requests without a valid App Store Server API bearer token. Keys are read from the
/// store on each request, so a key made with `iap-sandbox api-key` works without a restart.
struct BearerTokenMiddleware: RouterMiddleware {
    typealias Context = BasicRequestContext
    let store: SandboxStore
    let logger: Logger

    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        do {
            let verifier: StoreAPIToken
            do { verifier = try store.tokenVerifier() } catch {
                return SandboxAPIServer.json(.internalServerError, StoreAPIError(StoreAPIError.generalInternal, error.message))
            }
            try verifier.verify(authorization: request.headers[.authorization])
        } catch {
            logger.info("401 \(request.method) \(request.uri.path): \(error.message)")
            // Apple documents no body here; RFC 9110 §15.5.2 asks every 401 for a challenge.
            return Response(status: .unauthorized, headers: [.wwwAuthenticate: "Bearer realm=\"App Store Server API\""])
        }
        return try await next(request, context)
    }
}

import Base64URL
import ContentArchive
import ContentCatalog
import DownloadGrants
import Foundation
import HTTPTypes
import Hummingbird
import IAPProtocol
import NIOCore
import NIOPosix
import PurchaseVerification
import SystemPackage

/// The JSON API. Errors are `{"error": {"code": "...", "message": "..."}}` everywhere.
struct APIRoutes: Sendable {
    let service: ContentService

    func register(on router: Router<BasicRequestContext>) {
        router.get(RouterPath(Route.health)) { _, _ in json(.ok, HealthStatus()) }
        router.get(RouterPath(Route.metrics)) { _, _ in
            var headers = HTTPFields()
            headers[.contentType] = "text/plain; version=0.0.4"
            return Response(status: .ok, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: service.metrics.registry.emitToBuffer())))
        }
        router.get(RouterPath(Route.productPattern)) { _, context in try product(context.parameters.require("productId")) }
        router.post(RouterPath(Route.downloads)) { request, _ in await downloads(request) }
        router.post(RouterPath(Route.notifications)) { request, _ in await notification(request) }
        router.put(RouterPath(Route.adminArchives)) { request, _ in await upload(request) }
    }

    // MARK: Products

    func product(_ id: String) -> Response {
        do {
            let versions = try service.store.versions(productId: id)
            guard !versions.isEmpty else {
                return apiError(.notFound, APIError(.noContent, "no content is published for product \(id)"))
            }
            return json(
                .ok,
                ProductInfo(
                    productId: id,
                    versions: versions.map {
                        ProductInfo.Version(
                            contentVersion: $0.contentVersion, contentLength: $0.size, extractedLength: $0.contentLength,
                            sha256: $0.sha256, publishedAt: $0.publishedAt)
                    }))
        } catch {
            return apiError(.serviceUnavailable, error.apiError)
        }
    }

    // MARK: Grants

    func downloads(_ request: Request) async -> Response {
        let body: DownloadRequest
        switch await decodeBody(request, as: DownloadRequest.self, example: DownloadRequest.example) {
        case .failure(let response): return response
        case .success(let value): body = value
        }
        let started = ContinuousClock.now
        let transaction: Transaction
        do {
            transaction = try await service.verifier.verifyTransaction(body.signedTransaction)
            service.metrics.verificationDuration.record(ContinuousClock.now - started)
        } catch {
            service.metrics.grant(error.code.rawValue)
            return apiError(status(for: error.code), error.apiError)
        }
        let transactionId = transaction.transactionId ?? ""
        if case .denied(let reason) = entitlement(for: transaction, configuration: service.verifier.configuration) {
            service.metrics.grant(reason.code)
            return apiError(.forbidden, APIError(APIErrorCode(rawValue: reason.code), "no download: \(reason)"))
        }
        // The ledger, not only the in-memory set: a revocation written by `iap-server reconcile`
        // or another replica refuses new grants at once, not at the next refresh.
        for id in [transaction.transactionId, transaction.originalTransactionId].compactMap({ $0 })
        where service.isRevoked(id) || (try? service.store.isRevoked(transactionId: id)) == true {
            service.metrics.grant("revoked")
            return apiError(.forbidden, APIError(.revoked, "no download: transaction \(id) was refunded or revoked"))
        }
        guard let productId = transaction.productId else {
            return apiError(.badRequest, APIError(.malformed, "the transaction has no productId"))
        }
        do {
            let versions = try service.store.versions(productId: productId)
            let chosen: PublishedVersion?
            if let pinned = body.contentVersion {
                chosen = versions.first { $0.contentVersion == pinned }
            } else {
                chosen = versions.first
            }
            guard let version = chosen else {
                service.metrics.grant("no-content")
                let what = body.contentVersion.map { "version \($0) of \(productId)" } ?? "product \(productId)"
                return apiError(.notFound, APIError(.noContent, "no hosted content is published for \(what)"))
            }
            try service.store.recordGrant(
                transactionId: transactionId, originalTransactionId: transaction.originalTransactionId,
                productId: productId, environment: transaction.environment?.rawValue)
            let expires = Date().addingTimeInterval(TimeInterval(service.configuration.tokenTTL.components.seconds))
            let token = service.grants.mint(
                Grant(
                    transactionId: transactionId, productId: productId, contentVersion: version.contentVersion,
                    sha256: version.sha256, expiresAt: Int64(expires.timeIntervalSince1970)))
            let base = service.configuration.publicURL ?? "http://\(service.configuration.host):\(service.boundPort.withLock { $0 })"
            let url = base + Route.content(token: token, productId: productId, contentVersion: version.contentVersion)
            service.metrics.grant("granted")
            return json(
                .ok,
                DownloadGrants(
                    transactionId: transactionId,
                    downloads: [
                        GrantedDownload(
                            productId: productId, contentVersion: version.contentVersion, contentLength: version.size,
                            sha256: version.sha256, url: url, expiresAt: expires)
                    ]))
        } catch {
            return apiError(.serviceUnavailable, error.apiError)
        }
    }

    func status(for code: VerificationErrorCode) -> HTTPResponse.Status {
        switch code {
        case .malformed, .tooLarge: .badRequest
        case .unsupportedAlgorithm, .unsupportedCriticalHeader, .invalidCertificateList, .untrustedChain, .missingMarkerOID, .invalidSignature:
            .unauthorized
        case .wrongBundleId, .wrongEnvironment: .forbidden
        }
    }

    // MARK: Notifications

    func notification(_ request: Request) async -> Response {
        let body: NotificationRequest
        switch await decodeBody(request, as: NotificationRequest.self, example: NotificationRequest.example) {
        case .failure(let response): return response
        case .success(let value): body = value
        }
        let notification: NotificationPayload, transaction: Transaction?
        do {
            (notification, transaction) = try await service.verifier.verifyNotification(body.signedPayload)
        } catch {
            service.metrics.notification("unverified", error.code.rawValue)
            return apiError(status(for: error.code), error.apiError)
        }
        let type = notification.notificationType ?? NotificationType(rawValue: "UNKNOWN")
        let revoke = NotificationLedger.revokes(type)
        do {
            let outcome = try NotificationLedger(store: service.store).record(notification, transaction: transaction, signedPayload: body.signedPayload)
            // The ledger is durable now; the in-memory set makes the content path refuse at once.
            if outcome == .applied, let id = transaction?.transactionId, let revoke { service.markRevoked(id, revoke) }
            service.metrics.notification(type.rawValue, outcome == .applied ? "applied" : "duplicate")
            return json(
                .ok,
                NotificationReceipt(
                    status: outcome == .applied ? .applied : .duplicate,
                    notificationUUID: notification.notificationUUID ?? ""))
        } catch {
            // Not acknowledged, so Apple retries.
            return apiError(.serviceUnavailable, error.apiError)
        }
    }

    // MARK: Admin

    func upload(_ request: Request) async -> Response {
        guard let expected = service.configuration.adminToken else {
            return apiError(.forbidden, APIError(.adminDisabled, "the admin API is off: start the server with --admin-token-file"))
        }
        let presented = request.headers[.authorization].flatMap { $0.hasPrefix("Bearer ") ? String($0.dropFirst(7)) : nil } ?? ""
        guard constantTimeEqual(presented, expected) else {
            return apiError(.unauthorized, APIError(.unauthorized, "send the admin token as Authorization: Bearer <token>"))
        }
        var manifest: ArchiveManifest?
        if let header = request.headers[HTTPField.Name("IAP-Manifest")!] {
            guard let bytes = Base64URL.decode(header.utf8), let decoded = try? ArchiveManifest.decode(Data(bytes), source: "the IAP-Manifest header") else {
                return apiError(.badRequest, APIError(.invalidManifest, "the IAP-Manifest header must be the manifest JSON in base64url"))
            }
            manifest = decoded
        }
        let path = service.store.temporaryUploadPath()
        let folder = service.configuration.dataDirectory
        do throws(UploadError) {
            let fd: SystemPackage.FileDescriptor
            do {
                fd = try SystemPackage.FileDescriptor.open(path, .writeOnly, options: [.create, .exclusiveCreate], permissions: [.ownerReadWrite])
            } catch {
                throw UploadError(
                    .serviceUnavailable, .storage,
                    "cannot create an upload file in \(folder)/tmp: \(error); check that the data folder is writable")
            }
            defer { try? fd.close() }
            let length = request.headers[.contentLength].flatMap(UInt64.init)
            if let part = try await UploadReceiver.receive(
                request.body, contentType: request.headers[.contentType], length: length,
                into: fd, folder: folder)
            {
                guard manifest == nil else {
                    throw UploadError(.badRequest, .invalidManifest, "send the manifest once: in the IAP-Manifest header or in the 'manifest' part, not both")
                }
                do throws(ArchiveError) {
                    manifest = try ArchiveManifest.decode(Data(part), source: "the manifest part")
                } catch {
                    throw UploadError(.badRequest, .invalidManifest, error.message)
                }
            }
        } catch {
            unlink(path)
            return apiError(error.status, error.error)
        }
        let store = service.store
        let chosenManifest = manifest
        let result: Result<PublishOutcome, CatalogError>
        do {
            // Publishing reads the whole archive: keep it off the async executor's threads.
            result = try await NIOThreadPool.singleton.runIfActive {
                do throws(CatalogError) { return .success(try store.publish(archiveAt: path, manifest: chosenManifest, moveFile: true)) } catch { return .failure(error) }
            }
        } catch {
            unlink(path)
            return apiError(.serviceUnavailable, APIError(.storage, "the server is shutting down: try again"))
        }
        switch result {
        case .success(.published(let version)):
            return json(.created, PublishReceipt(status: .published, productId: version.productId, contentVersion: version.contentVersion, sha256: version.sha256))
        case .success(.unchanged(let version)):
            unlink(path)
            return json(.ok, PublishReceipt(status: .unchanged, productId: version.productId, contentVersion: version.contentVersion, sha256: version.sha256))
        case .failure(let error):
            unlink(path)
            let status: HTTPResponse.Status =
                switch error.code {
                case .conflict: .conflict
                case .invalidArchive: .badRequest
                case .notFound: .notFound
                case .storage: .serviceUnavailable
                }
            return apiError(status, error.apiError)
        }
    }

    // MARK: Helpers

    enum Decoded<T> {
        case success(T)
        case failure(Response)
    }

    private func decodeBody<T: Decodable>(_ request: Request, as type: T.Type, example: String) async -> Decoded<T> {
        let buffer: ByteBuffer
        do {
            buffer = try await request.body.collect(upTo: service.configuration.maxJSONBody)
        } catch {
            return .failure(apiError(.contentTooLarge, APIError(.tooLarge, "the request body is over \(service.configuration.maxJSONBody) bytes")))
        }
        guard let value = try? WireJSON.decoder().decode(T.self, from: Data(buffer.readableBytesView)) else {
            return .failure(apiError(.badRequest, APIError(.malformed, "the request body must be JSON like \(example)")))
        }
        return .success(value)
    }
}

func json<T: Encodable>(_ status: HTTPResponse.Status, _ value: T) -> Response {
    var headers = HTTPFields()
    headers[.contentType] = "application/json"
    headers[.cacheControl] = "no-store"
    return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: WireJSON.line(value))))
}

/// An error answer: the envelope of ``APIError``.
func apiError(_ status: HTTPResponse.Status, _ error: APIError) -> Response {
    json(status, error.envelope)
}

func constantTimeEqual(_ a: String, _ b: String) -> Bool {
    let x = Array(a.utf8), y = Array(b.utf8)
    var difference = UInt8(x.count == y.count ? 0 : 1)
    for i in 0..<max(x.count, y.count) {
        difference |= (i < x.count ? x[i] : 0) ^ (i < y.count ? y[i] : 0)
    }
    return difference == 0
}

/// Renders framework errors (unknown routes, bad methods) in the API's error format.
struct ErrorFormatMiddleware: RouterMiddleware {
    typealias Context = BasicRequestContext
    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        do {
            return try await next(request, context)
        } catch let error as HTTPError {
            let code: APIErrorCode = error.status == .notFound ? .notFound : APIErrorCode(rawValue: "http-\(error.status.code)")
            return apiError(error.status, APIError(code, error.body ?? error.status.reasonPhrase))
        }
    }
}

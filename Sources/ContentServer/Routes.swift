import Base64URL
import ContentArchive
import ContentCatalog
import DownloadGrants
import Foundation
import HTTPTypes
import Hummingbird
import NIOCore
import NIOPosix
import PurchaseVerification
import SystemPackage

/// The JSON API. Errors are `{"error": {"code": "...", "message": "..."}}` everywhere.
struct APIRoutes: Sendable {
    let service: ContentService

    func register(on router: Router<BasicRequestContext>) {
        router.get("/healthz") { _, _ in json(.ok, ["status": "ok"]) }
        router.get("/metrics") { _, _ in
            var headers = HTTPFields()
            headers[.contentType] = "text/plain; version=0.0.4"
            return Response(status: .ok, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: service.metrics.registry.emitToBuffer())))
        }
        router.get("/v1/products/{productId}") { _, context in try product(context.parameters.require("productId")) }
        router.post("/v1/downloads") { request, _ in await downloads(request) }
        router.post("/v1/notifications") { request, _ in await notification(request) }
        router.put("/v1/admin/archives") { request, _ in await upload(request) }
    }

    // MARK: Products

    struct VersionInfo: Encodable {
        let contentVersion: String
        let contentLength: Int64
        let extractedLength: Int64
        let sha256: String
        let publishedAt: Date
    }

    struct ProductInfo: Encodable {
        let productId: String
        let contentVersion: String
        let contentLength: Int64
        let sha256: String
        let versions: [VersionInfo]
    }

    func product(_ id: String) -> Response {
        do {
            let versions = try service.store.versions(productId: id)
            guard let latest = versions.first else {
                return apiError(.notFound, "no-content", "no content is published for product \(id)")
            }
            return json(.ok, ProductInfo(productId: id, contentVersion: latest.contentVersion, contentLength: latest.size, sha256: latest.sha256,
                                         versions: versions.map { VersionInfo(contentVersion: $0.contentVersion, contentLength: $0.size,
                                                                              extractedLength: $0.contentLength, sha256: $0.sha256, publishedAt: $0.publishedAt) }))
        } catch {
            return apiError(.serviceUnavailable, error.code.rawValue, error.message)
        }
    }

    // MARK: Grants

    struct DownloadRequest: Decodable {
        let signedTransaction: String
        let contentVersion: String?
    }

    struct Download: Encodable {
        let productId: String
        let contentVersion: String
        let contentLength: Int64
        let sha256: String
        let url: String
        let expiresAt: Date
    }

    struct DownloadResponse: Encodable {
        let transactionId: String
        let downloads: [Download]
    }

    func downloads(_ request: Request) async -> Response {
        let body: DownloadRequest
        switch await decodeBody(request, as: DownloadRequest.self, example: #"{"signedTransaction": "<JWS>"}"#) {
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
            return apiError(status(for: error.code), error.code.rawValue, error.message)
        }
        let transactionId = transaction.transactionId ?? ""
        if case .denied(let reason) = entitlement(for: transaction, configuration: service.verifier.configuration) {
            service.metrics.grant(reason.code)
            return apiError(.forbidden, reason.code, "no download: \(reason)")
        }
        for id in [transaction.transactionId, transaction.originalTransactionId].compactMap({ $0 }) where service.isRevoked(id) {
            service.metrics.grant("revoked")
            return apiError(.forbidden, "revoked", "no download: transaction \(id) was refunded or revoked")
        }
        guard let productId = transaction.productId else {
            return apiError(.badRequest, "malformed", "the transaction has no productId")
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
                return apiError(.notFound, "no-content", "no hosted content is published for \(what)")
            }
            try service.store.recordGrant(transactionId: transactionId, originalTransactionId: transaction.originalTransactionId,
                                          productId: productId, environment: transaction.environment?.rawValue)
            let expires = Date().addingTimeInterval(TimeInterval(service.configuration.tokenTTL.components.seconds))
            let token = service.grants.mint(Grant(transactionId: transactionId, productId: productId, contentVersion: version.contentVersion,
                                                  sha256: version.sha256, expiresAt: Int64(expires.timeIntervalSince1970)))
            let base = service.configuration.publicURL ?? "http://\(service.configuration.host):\(service.boundPort.withLock { $0 })"
            let url = "\(base)/v1/content/\(token)/\(productId)-\(version.contentVersion).zip"
            service.metrics.grant("granted")
            return json(.ok, DownloadResponse(transactionId: transactionId, downloads: [
                Download(productId: productId, contentVersion: version.contentVersion, contentLength: version.size,
                         sha256: version.sha256, url: url, expiresAt: expires),
            ]))
        } catch {
            return apiError(.serviceUnavailable, error.code.rawValue, error.message)
        }
    }

    func status(for code: VerificationError.Code) -> HTTPResponse.Status {
        switch code {
        case .malformed, .tooLarge: .badRequest
        case .unsupportedAlgorithm, .invalidCertificateList, .untrustedChain, .missingMarkerOID, .invalidSignature: .unauthorized
        case .wrongBundleId, .wrongEnvironment: .forbidden
        }
    }

    // MARK: Notifications

    struct NotificationBody: Decodable {
        let signedPayload: String
    }

    func notification(_ request: Request) async -> Response {
        let body: NotificationBody
        switch await decodeBody(request, as: NotificationBody.self, example: #"{"signedPayload": "<JWS>"}"#) {
        case .failure(let response): return response
        case .success(let value): body = value
        }
        let notification: NotificationPayload, transaction: Transaction?
        do {
            (notification, transaction) = try await service.verifier.verifyNotification(body.signedPayload)
        } catch {
            service.metrics.notification("unverified", error.code.rawValue)
            return apiError(status(for: error.code), error.code.rawValue, error.message)
        }
        let type = notification.notificationType ?? NotificationType(rawValue: "UNKNOWN")
        let revoke: Bool? = switch type {
        case .refund, .revoke: true
        case .refundReversed: false
        default: nil
        }
        do {
            let outcome = try service.store.apply(
                notificationUUID: notification.notificationUUID ?? "", type: type.rawValue, subtype: notification.subtype,
                transactionId: transaction?.transactionId, revoke: revoke, revokedAt: transaction?.revocationDate ?? Date(),
                signedPayload: body.signedPayload)
            // The ledger is durable now; the in-memory set makes the content path refuse at once.
            if outcome == .applied, let id = transaction?.transactionId, let revoke { service.markRevoked(id, revoke) }
            service.metrics.notification(type.rawValue, outcome == .applied ? "applied" : "duplicate")
            return json(.ok, ["status": outcome == .applied ? "applied" : "duplicate", "notificationUUID": notification.notificationUUID ?? ""])
        } catch {
            // Not acknowledged, so Apple retries.
            return apiError(.serviceUnavailable, error.code.rawValue, error.message)
        }
    }

    // MARK: Admin

    func upload(_ request: Request) async -> Response {
        guard let expected = service.configuration.adminToken else {
            return apiError(.forbidden, "admin-disabled", "the admin API is off: start the server with --admin-token-file")
        }
        let presented = request.headers[.authorization].flatMap { $0.hasPrefix("Bearer ") ? String($0.dropFirst(7)) : nil } ?? ""
        guard constantTimeEqual(presented, expected) else {
            return apiError(.unauthorized, "unauthorized", "send the admin token as Authorization: Bearer <token>")
        }
        var manifest: ArchiveManifest?
        if let header = request.headers[HTTPField.Name("IAP-Manifest")!] {
            guard let bytes = Base64URL.decode(header.utf8), let decoded = try? ArchiveManifest.decode(Data(bytes), source: "the IAP-Manifest header") else {
                return apiError(.badRequest, "invalid-manifest", "the IAP-Manifest header must be the manifest JSON in base64url")
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
                throw UploadError(status: .serviceUnavailable, code: "storage",
                                  message: "cannot create an upload file in \(folder)/tmp: \(error); check that the data folder is writable")
            }
            defer { try? fd.close() }
            let length = request.headers[.contentLength].flatMap(UInt64.init)
            if let part = try await UploadReceiver.receive(request.body, contentType: request.headers[.contentType], length: length,
                                                           into: fd, folder: folder) {
                guard manifest == nil else {
                    throw UploadError(status: .badRequest, code: "invalid-manifest", message: "send the manifest once: in the IAP-Manifest header or in the 'manifest' part, not both")
                }
                do throws(ArchiveError) {
                    manifest = try ArchiveManifest.decode(Data(part), source: "the manifest part")
                } catch {
                    throw UploadError(status: .badRequest, code: "invalid-manifest", message: error.message)
                }
            }
        } catch {
            unlink(path)
            return apiError(error.status, error.code, error.message)
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
            return apiError(.serviceUnavailable, "storage", "the server is shutting down: try again")
        }
        switch result {
        case .success(.published(let version)):
            return json(.created, ["status": "published", "productId": version.productId, "contentVersion": version.contentVersion, "sha256": version.sha256])
        case .success(.unchanged(let version)):
            unlink(path)
            return json(.ok, ["status": "unchanged", "productId": version.productId, "contentVersion": version.contentVersion, "sha256": version.sha256])
        case .failure(let error):
            unlink(path)
            let status: HTTPResponse.Status = switch error.code {
            case .conflict: .conflict
            case .invalidArchive: .badRequest
            case .notFound: .notFound
            case .storage: .serviceUnavailable
            }
            return apiError(status, error.code.rawValue, error.message)
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
            return .failure(apiError(.contentTooLarge, "too-large", "the request body is over \(service.configuration.maxJSONBody) bytes"))
        }
        guard let value = try? JSONDecoder().decode(T.self, from: Data(buffer.readableBytesView)) else {
            return .failure(apiError(.badRequest, "malformed", "the request body must be JSON like \(example)"))
        }
        return .success(value)
    }
}

func json<T: Encodable>(_ status: HTTPResponse.Status, _ value: T) -> Response {
    let encoder = JSONEncoder()
    encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
    encoder.dateEncodingStrategy = .iso8601
    let data = (try? encoder.encode(value)) ?? Data("{}".utf8)
    var headers = HTTPFields()
    headers[.contentType] = "application/json"
    headers[.cacheControl] = "no-store"
    return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: data + Data("\n".utf8))))
}

func apiError(_ status: HTTPResponse.Status, _ code: String, _ message: String) -> Response {
    json(status, ["error": ["code": code, "message": message]])
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
            let code = error.status == .notFound ? "not-found" : "http-\(error.status.code)"
            return apiError(error.status, code, error.body ?? error.status.reasonPhrase)
        }
    }
}

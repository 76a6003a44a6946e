import Base64URL
import CatalogPostgres
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
import ReceiptVerification
import Synchronization
import SystemPackage

/// The JSON API. Errors are `{"error": {"code": "...", "message": "..."}}` everywhere.
struct APIRoutes: Sendable {
    let service: ContentService
    let log: DecisionLog

    /// Registers every route, and records in `methods` which methods each path answers.
    func register(on router: Router<ServerRequestContext>, methods: RouteMethods) {
        func on(_ method: HTTPRequest.Method, _ path: String, _ handler: @escaping @Sendable (Request, ServerRequestContext) async throws -> Response) {
            router.on(RouterPath(path), method: method, use: handler)
            methods.add(method, path)
        }
        on(.get, Route.health) { _, _ in json(.ok, HealthStatus()) }
        on(.get, Route.ready) { request, _ in await ready(request) }
        on(.get, Route.metrics) { _, _ in
            var headers = HTTPFields()
            headers[.contentType] = "text/plain; version=0.0.4"
            // A scrape is a reading of now: no cache may answer the next one with it.
            headers[.cacheControl] = "no-store"
            if let postgres = service.store.database as? PostgresCatalog { service.metrics.database(postgres) }
            return Response(status: .ok, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: service.metrics.registry.emitToBuffer())))
        }
        on(.get, Route.grantCheck) { request, _ in grantCheck(request) }
        on(.get, Route.productPattern) { _, context in await product(try context.parameters.require("productId")) }
        on(.post, Route.downloads) { request, context in await downloads(request, context) }
        on(.post, Route.notifications) { request, context in await notification(request, context) }
        on(.put, Route.adminArchives) { request, context in await upload(request, context) }
        on(.post, Route.adminRollouts) { request, context in await rollout(request, context) }
        on(.delete, Route.adminVersionPattern) { request, context in
            await remove(request, productId: try context.parameters.require("productId"), contentVersion: try context.parameters.require("contentVersion"))
        }
    }

    // MARK: Probes

    /// `/readyz`: ready for everything (the database answers, every published archive is on
    /// disk); `/readyz?for=downloads`: ready to serve download URLs, which a shared database's
    /// outage does not stop, so that a balancer need not take every replica out at once.
    func ready(_ request: Request) async -> Response {
        let scope: ContentStore.ReadinessScope
        switch request.uri.queryParameters.get(Route.readyScopeParameter) {
        case nil: scope = .everything
        case Route.readyScopeDownloads: scope = .downloads
        case let other?:
            return apiError(
                .badRequest,
                APIError(.malformed, "'\(other)' is not a readiness scope: ask /readyz (everything) or /readyz?\(Route.readyScopeParameter)=\(Route.readyScopeDownloads)"))
        }
        let readiness = await service.store.readiness(for: scope)
        guard readiness.isReady else {
            let also = readiness.databaseTrouble.map { ["also \($0)"] } ?? []
            return apiError(.serviceUnavailable, APIError(.notReady, (readiness.problems + also).joined(separator: "; ")))
        }
        return json(.ok, HealthStatus(status: "ready", database: readiness.databaseTrouble))
    }

    // MARK: Edge

    /// nginx's `auth_request`: is the grant in the content path of `X-Original-URI` valid now?
    /// Every answer may be cached for a second, so a refund reaches an edge within one.
    func grantCheck(_ request: Request) -> Response {
        var headers = HTTPFields()
        headers[.cacheControl] = "max-age=1"
        let uri = request.headers[HTTPField.Name(Route.grantCheckURIHeader)!] ?? ""
        guard uri.hasPrefix(Route.contentPrefix) else {
            headers[.wwwAuthenticate] = Challenge.grant
            return apiError(
                .unauthorized,
                APIError(.malformed, "send the content path in \(Route.grantCheckURIHeader) (nginx: proxy_set_header \(Route.grantCheckURIHeader) $request_uri)"),
                headers: headers)
        }
        let rest = uri.dropFirst(Route.contentPrefix.count)
        let token = rest.prefix { $0 != "/" && $0 != "?" }
        switch service.check(token: token, now: Date()) {
        case .failure(let refusal):
            // nginx passes a 401's challenge on from auth_request to the client.
            if refusal.status == .unauthorized { headers[.wwwAuthenticate] = Challenge.grant }
            return apiError(HTTPResponse.Status(code: Int(refusal.status.code)), refusal.error, headers: headers)
        case .success(let grant):
            headers[HTTPField.Name(Route.grantCheckArchiveHeader)!] = grant.sha256
            return Response(status: .ok, headers: headers)
        }
    }

    // MARK: Products

    func product(_ id: String) async -> Response {
        do throws(CatalogError) {
            let versions = try await service.store.versions(productId: id)
            guard versions.contains(where: { $0.removedAt == nil }) else {
                let removed = versions.isEmpty ? "" : " (every version was removed)"
                return apiError(.notFound, APIError(.noContent, "no content is published for product \(id)\(removed)"))
            }
            // Removed versions stay listed: their numbers are taken.
            return json(.ok, ProductInfo(productId: id, versions: versions.map(\.info)))
        } catch {
            return apiError(.serviceUnavailable, error.apiError)
        }
    }

    // MARK: Grants

    func downloads(_ request: Request, _ context: ServerRequestContext) async -> Response {
        let body: DownloadRequest
        switch await decodeBody(request, context, as: DownloadRequest.self, example: DownloadRequest.example) {
        case .failure(let response): return response
        case .success(let value): body = value
        }
        switch (body.signedTransaction, body.receipt) {
        case (let signed?, nil): return await signedTransactionDownloads(signed, contentVersion: body.contentVersion)
        case (nil, let receipt?): return await receiptDownloads(receipt, body)
        case (nil, nil):
            return apiError(.badRequest, APIError(.malformed, "send signedTransaction (StoreKit 2) or receipt (StoreKit 1): \(DownloadRequest.example)"))
        case (_?, _?):
            return apiError(.badRequest, APIError(.malformed, "send signedTransaction or receipt, not both"))
        }
    }

    /// A refusal: the status and the error a client gets.
    struct Refusal: Error {
        let status: HTTPResponse.Status
        let error: APIError
    }

    func signedTransactionDownloads(_ signed: String, contentVersion: String?) async -> Response {
        let started = ContinuousClock.now
        let transaction: Transaction
        do {
            transaction = try await service.verifier.verifyTransaction(signed)
            service.metrics.verificationDuration.record(ContinuousClock.now - started)
        } catch {
            service.metrics.grant(error.code.rawValue)
            log.refused(code: error.code.rawValue, reason: error.message, transaction: nil, proof: .signedTransaction)
            return verificationRefusal(error)
        }
        switch await grant(transaction, contentVersion: contentVersion, proof: .signedTransaction) {
        case .failure(let refusal): return apiError(refusal.status, refusal.error)
        case .success(let download): return json(.ok, DownloadGrants(transactionId: transaction.transactionId ?? "", downloads: [download]))
        }
    }

    /// StoreKit 1: the receipt is verified as a whole, then each purchase in it is judged and
    /// granted exactly as a signed transaction would be (one entitlement function, one ledger).
    func receiptDownloads(_ text: String, _ body: DownloadRequest) async -> Response {
        let started = ContinuousClock.now
        let receipt: AppReceipt
        do {
            receipt = try await service.receiptChecker.verify(base64: text)
            service.metrics.verificationDuration.record(ContinuousClock.now - started)
        } catch {
            service.metrics.grant(error.code.rawValue)
            log.refused(code: error.code.rawValue, reason: error.message, transaction: nil, proof: .receipt)
            return verificationRefusal(error)
        }
        // Newest first, so a product bought (or renewed) more than once is granted for its latest purchase.
        let transactions = receipt.transactions.sorted { ($0.purchaseDate ?? .distantPast) > ($1.purchaseDate ?? .distantPast) }
        if body.transactionId != nil || body.productId != nil {
            let matching = transactions.filter { t in
                (body.transactionId.map { $0 == t.transactionId || $0 == t.originalTransactionId } ?? true)
                    && (body.productId.map { $0 == t.productId } ?? true)
            }
            guard let first = matching.first else {
                service.metrics.grant("not-in-receipt")
                let what = [body.transactionId.map { "transaction \($0)" }, body.productId.map { "product \($0)" }].compactMap { $0 }.joined(separator: " and ")
                let error = APIError(.notInReceipt, "the receipt holds no purchase of \(what): refresh the receipt (SKReceiptRefreshRequest) or restore")
                log.refused(code: error.code.rawValue, reason: error.message, transaction: nil, proof: .receipt)
                return apiError(.notFound, error)
            }
            // Among several purchases of the product, the first that entitles (a renewal after an expired one).
            let chosen = matching.first { entitlement(for: $0, configuration: service.verifier.configuration).isGranted } ?? first
            switch await grant(chosen, contentVersion: body.contentVersion, proof: .receipt) {
            case .failure(let refusal): return apiError(refusal.status, refusal.error)
            case .success(let download): return json(.ok, DownloadGrants(transactionId: chosen.transactionId, downloads: [download]))
            }
        }
        // Restore: every product in the receipt once, for its newest purchase that entitles.
        var downloads: [GrantedDownload] = [], skipped: [SkippedPurchase] = [], done = Set<String>()
        for transaction in transactions {
            let product = transaction.productId ?? ""
            guard !done.contains(product) else { continue }
            switch await grant(transaction, contentVersion: nil, proof: .receipt) {
            case .success(let download):
                downloads.append(download)
                done.insert(product)
                skipped.removeAll { $0.productId == product }
            case .failure(let refusal):
                // The catalog cannot answer: every other product would wait for it in turn and be
                // skipped the same way, and a 200 listing them all as skipped reads as nothing to
                // download. The whole restore is to be asked again.
                if refusal.status == .serviceUnavailable { return apiError(refusal.status, refusal.error) }
                if !skipped.contains(where: { $0.productId == product }) {
                    skipped.append(
                        SkippedPurchase(transactionId: transaction.transactionId ?? "", productId: product, code: refusal.error.code.rawValue, message: refusal.error.message))
                }
            }
        }
        return json(.ok, DownloadGrants(transactionId: nil, downloads: downloads, skipped: skipped))
    }

    /// The one grant decision, logged (``DecisionLog``).
    func grant(_ transaction: Transaction, contentVersion: String?, proof: DecisionLog.Proof) async -> Result<GrantedDownload, Refusal> {
        let decision = await decideGrant(transaction, contentVersion: contentVersion)
        switch decision {
        case .success(let download): log.granted(transaction, contentVersion: download.contentVersion, proof: proof)
        case .failure(let refusal): log.refused(code: refusal.error.code.rawValue, reason: refusal.error.message, transaction: transaction, proof: proof)
        }
        return decision
    }

    /// Entitlement, the revocation ledger, published content; then the ledger row and a signed
    /// URL.
    private func decideGrant(_ transaction: Transaction, contentVersion: String?) async -> Result<GrantedDownload, Refusal> {
        let transactionId = transaction.transactionId ?? ""
        if case .denied(let reason) = entitlement(for: transaction, configuration: service.verifier.configuration) {
            service.metrics.grant(reason.code)
            return .failure(Refusal(status: .forbidden, error: APIError(APIErrorCode(rawValue: reason.code), "no download: \(reason)")))
        }
        do throws(CatalogError) {
            // A ledger that cannot be read ends the grant here, with the 503 it would end with
            // anyway: each question put to a database that does not answer waits out a deadline.
            var ids = transaction.transactionId.map { [$0] } ?? []
            if let original = transaction.originalTransactionId, !ids.contains(original) { ids.append(original) }
            for id in ids where try await service.isRevokedInLedger(id) {
                service.metrics.grant("revoked")
                return .failure(Refusal(status: .forbidden, error: APIError(.revoked, "no download: transaction \(id) was refunded or revoked")))
            }
            guard let productId = transaction.productId else {
                return .failure(Refusal(status: .badRequest, error: APIError(.malformed, "the transaction has no productId")))
            }
            let versions = try await service.store.versions(productId: productId)
            // Staged rollouts and rollbacks decide which version this purchase gets; a pinned
            // version too must be served to it. The bucket is the original purchase's: a
            // subscription's renewals and a restore's new transactions are the same purchase, and
            // a device with several of them must not be given two versions.
            let purchase = transaction.originalTransactionId ?? transactionId
            let bucket = ContentStore.rolloutBucket(productId: productId, transactionId: purchase)
            let chosen =
                contentVersion.map { pinned in versions.first { $0.contentVersion == pinned && $0.isServed(toBucket: bucket) } }
                ?? ContentStore.version(forTransaction: purchase, productId: productId, among: versions)
            guard let version = chosen else {
                service.metrics.grant("no-content")
                let what = contentVersion.map { "version \($0) of \(productId) (or it was rolled back, or its staged rollout does not include this purchase yet)" } ?? "product \(productId)"
                return .failure(Refusal(status: .notFound, error: APIError(.noContent, "no hosted content is published for \(what)")))
            }
            // What the archive must be is known from here on, for a download before the next catalog read.
            service.noteVersion(version)
            try await service.store.recordGrant(
                transactionId: transactionId, originalTransactionId: transaction.originalTransactionId,
                productId: productId, environment: transaction.environment?.rawValue)
            let expires = Date().addingTimeInterval(TimeInterval(service.configuration.tokenTTL.components.seconds))
            let token = service.grantKeys.ring.mint(
                Grant(
                    transactionId: transactionId, productId: productId, contentVersion: version.contentVersion,
                    sha256: version.sha256, expiresAt: Int64(expires.timeIntervalSince1970)))
            let base = service.configuration.publicURL ?? "http://\(URLHost.inURL(service.configuration.host)):\(service.boundPort.withLock { $0 })"
            let url = base + Route.content(token: token, productId: productId, contentVersion: version.contentVersion)
            service.metrics.grant("granted")
            return .success(
                GrantedDownload(
                    productId: productId, contentVersion: version.contentVersion, contentLength: version.size,
                    sha256: version.sha256, url: url, expiresAt: expires, transactionId: transactionId,
                    manifestURL: version.manifestSHA256.map { _ in base + Route.manifest(token: token, productId: productId, contentVersion: version.contentVersion) },
                    manifestSHA256: version.manifestSHA256))
        } catch {
            service.metrics.grant(error.code.rawValue)
            return .failure(Refusal(status: .serviceUnavailable, error: error.apiError))
        }
    }

    /// The answer to a proof of purchase or notification that did not verify; a 401 names the
    /// signature it lacks (``Challenge/appStoreSignature``).
    func verificationRefusal(_ error: VerificationError) -> Response {
        let status = status(for: error.code)
        var headers = HTTPFields()
        if status == .unauthorized { headers[.wwwAuthenticate] = Challenge.appStoreSignature }
        return apiError(status, error.apiError, headers: headers)
    }

    func status(for code: VerificationErrorCode) -> HTTPResponse.Status {
        switch code {
        case .malformed, .tooLarge: .badRequest
        case .unsupportedAlgorithm, .unsupportedCriticalHeader, .invalidCertificateList, .untrustedChain, .missingMarkerOID, .invalidSignature:
            .unauthorized
        case .wrongBundleId, .wrongEnvironment, .verifiersDisagree, .unknownAccount: .forbidden
        case .receiptServiceUnavailable: .serviceUnavailable
        }
    }

    // MARK: Notifications

    func notification(_ request: Request, _ context: ServerRequestContext) async -> Response {
        let body: NotificationRequest
        switch await decodeBody(request, context, as: NotificationRequest.self, example: NotificationRequest.example) {
        case .failure(let response): return response
        case .success(let value): body = value
        }
        let notification: NotificationPayload, transaction: Transaction?
        do {
            (notification, transaction) = try await service.verifier.verifyNotification(body.signedPayload)
        } catch {
            service.metrics.notification("unverified", error.code.rawValue)
            log.notificationRefused(code: error.code.rawValue, reason: error.message)
            return verificationRefusal(error)
        }
        let type = notification.notificationType ?? NotificationType(rawValue: "UNKNOWN")
        let revoke = NotificationLedger.revokes(type)
        do {
            let outcome = try await NotificationLedger(store: service.store).record(notification, transaction: transaction, signedPayload: body.signedPayload)
            // The ledger is durable now; the in-memory set makes the content path refuse at once.
            if outcome == .applied, let id = transaction?.transactionId, let revoke { service.markRevoked(id, revoke) }
            service.metrics.notification(type.rawValue, outcome == .applied ? "applied" : "duplicate")
            log.notification(notification, transaction: transaction, applied: outcome == .applied, revokes: revoke)
            return json(
                .ok,
                NotificationReceipt(
                    status: outcome == .applied ? .applied : .duplicate,
                    notificationUUID: notification.notificationUUID ?? ""))
        } catch {
            // Not acknowledged, so Apple retries.
            log.notificationNotRecorded(reason: error.message)
            return apiError(.serviceUnavailable, error.apiError)
        }
    }

    // MARK: Admin

    /// nil when the request carries the admin token; the refusal otherwise.
    func refuseUnlessAdmin(_ request: Request) -> Response? {
        // An empty token would match a request that sends none: it disables the API like nil.
        guard let expected = service.configuration.adminToken, !expected.isEmpty else {
            log.adminRefused("the admin API is off", path: request.uri.path)
            return apiError(.forbidden, APIError(.adminDisabled, "the admin API is off: start the server with --admin-token-file"))
        }
        let presented = request.headers[.authorization].flatMap { $0.hasPrefix("Bearer ") ? String($0.dropFirst(7)) : nil } ?? ""
        guard constantTimeEqual(presented, expected) else {
            log.adminRefused(presented.isEmpty ? "no bearer token" : "wrong bearer token", path: request.uri.path)
            var challenge = HTTPFields()
            challenge[.wwwAuthenticate] = Challenge.admin(tokenSent: !presented.isEmpty)
            return apiError(.unauthorized, APIError(.unauthorized, "send the admin token as Authorization: Bearer <token>"), headers: challenge)
        }
        return nil
    }

    /// Stages, promotes or rolls back a version; the next grant on every replica sees it.
    func rollout(_ request: Request, _ context: ServerRequestContext) async -> Response {
        if let refusal = refuseUnlessAdmin(request) { return refusal }
        let body: RolloutRequest
        switch await decodeBody(request, context, as: RolloutRequest.self, example: RolloutRequest.example) {
        case .failure(let response): return response
        case .success(let value): body = value
        }
        guard (body.percent != nil) != (body.rollBack == true) else {
            return apiError(.badRequest, APIError(.malformed, "give either percent (1-100) or rollBack: true; example: \(RolloutRequest.example)"))
        }
        do throws(CatalogError) {
            let v =
                if let percent = body.percent {
                    try await service.store.setRollout(
                        productId: body.productId, contentVersion: body.contentVersion, percent: percent, allowingUnserved: body.allowUnserved == true)
                } else {
                    try await service.store.rollBack(productId: body.productId, contentVersion: body.contentVersion, allowingUnserved: body.allowUnserved == true)
                }
            if let percent = body.percent {
                log.catalogChanged("rollout set", productId: v.productId, contentVersion: v.contentVersion, ["percent": "\(percent)"])
            } else {
                log.catalogChanged("version rolled back", productId: v.productId, contentVersion: v.contentVersion)
            }
            return json(.ok, v.info)
        } catch {
            return catalogRefusal(error)
        }
    }

    /// Removes a rolled-back version and deletes its archive (``ContentStore/remove(productId:contentVersion:now:)``).
    func remove(_ request: Request, productId: String, contentVersion: String) async -> Response {
        if let refusal = refuseUnlessAdmin(request) { return refusal }
        do throws(CatalogError) {
            let removal = try await service.store.remove(productId: productId, contentVersion: contentVersion)
            // This server's own kept handles, at once; other replicas' at their next catalog read.
            service.forgetFiles(sha256s: [removal.version.sha256])
            log.catalogChanged("version removed", productId: productId, contentVersion: contentVersion, ["freedBytes": "\(removal.freedBytes)"])
            return json(.ok, VersionRemoval(productId: productId, version: removal.version.info, freedBytes: removal.freedBytes))
        } catch {
            return catalogRefusal(error)
        }
    }

    /// The answer to a catalog error from an admin request.
    func catalogRefusal(_ error: CatalogError) -> Response {
        let status: HTTPResponse.Status =
            switch error.code {
            case .conflict: .conflict
            case .invalidArchive: .badRequest
            case .notFound: .notFound
            case .storage: .serviceUnavailable
            }
        return apiError(status, error.apiError)
    }

    func upload(_ request: Request, _ context: ServerRequestContext) async -> Response {
        if let refusal = refuseUnlessAdmin(request) { return refusal }
        var manifest: ArchiveManifest?
        if let header = request.headers[HTTPField.Name("IAP-Manifest")!] {
            guard let bytes = Base64URL.decode(header.utf8), let decoded = try? ArchiveManifest.decode(Data(bytes), source: "the IAP-Manifest header") else {
                return apiError(.badRequest, APIError(.invalidManifest, "the IAP-Manifest header must be the manifest JSON in base64url"))
            }
            manifest = decoded
        }
        // Refused before the body (which `Expect: 100-continue` then never sends), rather than
        // after up to 2 GiB are written and validated, for a catalog row that cannot be written.
        guard service.store.database.isAnswering else {
            return apiError(
                .serviceUnavailable,
                APIError(.storage, "\(service.store.database.location) does not answer, so nothing can be published: upload again once it does"))
        }
        let upload = service.store.claimUpload()
        defer { upload.release() }
        let path = upload.path
        let folder = service.configuration.dataDirectory
        do throws(UploadError) {
            let fd: SystemPackage.FileDescriptor
            do {
                fd = try SystemPackage.FileDescriptor.open(path, .writeOnly, options: [.create, .exclusiveCreate], permissions: [.ownerReadWrite])
                upload.lock()
            } catch {
                throw UploadError(
                    .serviceUnavailable, .storage,
                    "cannot create an upload file in \((path as NSString).deletingLastPathComponent): \(error); check that the folder is writable")
            }
            defer { try? fd.close() }
            let length = request.headers[.contentLength].flatMap(UInt64.init)
            if let part = try await UploadReceiver.receive(
                request.body, contentType: request.headers[.contentType], length: length,
                into: fd, folder: folder, beforeReading: { await context.continueIfExpected(request) })
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
        do throws(CatalogError) {
            switch try await service.store.publish(
                archiveAt: path, manifest: manifest, moveFile: true, originURL: service.configuration.advertiseURL)
            {
            case .published(let version):
                service.noteVersion(version)
                log.catalogChanged(
                    "version published", productId: version.productId, contentVersion: version.contentVersion,
                    ["sha256": .string(version.sha256), "bytes": "\(version.size)"])
                return json(.created, PublishReceipt(status: .published, productId: version.productId, contentVersion: version.contentVersion, sha256: version.sha256))
            case .unchanged(let version):
                return json(.ok, PublishReceipt(status: .unchanged, productId: version.productId, contentVersion: version.contentVersion, sha256: version.sha256))
            case .repaired(let version):
                // This server's kept handles name the damaged file; other replicas see the new one within a refresh.
                service.forgetFiles(sha256s: [version.sha256])
                log.catalogChanged(
                    "archive repaired", productId: version.productId, contentVersion: version.contentVersion, ["sha256": .string(version.sha256)])
                return json(.ok, PublishReceipt(status: .repaired, productId: version.productId, contentVersion: version.contentVersion, sha256: version.sha256))
            }
        } catch {
            unlink(path)
            return catalogRefusal(error)
        }
    }

    // MARK: Helpers

    enum Decoded<T> {
        case success(T)
        case failure(Response)
    }

    private func decodeBody<T: Decodable>(_ request: Request, _ context: ServerRequestContext, as type: T.Type, example: String) async -> Decoded<T> {
        let buffer: ByteBuffer
        // A body announced as too large is refused at once, before a byte of it is waited for.
        if let declared = request.headers[.contentLength].flatMap({ Int($0) }), declared > service.configuration.maxJSONBody {
            return .failure(apiError(.contentTooLarge, APIError(.tooLarge, "the request body is over \(service.configuration.maxJSONBody) bytes")))
        }
        await context.continueIfExpected(request)
        do {
            buffer = try await request.body.collect(upTo: service.configuration.maxJSONBody)
        } catch is NIOTooManyBytesError {
            return .failure(apiError(.contentTooLarge, APIError(.tooLarge, "the request body is over \(service.configuration.maxJSONBody) bytes")))
        } catch {
            // A body that is not valid HTTP (a bad chunk size) or that ended early: not too large.
            return .failure(apiError(.badRequest, APIError(.malformed, "the request body could not be read (\(error)): send it whole, as JSON like \(example)")))
        }
        guard let value = try? WireJSON.decoder().decode(T.self, from: Data(buffer.readableBytesView)) else {
            return .failure(apiError(.badRequest, APIError(.malformed, "the request body must be JSON like \(example)")))
        }
        return .success(value)
    }
}

/// A JSON answer; not cached unless `headers` say otherwise.
func json<T: Encodable>(_ status: HTTPResponse.Status, _ value: T, headers extra: HTTPFields = [:]) -> Response {
    var headers = HTTPFields()
    headers[.contentType] = "application/json"
    headers[.cacheControl] = "no-store"
    for field in extra { headers[field.name] = field.value }
    return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: WireJSON.line(value))))
}

/// An error answer: the envelope of ``APIError``.
func apiError(_ status: HTTPResponse.Status, _ error: APIError, headers: HTTPFields = [:]) -> Response {
    var headers = headers
    // The catalog's database away (a replica reconnects within a second of its return) or the
    // data folder unwritable: a client told when to come back waits that long between tries
    // instead of spending them all on its backoff's first seconds (iap-fetch's five take about
    // 5 s; these take 20, through a database's failover).
    if status == .serviceUnavailable, error.code == .storage, headers[.retryAfter] == nil {
        headers[.retryAfter] = storageRetryAfter
    }
    return json(status, error.envelope, headers: headers)
}

/// `Retry-After` of a 503 `storage` answer, in seconds.
let storageRetryAfter = "5"

func constantTimeEqual(_ a: String, _ b: String) -> Bool {
    let x = Array(a.utf8), y = Array(b.utf8)
    var difference = UInt8(x.count == y.count ? 0 : 1)
    for i in 0..<max(x.count, y.count) {
        difference |= (i < x.count ? x[i] : 0) ^ (i < y.count ? y[i] : 0)
    }
    return difference == 0
}

/// The methods each API path answers, recorded as the routes are registered (patterns such as
/// `/v1/products/{productId}` match any one segment there). Written while the router is built,
/// only read once the server runs.
final class RouteMethods: Sendable {
    private let routes = Mutex<[(segments: [Substring], methods: [HTTPRequest.Method])]>([])

    func add(_ method: HTTPRequest.Method, _ path: String) {
        let segments = path.split(separator: "/")
        routes.withLock { routes in
            if let index = routes.firstIndex(where: { $0.segments == segments }) {
                routes[index].methods.append(method)
            } else {
                routes.append((segments, [method]))
            }
        }
    }

    /// The methods `path` answers; empty when no route has that path.
    func allowed(for path: String) -> [HTTPRequest.Method] {
        let asked = path.split(separator: "/")
        return routes.withLock { routes in
            routes.first { route in
                route.segments.count == asked.count
                    && zip(route.segments, asked).allSatisfy { pattern, segment in pattern.hasPrefix("{") || pattern == segment }
            }?.methods ?? []
        }
    }
}

/// Renders framework errors in the API's error format. The router answers a known path asked
/// with another method as not found; that is said as 405 with `Allow` (RFC 9110 §15.5.6), so
/// that `GET /v1/downloads` from a browser says to POST rather than that nothing is there.
struct ErrorFormatMiddleware: RouterMiddleware {
    typealias Context = ServerRequestContext
    let methods: RouteMethods

    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        do {
            return try await next(request, context)
        } catch let error as HTTPError {
            guard error.status == .notFound else {
                return apiError(error.status, APIError(APIErrorCode(rawValue: "http-\(error.status.code)"), error.body ?? error.status.reasonPhrase))
            }
            let path = request.uri.path
            let allowed = methods.allowed(for: path)
            guard !allowed.isEmpty else {
                return apiError(.notFound, APIError(.notFound, error.body ?? "nothing is served at \(path.prefix(200))"))
            }
            // A GET route answers HEAD too (Hummingbird's automatic HEAD), so both are named.
            var names = allowed.map(\.rawValue)
            if allowed.contains(.get) && !allowed.contains(.head) { names.append("HEAD") }
            var headers = HTTPFields()
            headers[.allow] = names.joined(separator: ", ")
            return apiError(
                .methodNotAllowed,
                APIError(.methodNotAllowed, "\(path) answers \(names.joined(separator: " and ")), not \(request.method.rawValue)"), headers: headers)
        }
    }
}

extension PublishedVersion {
    /// The version as the API describes it.
    var info: ProductInfo.Version {
        ProductInfo.Version(
            contentVersion: contentVersion, contentLength: size, extractedLength: contentLength, sha256: sha256, publishedAt: publishedAt,
            rolloutPercent: rolloutPercent, rolledBackAt: rolledBackAt, removedAt: removedAt)
    }
}

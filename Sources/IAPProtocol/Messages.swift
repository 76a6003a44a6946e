import Foundation

// The request and response bodies of every JSON endpoint. The server encodes and decodes with
// these types and ``WireJSON``; clients do the same, so the two cannot drift apart.

/// `POST /v1/downloads`: the proof of purchase, and optionally the version wanted (default: the latest).
public struct DownloadRequest: Codable, Sendable, Equatable {
    /// A StoreKit 2 signed transaction (JWS).
    public var signedTransaction: String?
    /// A StoreKit 1 app receipt (`Bundle.main.appStoreReceiptURL`'s bytes, base64): the proof of
    /// purchase of the apps that used Apple-hosted content.
    public var receipt: String?
    /// With a receipt: the purchase to grant. Without it (and without `productId`), every
    /// purchase in the receipt that has hosted content is granted: a restore.
    public var transactionId: String?
    /// With a receipt: grant this product's purchase.
    public var productId: String?
    public var contentVersion: String?

    public init(signedTransaction: String, contentVersion: String? = nil) {
        self.signedTransaction = signedTransaction
        self.contentVersion = contentVersion
    }

    public init(receipt: String, transactionId: String? = nil, productId: String? = nil, contentVersion: String? = nil) {
        self.receipt = receipt
        self.transactionId = transactionId
        self.productId = productId
        self.contentVersion = contentVersion
    }

    /// Shown in the error for a body that is not this.
    public static let example = #"{"signedTransaction": "<JWS>"} or {"receipt": "<base64 app receipt>", "transactionId": "<optional>"}"#
}

/// One archive a grant allows to download.
public struct GrantedDownload: Codable, Sendable, Equatable {
    public var productId: String
    public var contentVersion: String
    /// The archive's size in bytes.
    public var contentLength: Int64
    /// SHA-256 of the archive, lowercase hex: what the client verifies, and the `ETag`.
    public var sha256: String
    /// Where the bytes are, valid until `expiresAt` (ranges, `If-Range`).
    public var url: String
    public var expiresAt: Date
    /// The purchase this download is granted for (a restore grants several).
    public var transactionId: String?
    /// Where the archive's manifest is, under the same grant (ranges too): what a client with an
    /// earlier version installed compares to fetch only the entries that changed.
    public var manifestURL: String?
    /// SHA-256 of the manifest's bytes, lowercase hex: the client trusts what it fetched only if it matches.
    public var manifestSHA256: String?

    public init(
        productId: String, contentVersion: String, contentLength: Int64, sha256: String, url: String, expiresAt: Date, transactionId: String? = nil,
        manifestURL: String? = nil, manifestSHA256: String? = nil
    ) {
        self.transactionId = transactionId
        self.manifestURL = manifestURL
        self.manifestSHA256 = manifestSHA256
        self.productId = productId
        self.contentVersion = contentVersion
        self.contentLength = contentLength
        self.sha256 = sha256
        self.url = url
        self.expiresAt = expiresAt
    }
}

/// The answer to `POST /v1/downloads`.
public struct DownloadGrants: Codable, Sendable, Equatable {
    /// The transaction asked about; absent for a receipt restore (each download names its own).
    public var transactionId: String?
    public var downloads: [GrantedDownload]
    /// A restore's purchases that got no download, and why (refunded, expired, no hosted content).
    public var skipped: [SkippedPurchase]?

    public init(transactionId: String?, downloads: [GrantedDownload], skipped: [SkippedPurchase]? = nil) {
        self.transactionId = transactionId
        self.downloads = downloads
        self.skipped = skipped
    }
}

/// A purchase a restore did not grant, with the code and message a single request would have got.
public struct SkippedPurchase: Codable, Sendable, Equatable {
    public var transactionId: String
    public var productId: String
    public var code: String
    public var message: String

    public init(transactionId: String, productId: String, code: String, message: String) {
        self.transactionId = transactionId
        self.productId = productId
        self.code = code
        self.message = message
    }
}

/// `GET /v1/products/{productId}`: the latest version first among `versions`.
public struct ProductInfo: Codable, Sendable, Equatable {
    public struct Version: Codable, Sendable, Equatable {
        public var contentVersion: String
        /// The archive's size.
        public var contentLength: Int64
        /// The content's size once extracted.
        public var extractedLength: Int64
        public var sha256: String
        public var publishedAt: Date
        /// A staged rollout's share of purchases (1-99); absent when every purchase gets it.
        public var rolloutPercent: Int?
        /// Set when the version was rolled back: no purchase gets it.
        public var rolledBackAt: Date?
        /// Set when the version was removed: its archive is deleted and its number never used again.
        public var removedAt: Date?

        public init(
            contentVersion: String, contentLength: Int64, extractedLength: Int64, sha256: String, publishedAt: Date,
            rolloutPercent: Int? = nil, rolledBackAt: Date? = nil, removedAt: Date? = nil
        ) {
            self.rolloutPercent = rolloutPercent
            self.rolledBackAt = rolledBackAt
            self.removedAt = removedAt
            self.contentVersion = contentVersion
            self.contentLength = contentLength
            self.extractedLength = extractedLength
            self.sha256 = sha256
            self.publishedAt = publishedAt
        }
    }

    public var productId: String
    public var contentVersion: String
    public var contentLength: Int64
    public var sha256: String
    public var versions: [Version]

    /// The top-level fields describe the newest version every purchase gets (staged, rolled-back
    /// and removed versions are only in `versions`), or the newest not removed when there is none.
    public init(productId: String, versions: [Version]) {
        precondition(!versions.isEmpty, "a product is listed once a version is published")
        self.productId = productId
        let current =
            versions.first { $0.rolloutPercent == nil && $0.rolledBackAt == nil && $0.removedAt == nil } ?? versions.first { $0.removedAt == nil } ?? versions[0]
        contentVersion = current.contentVersion
        contentLength = current.contentLength
        sha256 = current.sha256
        self.versions = versions
    }
}

/// The answer to `DELETE /v1/admin/archives/{productId}/{contentVersion}`.
public struct VersionRemoval: Codable, Sendable, Equatable {
    public var productId: String
    /// The version, with `removedAt`.
    public var version: ProductInfo.Version
    /// Bytes of archive and manifest deleted from the answering server's folder (0 when they
    /// were gone already); replicas with folders of their own delete their copies within seconds.
    public var freedBytes: Int64

    public init(productId: String, version: ProductInfo.Version, freedBytes: Int64) {
        self.productId = productId
        self.version = version
        self.freedBytes = freedBytes
    }
}

/// `POST /v1/admin/rollouts`: `percent` (1-100, 100 promotes) or `rollBack: true`.
public struct RolloutRequest: Codable, Sendable, Equatable {
    public var productId: String
    public var contentVersion: String
    public var percent: Int?
    public var rollBack: Bool?
    /// Narrow or roll back even when some purchases are then served no version at all
    /// (otherwise 409 `conflict`).
    public var allowUnserved: Bool?

    public init(productId: String, contentVersion: String, percent: Int? = nil, rollBack: Bool? = nil, allowUnserved: Bool? = nil) {
        self.productId = productId
        self.contentVersion = contentVersion
        self.percent = percent
        self.rollBack = rollBack
        self.allowUnserved = allowUnserved
    }

    public static let example = #"{"productId": "com.example.levels", "contentVersion": "1.1", "percent": 10} or {..., "rollBack": true}"#
}

/// `POST /v1/notifications`: an App Store Server Notification V2.
public struct NotificationRequest: Codable, Sendable, Equatable {
    public var signedPayload: String
    public init(signedPayload: String) { self.signedPayload = signedPayload }
    public static let example = #"{"signedPayload": "<JWS>"}"#
}

/// The answer to a notification, sent only once it is durable.
public struct NotificationReceipt: Codable, Sendable, Equatable {
    public enum Status: String, Codable, Sendable {
        /// Stored and applied now.
        case applied
        /// Seen before (Apple retries): nothing changed.
        case duplicate
    }

    public var status: Status
    public var notificationUUID: String

    public init(status: Status, notificationUUID: String) {
        self.status = status
        self.notificationUUID = notificationUUID
    }
}

/// The answer to `PUT /v1/admin/archives`.
public struct PublishReceipt: Codable, Sendable, Equatable {
    public enum Status: String, Codable, Sendable {
        /// 201: a new version.
        case published
        /// 200: these bytes were already published under that version.
        case unchanged
        /// 200: these bytes were already published under that version, and the server's copy
        /// (archive or manifest) was missing or damaged: it was put back.
        case repaired
    }

    public var status: Status
    public var productId: String
    public var contentVersion: String
    public var sha256: String

    public init(status: Status, productId: String, contentVersion: String, sha256: String) {
        self.status = status
        self.productId = productId
        self.contentVersion = contentVersion
        self.sha256 = sha256
    }
}

/// `GET /healthz`.
public struct HealthStatus: Codable, Sendable, Equatable {
    public var status: String
    /// `/readyz?for=downloads`: the shared database's trouble the server is ready in spite of
    /// (grants and notifications answer 503 until it is back).
    public var database: String?
    public init(status: String = "ok", database: String? = nil) { (self.status, self.database) = (status, database) }
}

/// The JSON settings of the wire format: ISO 8601 dates, sorted keys, slashes unescaped.
public enum WireJSON {
    public static func encoder() -> JSONEncoder {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        return encoder
    }

    public static func decoder() -> JSONDecoder {
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .iso8601
        return decoder
    }

    /// One value as a line of JSON.
    public static func line<T: Encodable>(_ value: T) -> Data {
        ((try? encoder().encode(value)) ?? Data("{}".utf8)) + Data("\n".utf8)
    }
}

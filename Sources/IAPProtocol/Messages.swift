import Foundation

// The request and response bodies of every JSON endpoint. The server encodes and decodes with
// these types and ``WireJSON``; clients do the same, so the two cannot drift apart.

/// `POST /v1/downloads`: the proof of purchase, and optionally the version wanted (default: the latest).
public struct DownloadRequest: Codable, Sendable, Equatable {
    /// A StoreKit 2 signed transaction (JWS).
    public var signedTransaction: String
    public var contentVersion: String?

    public init(signedTransaction: String, contentVersion: String? = nil) {
        self.signedTransaction = signedTransaction
        self.contentVersion = contentVersion
    }

    /// Shown in the error for a body that is not this.
    public static let example = #"{"signedTransaction": "<JWS>"}"#
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

    public init(productId: String, contentVersion: String, contentLength: Int64, sha256: String, url: String, expiresAt: Date) {
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
    public var transactionId: String
    public var downloads: [GrantedDownload]

    public init(transactionId: String, downloads: [GrantedDownload]) {
        self.transactionId = transactionId
        self.downloads = downloads
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

        public init(contentVersion: String, contentLength: Int64, extractedLength: Int64, sha256: String, publishedAt: Date) {
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

    public init(productId: String, versions: [Version]) {
        precondition(!versions.isEmpty, "a product is listed once a version is published")
        self.productId = productId
        contentVersion = versions[0].contentVersion
        contentLength = versions[0].contentLength
        sha256 = versions[0].sha256
        self.versions = versions
    }
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
    public init(status: String = "ok") { self.status = status }
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

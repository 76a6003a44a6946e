/// The codes the server's error envelope carries. A struct rather than an enum so that a client
/// decodes codes it does not know (from a newer server) instead of failing on them.
public struct APIErrorCode: ErrorCode, ExpressibleByStringLiteral, CustomStringConvertible {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public init(stringLiteral value: String) { rawValue = value }
    public var description: String { rawValue }

    // Requests
    /// The body is not the JSON the endpoint takes (400).
    public static let malformed: APIErrorCode = "malformed"
    /// The body is over the endpoint's limit (413), or the request head over the server's (431).
    public static let tooLarge: APIErrorCode = "too-large"
    /// No such route (404).
    public static let notFound: APIErrorCode = "not-found"
    /// The method is not one the route takes (405).
    public static let methodNotAllowed: APIErrorCode = "method-not-allowed"

    // Grants
    /// The purchase was refunded or revoked (403).
    public static let revoked: APIErrorCode = "revoked"
    /// No content is published for the product or the asked version (404).
    public static let noContent: APIErrorCode = "no-content"
    /// A content request's `If-Match` or `If-Unmodified-Since` does not hold (412).
    public static let preconditionFailed: APIErrorCode = "precondition-failed"
    /// The receipt holds no purchase with the asked transaction or product id (404).
    public static let notInReceipt: APIErrorCode = "not-in-receipt"

    // Storage and administration
    /// The catalog or data folder cannot be written (503).
    public static let storage: APIErrorCode = "storage"
    /// The data folder is full (507).
    public static let insufficientStorage: APIErrorCode = "insufficient-storage"
    /// The admin API is off (403) or the token is wrong (401).
    public static let adminDisabled: APIErrorCode = "admin-disabled"
    public static let unauthorized: APIErrorCode = "unauthorized"
    /// An uploaded manifest is not valid (400).
    public static let invalidManifest: APIErrorCode = "invalid-manifest"
    /// An upload's multipart body is malformed, or has unknown parts (400).
    public static let invalidMultipart: APIErrorCode = "invalid-multipart"
    /// An upload ended before its declared length (400).
    public static let uploadInterrupted: APIErrorCode = "upload-interrupted"
    /// An uploaded archive is invalid (400).
    public static let invalidArchive: APIErrorCode = "invalid-archive"
    /// The version is not newer than the latest, or other bytes are published under it (409).
    public static let conflict: APIErrorCode = "conflict"
    /// The archive or manifest on this server is not the one published (503): the operator is
    /// told in the log; `iap-server check` lists such files, and publishing the archive again repairs it.
    public static let archiveDamaged: APIErrorCode = "archive-damaged"
    /// `/readyz`: the catalog cannot be read or a published archive is missing (503).
    public static let notReady: APIErrorCode = "not-ready"
}

/// An error as the API carries it.
public typealias APIError = CodedError<APIErrorCode>

extension CodedError {
    /// This error under the API's codes (the raw value is kept: library codes are API codes).
    public var apiError: APIError { APIError(APIErrorCode(rawValue: code.rawValue), message) }
}

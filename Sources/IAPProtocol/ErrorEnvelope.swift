import Foundation

/// How every error travels: `{"error": {"code": "...", "message": "..."}}`, in the server's
/// answers and in the command-line tools' `--json` output.
public struct ErrorEnvelope: Codable, Sendable, Equatable {
    public struct Body: Codable, Sendable, Equatable {
        public let code: String
        public let message: String
    }

    public let error: Body

    public init(code: String, message: String) {
        error = Body(code: code, message: message)
    }

    /// The code, typed; nil for a code this client does not know (a newer server's).
    public func code<Code: ErrorCode>(as type: Code.Type = APIErrorCode.self) -> Code? {
        Code(rawValue: error.code)
    }

    /// Reads an error body. Anything that is not an envelope (a proxy's HTML page, say) becomes
    /// `fallbackCode` with the first 200 bytes of the body as the message, so the reason reaches
    /// the user either way.
    public static func read<Bytes: Collection<UInt8>>(_ bytes: Bytes, fallbackCode: String = "") -> ErrorEnvelope {
        if let envelope = try? JSONDecoder().decode(ErrorEnvelope.self, from: Data(bytes)) { return envelope }
        return ErrorEnvelope(code: fallbackCode, message: String(decoding: bytes.prefix(200), as: UTF8.self))
    }
}

/// A stable, machine-readable error code: the `code` of an error envelope and of every error the
/// libraries throw. Raw values are lowercase words joined by `-`, e.g. `no-content`.
public protocol ErrorCode: RawRepresentable<String>, Hashable, Codable, Sendable {}

/// The one error shape of the project: a code programs branch on and a message people act on.
///
/// Each library names its codes (`ArchiveErrorCode`, `VerificationErrorCode`, …) and throws
/// `CodedError` of them, so every error prints, encodes and crosses the wire the same way.
/// The message names the problem and, where there is one, the fix; it never echoes a secret.
public struct CodedError<Code: ErrorCode>: Error, Sendable, Hashable, Codable, CustomStringConvertible {
    /// Which failure it was; stable for programs, HTTP status mapping and exit codes.
    public let code: Code
    /// A sentence naming the problem and the fix.
    public let message: String

    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { message }

    /// Another library's error under this family of codes: the same code where this family has
    /// it (codes are shared words such as `io` or `not-found`), else `fallback`; the message stays.
    public init<Other: ErrorCode>(_ other: CodedError<Other>, or fallback: Code) {
        self.init(Code(rawValue: other.code.rawValue) ?? fallback, other.message)
    }
}

extension CodedError {
    /// The error as the API and the tools' `--json` output carry it.
    public var envelope: ErrorEnvelope { ErrorEnvelope(code: code.rawValue, message: message) }
}

/// An error from packing, reading, verifying or extracting a content archive.
///
/// Every error names what went wrong and how to fix it; ``code`` tells callers (and the
/// command-line tools' exit codes) which kind of failure it was.
public struct ArchiveError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The kind of failure, stable for programs to branch on.
    public enum Code: String, Sendable, Equatable, Codable {
        /// The input (folder, flags, product id, version, plist) is not acceptable.
        case invalidInput = "invalid-input"
        /// The archive would exceed the size cap.
        case capExceeded = "cap-exceeded"
        /// Reading or writing a file failed (permissions, disk full, missing folder).
        case io = "io"
        /// An archive is malformed, corrupt, unsafe, or does not match its manifest.
        case corrupt = "corrupt"
    }

    public let code: Code
    /// A sentence naming the problem and, where there is one, the fix.
    public let message: String

    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { message }

    static func invalid(_ message: String) -> ArchiveError { .init(.invalidInput, message) }
    static func corrupt(_ message: String) -> ArchiveError { .init(.corrupt, message) }
    static func io(_ message: String) -> ArchiveError { .init(.io, message) }
}

import IAPProtocol

/// The kind of failure in packing, reading, verifying or extracting a content archive; stable
/// for programs (and the command-line tools' exit codes) to branch on.
public enum ArchiveErrorCode: String, ErrorCode {
    /// The input (folder, flags, product id, version, plist) is not acceptable.
    case invalidInput = "invalid-input"
    /// The archive would exceed the size cap.
    case capExceeded = "cap-exceeded"
    /// Reading or writing a file failed (permissions, disk full, missing folder).
    case io = "io"
    /// An archive is malformed, corrupt, unsafe, or does not match its manifest.
    case corrupt = "corrupt"
}

/// An error from packing, reading, verifying or extracting a content archive: every one names
/// what went wrong and how to fix it.
public typealias ArchiveError = CodedError<ArchiveErrorCode>

extension CodedError where Code == ArchiveErrorCode {
    static func invalid(_ message: String) -> ArchiveError { .init(.invalidInput, message) }
    static func corrupt(_ message: String) -> ArchiveError { .init(.corrupt, message) }
    static func io(_ message: String) -> ArchiveError { .init(.io, message) }
}

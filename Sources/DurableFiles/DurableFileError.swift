import IAPProtocol

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Why a durable file operation failed.
public enum DurableFileErrorCode: String, ErrorCode {
    /// A read, write, sync or rename failed (permissions, a full disk, a missing folder).
    case io
    /// A lock could not be taken (another process holds it, or locking is not possible here).
    case locked
    /// The file to create exists already.
    case exists
}

public typealias DurableFileError = CodedError<DurableFileErrorCode>

/// The C library's sentence for an `errno` value, e.g. "No space left on device".
public func errnoDescription(_ code: Int32) -> String {
    String(cString: strerror(code))
}

/// "cannot <action> <path>: <reason>; <the fix>": the one wording of a failed system call on a
/// file, naming the fix for the common `errno` values.
public func ioFailureMessage(_ code: Int32, action: String, path: String) -> String {
    let reason = errnoDescription(code)
    return switch code {
    case EACCES, EPERM: "cannot \(action) \(path): \(reason); fix its permissions (for example chmod u+rw) or choose another path"
    case ENOSPC, EDQUOT, EFBIG: "cannot \(action) \(path): \(reason); free disk space (or raise the file size limit) and try again"
    case EROFS: "cannot \(action) \(path): the file system is read-only; choose a writable location"
    case ENOENT: "cannot \(action) \(path): it does not exist; check the path"
    case ENOTDIR: "cannot \(action) \(path): part of the path is not a folder; check the path"
    default: "cannot \(action) \(path): \(reason)"
    }
}

extension DurableFileError {
    static func io(_ action: String, _ path: String, errno code: Int32) -> DurableFileError {
        DurableFileError(.io, ioFailureMessage(code, action: action, path: path))
    }
}

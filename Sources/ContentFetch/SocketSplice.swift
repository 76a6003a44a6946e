import SystemPackage

#if canImport(Glibc)
    import CLinuxWriteback
    import Glibc
#endif

/// Moves body bytes from the socket into the partial file through a pipe (`splice(2)`), so they
/// are copied once, into the page cache, instead of twice (socket to buffer, buffer to file).
///
/// Written by hand because no library offers it: on two cores the reader's second copy competes
/// with SHA-256 for the same CPU, and a one-connection transfer took 0.93-1.23 s instead of
/// 1.09-1.26 s per GiB with it in a C reference client (docs/performance.md, "One copy fewer").
/// Linux only; where the kernel or the file system cannot splice, the reader goes back to
/// reading into its buffer (``Moved/unsupported(bytes:)``).
final class SocketSplice {
    /// Bytes moved per call: the pipe's size.
    static let size = 1 << 20
    private let pipeRead: Int32
    private let pipeWrite: Int32

    /// What one ``move(from:to:at:upTo:end:buffer:socketError:)`` did.
    enum Moved {
        /// This many bytes are in the file (0: the peer closed the connection).
        case bytes(Int)
        /// The kernel cannot splice this socket or into this file: the caller reads from now on;
        /// `bytes` are in the file already.
        case unsupported(bytes: Int)
    }

    /// A pipe of ``size`` bytes, or nil where none can be made (the caller reads instead).
    init?() {
        #if os(Linux)
            // The default 64 KiB pipe costs sixteen times the calls; a host whose limit is lower
            // (fs.pipe-max-size) keeps what it allows.
            var ends: (Int32, Int32) = (-1, -1)
            guard withUnsafeMutableBytes(of: &ends, { cwriteback_pipe($0.baseAddress!.assumingMemoryBound(to: Int32.self), Int32(Self.size)) }) == 0 else { return nil }
            (pipeRead, pipeWrite) = ends
        #else
            return nil
        #endif
    }

    deinit {
        Glibc.close(pipeRead)
        Glibc.close(pipeWrite)
    }

    /// Moves up to `limit` bytes from `socket` into `file` at `position`. `socketError` names a
    /// failed read; bytes past `end` throw, as ``BodyPacing/write(_:to:at:end:)`` does; `buffer`
    /// carries what is already in the pipe when the file cannot take a splice.
    func move(
        from socket: Int32, to file: SystemPackage.FileDescriptor, at position: Int64, upTo limit: Int, end: Int64, buffer: UnsafeMutableRawBufferPointer,
        socketError: (String) -> Error
    ) throws -> Moved {
        #if os(Linux)
            var taken: Int
            while true {
                taken = Int(cwriteback_splice(socket, nil, pipeWrite, nil, UInt(limit)))
                if taken >= 0 { break }
                if errno == EINTR { continue }
                if errno == EINVAL || errno == ENOSYS { return .unsupported(bytes: 0) }
                throw socketError("read")
            }
            guard taken > 0 else { return .bytes(0) }
            guard position + Int64(taken) <= end else { throw BodyPacing.pastEnd(end) }
            var offset = position
            var left = taken
            while left > 0 {
                let moved = cwriteback_splice(pipeRead, nil, file.rawValue, &offset, UInt(left))
                if moved > 0 {
                    left -= Int(moved)
                    continue
                }
                if moved < 0, errno == EINTR { continue }
                guard moved < 0, errno == EINVAL || errno == ENOSYS else {
                    throw BodyPacing.cannotWrite(String(cString: strerror(moved < 0 ? errno : EIO)))
                }
                // The file system cannot take a splice: the bytes already in the pipe go the long
                // way, and the caller reads from now on.
                try drain(left, to: file, at: offset, through: buffer)
                return .unsupported(bytes: taken)
            }
            return .bytes(taken)
        #else
            return .unsupported(bytes: 0)
        #endif
    }

    private func drain(_ count: Int, to file: SystemPackage.FileDescriptor, at start: Int64, through buffer: UnsafeMutableRawBufferPointer) throws {
        var left = count
        var position = start
        while left > 0 {
            let n = Glibc.read(pipeRead, buffer.baseAddress, min(left, buffer.count))
            if n < 0, errno == EINTR { continue }
            guard n > 0 else { throw FetchError(.install, "cannot write the partial download: the pipe ended early") }
            try BodyPacing.write(UnsafeRawBufferPointer(rebasing: buffer[0..<n]), to: file, at: position, end: position + Int64(n))
            position += Int64(n)
            left -= n
        }
    }
}

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Copies a file in large sequential writes, for a file that is served from the page cache
/// right after it is made (an archive published into the store).
///
/// Written by hand rather than with `FileManager.copyItem` or `copy_file_range` (which ext4
/// without reflinks carries out as splices through a 64 KiB pipe): the page cache keeps a file's
/// bytes in folios as large as the writes that made them, and sendfile looks every folio up again
/// for each response. Serving the same archive, nginx spent 9% of its CPU on page-cache lookups
/// (`filemap_get_read_batch`, `filemap_splice_read`) when `copyItem` had made the copy, 4% after
/// `cp` (`copy_file_range`), 1.5% after 8 MiB writes (docs/performance.md). Memory stays flat:
/// one buffer of ``chunkSize``.
public enum LargeWriteCopy {
    /// Bytes read and written per call: large enough for the kernel's largest folios (2 MiB).
    public static let chunkSize = 8 << 20

    /// Copies `source` to a new file at `destination` (created with `permissions`; it must not
    /// exist), calling `created` once the destination exists (to lock it, say). On failure the
    /// partial destination is removed and the error names the file and the fix.
    public static func copy(
        from source: String, to destination: String, permissions: mode_t = 0o644, created: () -> Void = {}
    ) throws(DurableFileError) {
        let input = open(source, O_RDONLY | O_CLOEXEC)
        guard input >= 0 else { throw .io("read", source, errno: errno) }
        defer { close(input) }
        let output = open(destination, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, permissions)
        guard output >= 0 else { throw .io("create", destination, errno: errno) }
        created()
        var failure: DurableFileError?
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: chunkSize, alignment: 4096)
        defer { buffer.deallocate() }
        _ = posix_fadvise(input, 0, 0, POSIX_FADV_SEQUENTIAL)
        while true {
            let count = read(input, buffer.baseAddress, chunkSize)
            if count < 0 {
                if errno == EINTR { continue }
                failure = .io("read", source, errno: errno)
                break
            }
            if count == 0 { break }
            let code = writeFully(output, UnsafeRawBufferPointer(rebasing: buffer[0..<count]))
            if code != 0 {
                failure = .io("write", destination, errno: code)
                break
            }
        }
        if close(output) != 0, failure == nil { failure = .io("write", destination, errno: errno) }
        if let failure {
            unlink(destination)
            throw failure
        }
    }
}

import NIOCore

/// Bytes that arrive in pieces (an admin upload, an archive fetched from another replica),
/// gathered into writes of ``size`` for the file the store will serve.
///
/// Why: the page cache keeps a file in folios as large as the writes that made them, and
/// `sendfile` looks every folio up again for each response. A replica's copy of an archive
/// written in the pieces AsyncHTTPClient hands over cost 1.15x the uploaded copy's CPU per GiB
/// across a link, 1.03x gathered (`tools/bench-peer-copy.sh`, docs/performance.md, twenty-fourth
/// stop; see also `LargeWriteCopy`). One buffer of at most ``size`` per file being written.
final class GatheredWrites<Failure: Error> {
    static var size: Int { 4 << 20 }
    private let write: (ByteBuffer) throws(Failure) -> Void
    private var pending = ByteBuffer()

    /// `write` writes one buffer whole to the file, or throws the caller's error naming the fix.
    init(write: @escaping (ByteBuffer) throws(Failure) -> Void) {
        self.write = write
    }

    /// Adds `chunk`. Every write but the last is a whole number of ``size`` blocks, so each starts
    /// at a multiple of ``size`` in the file: a folio starts where its size divides the offset, and
    /// writes that straddle those boundaries would be kept in smaller ones.
    func append(_ chunk: ByteBuffer) throws(Failure) {
        var rest = chunk
        while rest.readableBytes > 0 {
            if pending.readableBytes == 0, rest.readableBytes >= Self.size {
                // Whole blocks straight from the piece, without a copy.
                try write(rest.readSlice(length: rest.readableBytes / Self.size * Self.size)!)
                continue
            }
            var part = rest.readSlice(length: min(Self.size - pending.readableBytes, rest.readableBytes))!
            pending.writeBuffer(&part)
            if pending.readableBytes == Self.size { try flush() }
        }
    }

    /// Writes what is gathered; call it once the last piece has arrived.
    func flush() throws(Failure) {
        guard pending.readableBytes > 0 else { return }
        try write(pending)
        pending.clear()
    }
}

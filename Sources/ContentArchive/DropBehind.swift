#if canImport(Glibc)
    import Glibc
#endif

/// Which of a file's pages to let the page cache go of as a point moves through the file: a
/// reader's offset, a hash's frontier, how far write-back has been started.
///
/// Why let them go: on virtual machines that give free memory back to their host, writing into
/// pages the kernel hands out fresh cost up to four times the CPU of writing into pages just
/// freed, and a file read or written once holds pages nobody needs again (docs/performance.md,
/// "Write-behind"). The download's body (`WriteBehind` in ContentFetch), an install's read of its
/// archive (``ArchiveReader/read(_:stored:once:into:)``) and its written files (`Writeback`) use
/// this one rule.
///
/// Pages go a step at a time, and each range given covers the step before it again: the kernel
/// skips pages still dirty or under write-back, which are clean by the next call, and a large
/// folio across a step's end is dropped only by a call that holds all of it.
package struct DropBehind: Sendable {
    /// Bytes the point moves between two ranges.
    package let step: Int64
    /// Nothing before this is the caller's to drop.
    private let origin: Int64
    /// Pages before this were given to drop.
    private var released: Int64

    /// For the bytes of a file from `origin` on, dropped `step` bytes at a time.
    package init(from origin: Int64, step: Int64) {
        precondition(step > 0, "a drop step is a positive number of bytes")
        self.step = step
        self.origin = origin
        released = origin
    }

    /// The point is now at `through`: the pages to drop, once a step has passed since the last
    /// range given, else nil.
    package mutating func advance(to through: Int64) -> Range<Int64>? {
        guard through - released >= step else { return nil }
        defer { released = through }
        return max(origin, released - step)..<through
    }

    /// The point stops at `end` (the last read is done): the pages left to drop, the step before
    /// included; empty if there are none.
    package mutating func finish(at end: Int64) -> Range<Int64> {
        let from = max(origin, released - step)
        released = max(released, end)
        return from..<max(from, end)
    }

    /// Asks the page cache to let go of `range` of `fd`'s pages (Linux; elsewhere nothing). Only
    /// clean pages go: nothing here can lose or change a byte, and a page dropped is read from the
    /// disk again when needed.
    package static func release(_ range: Range<Int64>, of fd: Int32) {
        #if os(Linux)
            if !range.isEmpty { _ = posix_fadvise(fd, off_t(range.lowerBound), off_t(range.count), POSIX_FADV_DONTNEED) }
        #endif
    }
}

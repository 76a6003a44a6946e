import CLinuxWriteback
import ContentArchive
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// How far the archive's SHA-256 has read the partial file: written by the fetcher as it hashes,
/// read by the body sources' threads to know which pages they may let go of.
final class HashFrontier: Sendable {
    private let hashed = Atomic<Int64>(0)

    /// Bytes from the file's start that are hashed.
    var value: Int64 { hashed.load(ordering: .acquiring) }

    func store(_ value: Int64) { hashed.store(value, ordering: .releasing) }
}

/// Sends a body's pages to disk soon after they are written and lets the page cache drop them
/// once the hash has read them, so that a download keeps a few MiB of page cache rather than the
/// whole archive.
///
/// Why: every page of a new file is memory the kernel hands out fresh, and on virtual machines
/// (which give free memory back to the host) writing into such pages cost up to four times as
/// much CPU as writing into pages just freed: the one-connection transfer's copy into the page
/// cache took 0.27-0.41 s per GiB in most runs and 0.61-1.41 s in others, and curl meets the
/// same pages (docs/performance.md, "Write-behind"). Pages freed here are the next ones written
/// into. The usual pattern for streaming writes on Linux: `sync_file_range` to start writeback
/// of what was just written, `POSIX_FADV_DONTNEED` on what was written back (elsewhere nothing
/// is done).
///
/// Only clean pages are dropped (the call skips dirty ones and those under writeback), so where
/// the disk does not keep up they stay cached, as before. Nothing here can lose or change a
/// byte: a dropped page is read from disk again when needed (the install reads the archive once,
/// from disk: `ArchiveReader.read(_:stored:once:into:)`).
struct WriteBehind {
    /// Writeback starts for each step written, and pages are dropped a step at a time.
    static let step: Int64 = 8 << 20
    /// Pages are dropped only once their writeback started this much writing ago: by then a
    /// disk that keeps up has written them, and the call finds them clean.
    static let lag: Int64 = 16 << 20

    /// Work to do outside any lock: one writeback start and one drop, either possibly empty.
    struct Work {
        let fd: Int32
        let start: Range<Int64>
        let release: Range<Int64>

        func run() {
            #if os(Linux)
                if !start.isEmpty { _ = sync_file_range(fd, start.lowerBound, Int64(start.count), cwriteback_start) }
            #endif
            DropBehind.release(release, of: fd)
        }
    }

    private let fd: Int32
    private let frontier: HashFrontier?
    /// Writeback is started for bytes before this.
    private var started: Int64
    /// Which hashed pages to drop, a step at a time.
    private var drops: DropBehind

    /// For a body written from `from` into `fd`; without a frontier (a delta update, whose
    /// ranges are not hashed whole) pages are written back early but never dropped.
    init(fd: Int32, from: Int64, frontier: HashFrontier?) {
        self.fd = fd
        self.frontier = frontier
        started = from
        drops = DropBehind(from: from, step: Self.step)
    }

    /// Bytes are written up to `position`; returns what to do, if anything is due.
    mutating func wrote(through position: Int64) -> Work? {
        guard position - started >= Self.step else { return nil }
        let start = started..<position
        started = position
        let release = frontier.flatMap { drops.advance(to: min($0.value, started - Self.lag)) } ?? 0..<0
        return Work(fd: fd, start: start, release: release)
    }
}

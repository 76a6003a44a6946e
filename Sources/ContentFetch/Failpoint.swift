import Foundation

/// Crash points for tests: with `IAP_FETCH_KILL_AT=<name>` in the environment the process kills
/// itself with SIGKILL when it reaches that point (`delta-planned`: a delta update's plan saved,
/// nothing fetched; `range-done`: a requested range received in full; `half-recorded`: half the
/// archive or more received and recorded in the journal; `verified`: after the
/// SHA-256 check, before install; `old-version-hidden`: the new version in place, the older one
/// renamed out of sight, not yet removed; `installed`: after install, before the transaction is
/// finished), so a test can stop it
/// exactly where a power cut could. With `IAP_FETCH_STOP_AT=<name>` it stops (SIGSTOP) there
/// instead, for a test to change something at that point (`delta-sources-chosen`: the installed
/// files a delta update reuses chosen, none linked yet). With `IAP_FETCH_REFUSE=<name>` an
/// operation fails there as a kernel this machine does not run could make it fail
/// (`direct-write`: every write around the page cache but one at the file's start refused with `EINVAL`, as
/// by a file system that opens files for direct I/O but takes no writes of 4096-byte blocks, the
/// partial archive's and the installed files' (ContentArchive's `BufferedFileWriter` reads it too);
/// `extraction`: the extraction as the archive arrives given up half-way, as a file it cannot
/// write would).
/// Without the variables this does nothing.
enum Failpoint {
    static let armed = ProcessInfo.processInfo.environment["IAP_FETCH_KILL_AT"]
    static let stopping = ProcessInfo.processInfo.environment["IAP_FETCH_STOP_AT"]
    static let refusing = ProcessInfo.processInfo.environment["IAP_FETCH_REFUSE"]

    static func refuses(_ name: String) -> Bool { refusing == name }

    /// Whether the process kills or stops itself at `name`: for a point that needs work done first.
    static func isSet(_ name: String) -> Bool { armed == name || stopping == name }

    static func hit(_ name: String) {
        if armed == name { kill(getpid(), SIGKILL) }
        // Stopped, not killed: a test changes something while the process waits at exactly this
        // point, then lets it go on (SIGCONT).
        if stopping == name { kill(getpid(), SIGSTOP) }
    }
}

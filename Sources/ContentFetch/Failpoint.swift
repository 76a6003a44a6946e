import Foundation

/// Crash points for tests: with `IAP_FETCH_KILL_AT=<name>` in the environment the process kills
/// itself with SIGKILL when it reaches that point (`delta-planned`: a delta update's plan saved,
/// nothing fetched; `range-done`: a requested range received in full; `verified`: after the
/// SHA-256 check, before install; `installed`: after install, before the transaction is
/// finished), so a test can stop it
/// exactly where a power cut could. Without the variable this does nothing.
enum Failpoint {
    static let armed = ProcessInfo.processInfo.environment["IAP_FETCH_KILL_AT"]

    static func hit(_ name: String) {
        if armed == name { kill(getpid(), SIGKILL) }
    }
}

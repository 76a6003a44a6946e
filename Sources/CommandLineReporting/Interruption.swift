import DurableFiles
import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Ctrl-C, SIGTERM (a cancelled or timed-out CI job) and SIGHUP (a closed terminal) stop a command
/// without leaving its temporary files behind (``UnfinishedFiles``); the exit status is then 128 +
/// the signal's number, as a shell reports a command killed by it. A signal ignored when the
/// command started (SIGINT for a background job of a script) stays ignored.
public enum Interruption {
    /// Installs the handlers; keep the returned sources alive while the command runs.
    public static func removeUnfinishedFilesOnStop(tool: String) -> [any DispatchSourceSignal] {
        [(SIGINT, "SIGINT"), (SIGTERM, "SIGTERM"), (SIGHUP, "SIGHUP")].compactMap { number, name in
            let previous = signal(number, SIG_IGN)
            if let previous, unsafeBitCast(previous, to: Int.self) == unsafeBitCast(SIG_IGN, to: Int.self) { return nil }
            let source = DispatchSource.makeSignalSource(signal: number, queue: .global())
            source.setEventHandler {
                let removed = UnfinishedFiles.removeAll()
                let what = removed == 0 ? "no unfinished file was left" : "its unfinished files were removed"
                let line = (isatty(STDERR_FILENO) == 1 ? "\n" : "") + "\(tool): stopped by \(name); \(what)\n"
                FileHandle.standardError.write(Data(line.utf8))
                _exit(128 + number)
            }
            source.resume()
            return source
        }
    }
}

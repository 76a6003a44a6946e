import Foundation

/// Standard output and error for the tools. A stream whose reader went away (a closed pipe) is
/// ignored: `FileHandle.write(_:)` traps on EPIPE, which killed a tool whose parent had stopped
/// listening in the middle of saving its state.
public enum Console {
    public static func out(_ data: Data) {
        try? FileHandle.standardOutput.write(contentsOf: data)
    }

    public static func out(_ text: String) {
        out(Data(text.utf8))
    }

    public static func err(_ text: String) {
        try? FileHandle.standardError.write(contentsOf: Data(text.utf8))
    }
}

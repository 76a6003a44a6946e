import ArgumentParser
import Foundation
import IAPProtocol

/// How the command-line tools report, all four alike: an error is one line on stderr,
/// `<tool>: error: <message>`, plus the error envelope (`{"error": {"code", "message"}}`) on
/// stdout under `--json`; the process then exits with the code the tool documents.
public struct Reporter: Sendable {
    public let tool: String
    /// Whether stdout carries JSON.
    public let json: Bool

    public init(tool: String, json: Bool = false) {
        self.tool = tool
        self.json = json
    }

    /// Reports `error`; throw the result to exit with `exitCode`.
    public func failure<Code: ErrorCode>(_ error: CodedError<Code>, exitCode: Int32 = 1) -> ExitCode {
        report(code: error.code.rawValue, message: error.message, exitCode: exitCode)
    }

    /// Reports a failure that no library error describes (a flag's value, a missing file).
    public func failure(_ code: String, _ message: String, exitCode: Int32 = 1) -> ExitCode {
        report(code: code, message: message, exitCode: exitCode)
    }

    /// Runs `body`; a `CodedError` it throws is reported and exits with `exitCode(error)`.
    public func run<Code: ErrorCode>(
        exitCode: (CodedError<Code>) -> Int32 = { _ in 1 },
        _ body: () throws(CodedError<Code>) -> Void
    ) throws(ExitCode) {
        do { try body() } catch { throw failure(error, exitCode: exitCode(error)) }
    }

    /// One line on stderr, for what is not an error (progress, notices).
    public func note(_ message: String) {
        Console.err("\(tool): \(message)\n")
    }

    /// One JSON value as one line on stdout.
    public func printJSON<T: Encodable>(_ value: T) {
        Console.out(WireJSON.line(value))
    }

    private func report(code: String, message: String, exitCode: Int32) -> ExitCode {
        if json { printJSON(ErrorEnvelope(code: code, message: message)) }
        Console.err("\(tool): error: \(message)\n")
        return ExitCode(exitCode)
    }
}

import Foundation

/// The folder that holds the built executables (beside the test bundle).
public func productsDirectory() -> String {
    var url = URL(fileURLWithPath: CommandLine.arguments[0]).resolvingSymlinksInPath()
    for _ in 0..<4 {
        url.deleteLastPathComponent()
        if FileManager.default.isExecutableFile(atPath: url.path + "/iap-server") { return url.path }
    }
    return FileManager.default.currentDirectoryPath + "/.build/debug"
}

/// A fresh temporary folder, removed when the value is released.
public final class TemporaryFolder: @unchecked Sendable {
    public let path: String

    public init() throws {
        path = FileManager.default.temporaryDirectory.path + "/iap-tests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
    }

    /// A folder on a disk-backed file system: the build folder (the system's temporary folder
    /// may be a tmpfs, whose pages are the files themselves and never leave the page cache).
    public init(onDisk: Void) throws {
        path = FileManager.default.currentDirectoryPath + "/.build/iap-tests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
    }

    /// A folder under `parent` (`/dev/shm`, a tmpfs, say).
    public init(in parent: String) throws {
        path = parent + "/iap-tests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
    }

    deinit { try? FileManager.default.removeItem(atPath: path) }

    public func sub(_ name: String) -> String { path + "/" + name }

    @discardableResult
    public func write(_ relative: String, _ contents: String) throws -> String {
        try write(relative, Data(contents.utf8))
    }

    @discardableResult
    public func write(_ relative: String, _ data: Data) throws -> String {
        let full = sub(relative)
        try FileManager.default.createDirectory(atPath: (full as NSString).deletingLastPathComponent, withIntermediateDirectories: true)
        try data.write(to: URL(fileURLWithPath: full))
        return full
    }

    /// The names in a sub-folder, sorted; empty when it does not exist.
    public func files(in relative: String) -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: sub(relative))) ?? []).sorted()
    }
}

public struct ServerError: Error, CustomStringConvertible { public let description: String }

/// `iap-server serve` (or another tool's `serve`) as a child process on a free port.
public final class ServerProcess: @unchecked Sendable {
    public let process = Process()
    public let port: Int
    public let log: String
    public var base: String { "http://127.0.0.1:\(port)" }

    /// Starts the server on a free port, or (with `fixedPort`) on the `--port` in `arguments`;
    /// `launcher` runs it through another program, e.g. `setpriv` to drop privileges. `tool` and
    /// `dataFlag` start another server, e.g. `iap-sandbox serve --dir`.
    public init(
        data: String, arguments: [String], folder: TemporaryFolder, fixedPort: Bool = false, launcher: [String] = [],
        tool: String = "iap-server", dataFlag: String = "--data", environment: [String: String] = [:]
    ) throws {
        let portFile = folder.sub("port-\(UUID().uuidString)")
        log = folder.sub("server-\(UUID().uuidString).log")
        _ = FileManager.default.createFile(atPath: log, contents: nil)
        let serve = ["serve", dataFlag, data] + (fixedPort ? [] : ["--port", "0"]) + ["--port-file", portFile] + arguments
        if launcher.isEmpty {
            process.executableURL = URL(fileURLWithPath: productsDirectory() + "/" + tool)
            process.arguments = serve
        } else {
            process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
            process.arguments = launcher + [productsDirectory() + "/" + tool] + serve
        }
        if !environment.isEmpty { process.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 } }
        // One handle for both streams, appending: two handles of their own would each write from
        // offset 0 and overwrite each other's lines, which tests look for in the log.
        let output = FileHandle(fileDescriptor: open(log, O_WRONLY | O_APPEND | O_CLOEXEC), closeOnDealloc: true)
        process.standardOutput = output
        process.standardError = output
        try process.run()
        // Wait (bounded) for the server to report its port.
        let deadline = Date().addingTimeInterval(30)
        var found: Int?
        while found == nil && Date() < deadline && process.isRunning {
            found = (try? String(contentsOfFile: portFile, encoding: .utf8)).flatMap { Int($0) }
            if found == nil { usleep(20_000) }
        }
        guard let found else {
            forceStop(process)
            throw ServerError(description: "the server did not start: \((try? String(contentsOfFile: log, encoding: .utf8)) ?? "")")
        }
        port = found
    }

    /// SIGTERM, then waits (bounded) and returns the exit status.
    public func stop() -> Int32 {
        guard process.isRunning else { return process.terminationStatus }
        kill(process.processIdentifier, SIGTERM)
        let deadline = Date().addingTimeInterval(20)
        while process.isRunning && Date() < deadline { usleep(20_000) }
        if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        process.waitUntilExit()
        return process.terminationStatus
    }

    /// ``stop()``, then holds the port (see ``holdPort(_:)``), for a test that connects to it
    /// while the server is down: refused, never another test's server.
    public func stopKeepingPort() throws -> Int32 {
        let status = stop()
        try holdPort(port)
        return status
    }

    /// Kills the server without warning (a crash, a lost machine) and holds its port (see
    /// ``holdPort(_:)``) so that no other test's server takes it before this test starts one
    /// there again: meanwhile connecting to it is refused, as to a server that is down.
    public func killKeepingPort() throws {
        kill(process.processIdentifier, SIGKILL)
        process.waitUntilExit()
        try holdPort(port)
    }

    deinit { if process.isRunning { kill(process.processIdentifier, SIGKILL) } }
}

public struct HTTPResult {
    public let status: Int
    public let headers: [String: String]
    public let body: Data
    /// What curl said on standard error (why it failed, when `status` is 0).
    public var curlError = ""
    public var text: String { String(decoding: body, as: UTF8.self) }
    public var json: [String: Any] { (try? JSONSerialization.jsonObject(with: body)) as? [String: Any] ?? [:] }
    public var errorCode: String? { (json["error"] as? [String: Any])?["code"] as? String }
}

/// One request with the real curl; returns the last response's status, headers and body.
public func curl(_ arguments: [String], folder: TemporaryFolder) throws -> HTTPResult {
    let id = UUID().uuidString
    let headersPath = folder.sub("h-\(id)"), bodyPath = folder.sub("b-\(id)"), errorPath = folder.sub("e-\(id)")
    defer {
        for path in [headersPath, bodyPath, errorPath] { try? FileManager.default.removeItem(atPath: path) }
    }
    let process = Process()
    process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
    process.arguments = ["curl", "-s", "-S", "--max-time", "60", "-D", headersPath, "-o", bodyPath, "-w", "%{http_code}"] + arguments
    let outPath = folder.sub("o-\(id)")
    _ = FileManager.default.createFile(atPath: outPath, contents: nil)
    defer { try? FileManager.default.removeItem(atPath: outPath) }
    process.standardOutput = FileHandle(forWritingAtPath: outPath)
    _ = FileManager.default.createFile(atPath: errorPath, contents: nil)
    process.standardError = FileHandle(forWritingAtPath: errorPath)
    try process.run()
    process.waitUntilExit()
    let status = Int((try? String(contentsOfFile: outPath, encoding: .utf8)) ?? "") ?? 0
    var headers: [String: String] = [:]
    let raw = (try? String(contentsOfFile: headersPath, encoding: .utf8)) ?? ""
    let blocks = raw.components(separatedBy: "\r\n\r\n").filter { !$0.isEmpty }
    for line in (blocks.last ?? "").components(separatedBy: "\r\n").dropFirst() {
        guard let colon = line.firstIndex(of: ":") else { continue }
        headers[line[..<colon].lowercased()] = line[line.index(after: colon)...].trimmingCharacters(in: .whitespaces)
    }
    let body = FileManager.default.contents(atPath: bodyPath) ?? Data()
    let error = (try? String(contentsOfFile: errorPath, encoding: .utf8)) ?? ""
    return HTTPResult(status: status, headers: headers, body: body, curlError: error.trimmingCharacters(in: .whitespacesAndNewlines))
}

public func postJSON(_ url: String, _ object: [String: Any], headers: [String] = [], folder: TemporaryFolder) throws -> HTTPResult {
    let data = try JSONSerialization.data(withJSONObject: object)
    let path = folder.sub("req-\(UUID().uuidString).json")
    try data.write(to: URL(fileURLWithPath: path))
    defer { try? FileManager.default.removeItem(atPath: path) }
    return try curl(["-X", "POST", "-H", "Content-Type: application/json"] + headers.flatMap { ["-H", $0] } + ["--data-binary", "@" + path, url], folder: folder)
}

/// Sends raw bytes on one connection and returns everything the server sent until it closed.
public func rawExchange(port: Int, _ request: String, folder: TemporaryFolder) throws -> String {
    let script = folder.sub("raw-\(UUID().uuidString).py")
    try """
    import socket, sys
    s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=20)
    s.sendall(sys.stdin.buffer.read())
    data = b''
    while True:
        chunk = s.recv(65536)
        if not chunk: break
        data += chunk
    sys.stdout.buffer.write(data)
    """.write(toFile: script, atomically: true, encoding: .utf8)
    let input = folder.sub("raw-in-\(UUID().uuidString)"), output = folder.sub("raw-out-\(UUID().uuidString)")
    try Data(request.utf8).write(to: URL(fileURLWithPath: input))
    _ = FileManager.default.createFile(atPath: output, contents: nil)
    let process = Process()
    process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
    process.arguments = ["python3", script, String(port)]
    process.standardInput = FileHandle(forReadingAtPath: input)
    process.standardOutput = FileHandle(forWritingAtPath: output)
    try process.run()
    process.waitUntilExit()
    return (try? String(contentsOfFile: output, encoding: .isoLatin1)) ?? ""
}

/// Starts a program in the background (a bare name is looked up on the PATH); its output is
/// discarded unless a `FileHandle` or a `Pipe` is given (a `Pipe`'s write end is then closed in
/// this process, so its reader sees the end). The caller waits for it or kills it.
public func launch(
    _ executable: String, _ arguments: [String], environment: [String: String]? = nil,
    stdout: Any? = nil, stderr: Any? = nil, stdin: Any? = nil
) throws -> Process {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: executable.hasPrefix("/") ? executable : "/usr/bin/env")
    process.arguments = executable.hasPrefix("/") ? arguments : [executable] + arguments
    if let environment { process.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 } }
    process.standardOutput = stdout ?? FileHandle.nullDevice
    process.standardError = stderr ?? FileHandle.nullDevice
    if let stdin { process.standardInput = stdin }
    try process.run()
    return process
}

/// Ends a helper process for good and waits for it. Children inherit the test process's signal
/// mask, in which SIGTERM is blocked, so `Process.terminate()` never reached programs that do
/// not unblock it themselves (a Python proxy outlived every test run that started it).
public func forceStop(_ process: Process) {
    if process.isRunning { kill(process.processIdentifier, SIGKILL) }
    process.waitUntilExit()
}

/// Runs a program until `seen()` holds (checked every millisecond, for at most a minute), then
/// sends it `signal` and waits for it to exit; stderr goes to `stderrPath`. Returns false when
/// the program ended before `seen()` held: the moment to interrupt it was missed.
public func interrupt(
    _ executable: String, _ arguments: [String], with signal: Int32, stderrPath: String, when seen: () -> Bool
) throws -> (caught: Bool, process: Process) {
    _ = FileManager.default.createFile(atPath: stderrPath, contents: nil)
    let stderr = FileHandle(forWritingAtPath: stderrPath)!
    defer { try? stderr.close() }
    let process = try launch(executable, arguments, stderr: stderr)
    let deadline = Date().addingTimeInterval(60)
    while process.isRunning && Date() < deadline && !seen() { usleep(1000) }
    let caught = process.isRunning
    kill(process.processIdentifier, signal)
    process.waitUntilExit()
    return (caught, process)
}

public struct ProcessResult: Sendable {
    public let status: Int32
    public let stdout: String
    public let stderr: String
    /// stdout as a JSON array (nil when it is not one): what a `--json` listing printed.
    public var jsonArray: [Any]? { (try? JSONSerialization.jsonObject(with: Data(stdout.utf8))) as? [Any] }
}

/// Runs a program to completion; output goes through files, so a chatty child never blocks.
@discardableResult
public func run(_ executable: String, _ arguments: [String], stdin: String? = nil, environment: [String: String]? = nil) throws -> ProcessResult {
    let base = FileManager.default.temporaryDirectory.path + "/iap-run-" + UUID().uuidString
    for ext in [".out", ".err"] { _ = FileManager.default.createFile(atPath: base + ext, contents: nil) }
    _ = FileManager.default.createFile(atPath: base + ".in", contents: Data((stdin ?? "").utf8))
    defer { for ext in [".out", ".err", ".in"] { try? FileManager.default.removeItem(atPath: base + ext) } }
    let out = FileHandle(forWritingAtPath: base + ".out")!, err = FileHandle(forWritingAtPath: base + ".err")!
    let process = try launch(
        executable, arguments, environment: environment, stdout: out, stderr: err,
        stdin: FileHandle(forReadingAtPath: base + ".in"))
    process.waitUntilExit()
    try? out.close()
    try? err.close()
    return ProcessResult(
        status: process.terminationStatus,
        stdout: (try? String(contentsOfFile: base + ".out", encoding: .utf8)) ?? "",
        stderr: (try? String(contentsOfFile: base + ".err", encoding: .utf8)) ?? "")
}

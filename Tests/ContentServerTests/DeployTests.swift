import ContentServer
import Foundation
import IAPTestSupport
import Testing

/// The shipped systemd unit and its environment file (deploy/systemd): what an operator installs
/// must be a unit systemd accepts and settings the server takes.
@Suite("The shipped systemd unit and settings", .onTestThreads)
struct DeployTests {
    let deploy = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("deploy/systemd").path

    /// `NAME=value` lines of the environment file, commented out or not.
    func settings(includingCommented: Bool) throws -> [(name: String, value: String)] {
        try String(contentsOfFile: deploy + "/iap-server.env", encoding: .utf8).split(separator: "\n").compactMap { line in
            var text = Substring(line)
            if text.hasPrefix("#") {
                guard includingCommented else { return nil }
                text = text.dropFirst()
            }
            guard let equals = text.firstIndex(of: "="), text[..<equals].allSatisfy({ $0.isUppercase || $0 == "_" }), text.first != " " else { return nil }
            return (String(text[..<equals]), String(text[text.index(after: equals)...]))
        }
    }

    /// A shipped unit written into `tmp` with its installed paths made real (the built server,
    /// the shipped settings) and checked by `systemd-analyze verify`, which must say nothing; its text.
    @discardableResult
    func verifyInstalled(_ name: String, in tmp: TemporaryFolder) throws -> String {
        let unit = try String(contentsOfFile: deploy + "/" + name, encoding: .utf8)
            .replacingOccurrences(of: "/usr/local/bin/iap-server", with: productsDirectory() + "/iap-server")
            .replacingOccurrences(of: "/etc/iap/iap-server.env", with: deploy + "/iap-server.env")
        try tmp.write(name, unit)
        let verified = try run("/usr/bin/systemd-analyze", ["verify", tmp.sub(name)])
        #expect(verified.status == 0 && verified.stderr.isEmpty, "\(name): \(verified.stderr)\(verified.stdout)")
        return unit
    }

    @Test("systemd-analyze verify accepts the unit without a warning (an unknown or misspelt key is one)")
    func unitVerifies() throws {
        try verifyInstalled("iap-server.service", in: try TemporaryFolder())
    }

    @Test("the weekly check's service and timer verify without a warning, and its command runs on the shipped settings")
    func checkUnitsVerify() throws {
        let tmp = try TemporaryFolder()
        let unit = try verifyInstalled("iap-server-check.service", in: tmp)
        try verifyInstalled("iap-server-check.timer", in: tmp)
        // ExecStart as systemd runs it: the settings in the environment, --data from IAP_DATA.
        let command = try #require(unit.split(separator: "\n").first { $0.hasPrefix("ExecStart=") }).dropFirst("ExecStart=".count)
        var environment = Dictionary(try settings(includingCommented: false).map { ($0.name, $0.value) }) { $1 }
        environment["IAP_DATA"] = tmp.sub("data")
        let words = command.split(separator: " ").map { $0 == "${IAP_DATA}" ? tmp.sub("data") : String($0) }
        let none = try run(words[0], Array(words.dropFirst()), environment: environment)
        #expect(none.status == 1 && none.stderr.contains("holds no catalog"), "\(none.stderr)")
        let server = try ServerProcess(data: tmp.sub("data"), arguments: [], folder: tmp, environment: environment)
        #expect(server.stop() == 0)
        let checked = try run(words[0], Array(words.dropFirst()), environment: environment)
        #expect(checked.status == 0 && checked.stdout.hasPrefix("all 0 published version(s) intact"), "\(checked.stdout) \(checked.stderr)")
    }

    @Test("every variable the settings file names is one the server reads, and the server starts on the file's settings")
    func settingsAreTheServers() throws {
        let known = Set(ServerConfiguration.environmentVariables.map(\.0)).union(["LOG_LEVEL", "PGPASSFILE"])
        let named = try settings(includingCommented: true)
        #expect(named.count >= 10)
        for (name, _) in named { #expect(known.contains(name), "\(name) is not read by iap-server serve") }

        let tmp = try TemporaryFolder()
        // The file's values as they stand, with the data folder and port (given as flags) made the test's.
        let server = try ServerProcess(
            data: tmp.sub("data"), arguments: [], folder: tmp, environment: Dictionary(try settings(includingCommented: false).map { ($0.name, $0.value) }) { $1 })
        #expect(try curl([server.base + "/readyz"], folder: tmp).status == 200)
        let product = try curl([server.base + "/v1/products/com.example.none"], folder: tmp)
        #expect(product.status == 404 && product.errorCode != nil, "\(product.text)")
        #expect(server.stop() == 0)
    }
}

import Foundation

/// nginx from Debian's packages (`tools/install-deps.sh` installs it) running the project's
/// shipped edge configuration (`deploy/nginx/iap-content.conf`) in front of the given replicas,
/// with its caches and temporary files in the test's folder; killed when released.
public final class NginxServer: @unchecked Sendable {
    public let port: Int
    public let process: Process
    /// The shipped configuration's access log.
    public let accessLog: String
    /// Whether it serves HTTPS.
    public let tls: Bool
    public var base: String { "\(tls ? "https" : "http")://127.0.0.1:\(port)" }

    /// `port` is chosen beforehand (see ``freePort()``) when the replicas must know it, for
    /// their `--public-url`. `http` is added to the `http` block, e.g. `limit_rate 4m;`. With
    /// `certificate`, the edge listens with TLS (the shipped file's `listen 443 ssl` line), and
    /// offers HTTP/2 too with `http2`, as most TLS configurations do.
    public init(
        replicaPorts: [Int], folder: TemporaryFolder, port: Int? = nil, http: String = "", certificate: (certificate: String, key: String)? = nil,
        http2: Bool = false
    ) throws {
        tls = certificate != nil
        guard FileManager.default.isExecutableFile(atPath: "/usr/sbin/nginx") else {
            throw ServerError(description: "nginx is not installed: run tools/install-deps.sh (Debian: apt-get install nginx)")
        }
        self.port = try port ?? freePort()
        let port = self.port
        let listen = certificate.map { "listen 127.0.0.1:\(port) ssl\(http2 ? " http2" : ""); ssl_certificate \($0.certificate); ssl_certificate_key \($0.key);" } ?? "listen 127.0.0.1:\(port);"
        let root = folder.sub("nginx")
        accessLog = root + "/iap-content.access.log"
        // Worker processes run as nobody when the tests run as root: the folders must be theirs too.
        for sub in ["", "/cache", "/temp"] {
            try FileManager.default.createDirectory(atPath: root + sub, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o777])
        }
        let shipped = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("deploy/nginx/iap-content.conf").path
        var lines: [String] = []
        var upstreamWritten = false
        for line in try String(contentsOfFile: shipped, encoding: .utf8).components(separatedBy: "\n") {
            let trimmed = line.trimmingCharacters(in: .whitespaces)
            if trimmed.hasPrefix("server 127.0.0.1:") {
                // The shipped example replicas become the real ones, with the same options.
                let options = trimmed.split(separator: " ").dropFirst(2).joined(separator: " ")
                if !upstreamWritten { lines += replicaPorts.map { "    server 127.0.0.1:\($0) \(options)" } }
                upstreamWritten = true
                continue
            }
            lines.append(
                line.replacingOccurrences(of: "/var/cache/nginx/", with: root + "/cache/")
                    .replacingOccurrences(of: "/var/log/nginx/", with: root + "/")
                    .replacingOccurrences(of: "listen 8080;", with: listen))
        }
        try lines.joined(separator: "\n").write(toFile: root + "/iap-content.conf", atomically: true, encoding: .utf8)
        let temp = root + "/temp"
        let main = """
            worker_processes 1;
            daemon off;
            pid \(root)/nginx.pid;
            error_log \(root)/error.log warn;
            events { worker_connections 1024; }
            http {
                access_log off;
                client_body_temp_path \(temp)/body;
                proxy_temp_path \(temp)/proxy;
                fastcgi_temp_path \(temp)/fastcgi;
                uwsgi_temp_path \(temp)/uwsgi;
                scgi_temp_path \(temp)/scgi;
                \(http)
                include \(root)/iap-content.conf;
            }
            """
        try main.write(toFile: root + "/nginx.conf", atomically: true, encoding: .utf8)
        let check = try run("/usr/sbin/nginx", ["-t", "-c", root + "/nginx.conf", "-p", root])
        guard check.status == 0 else { throw ServerError(description: "nginx refused the configuration: \(check.stderr)") }
        process = try launch("/usr/sbin/nginx", ["-c", root + "/nginx.conf", "-p", root])
        // Bounded wait until it accepts connections.
        let deadline = Date().addingTimeInterval(10)
        while !Self.accepts(self.port) {
            guard Date() < deadline, process.isRunning else {
                throw ServerError(description: "nginx did not start: \((try? String(contentsOfFile: root + "/error.log", encoding: .utf8)) ?? "")")
            }
            usleep(20_000)
        }
    }

    private static func accepts(_ port: Int) -> Bool {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = UInt16(port).bigEndian
        return withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) == 0 }
        }
    }

    deinit {
        if process.isRunning {
            kill(process.processIdentifier, SIGTERM)
            process.waitUntilExit()
        }
    }
}

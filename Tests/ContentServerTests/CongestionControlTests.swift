import Foundation
import IAPTestSupport
import NIOCore
import Testing

@testable import ContentServer

#if canImport(Glibc)
    import Glibc
#endif

/// A server listening on a loopback address sets its connections' congestion control
/// (`--loopback-congestion-control`): read from the kernel with `ss`, on a connection held open.
@Suite("iap-server's congestion control on loopback", .onTestThreads)
struct CongestionControlTests {
    /// A connection to `port` that has sent part of a request head, so that the server has
    /// accepted it (`TCP_DEFER_ACCEPT` holds back one that sent nothing) and waits for the rest.
    func heldConnection(port: Int) throws -> CInt {
        let fd = try LoopbackSocket.connect(port)
        LoopbackSocket.send(fd, "GET /healthz HTTP/1.1\r\n")
        return fd
    }

    /// The congestion control of the server's end of its established connections on `port`, as `ss` reports it.
    func serverSideCongestionControl(port: Int) throws -> String? {
        let deadline = Date().addingTimeInterval(10)
        while Date() < deadline {
            let shown = try run("ss", ["-tniH", "state", "established", "( sport = :\(port) )"])
            try #require(shown.status == 0, "ss (iproute2, which tools/install-deps.sh installs): \(shown.stderr)")
            let words = shown.stdout.split(whereSeparator: \.isWhitespace).map(String.init)
            // The first word after the addresses' line that names an algorithm the kernel offers.
            let offered = try String(contentsOfFile: "/proc/sys/net/ipv4/tcp_available_congestion_control", encoding: .utf8)
                .split(whereSeparator: \.isWhitespace).map(String.init)
            if let name = words.first(where: { offered.contains($0) }) { return name }
            usleep(20_000)
        }
        return nil
    }

    func server(_ tmp: TemporaryFolder, _ extra: [String]) throws -> ServerProcess {
        try ServerProcess(data: tmp.sub("data-\(UUID().uuidString)"), arguments: ["--bundle-id", "com.example.app"] + extra, folder: tmp)
    }

    @Test("listening on 127.0.0.1 its connections keep the system's congestion control unless told one (cubic, reno), and 'system' keeps it too")
    func loopbackConnections() throws {
        let tmp = try TemporaryFolder()
        let system = try String(contentsOfFile: "/proc/sys/net/ipv4/tcp_congestion_control", encoding: .utf8)
            .trimmingCharacters(in: .whitespacesAndNewlines)
        for (flag, expected) in [
            ([String](), system), (["--loopback-congestion-control", "cubic"], "cubic"), (["--loopback-congestion-control", "reno"], "reno"),
            (["--loopback-congestion-control", "system"], system),
        ] {
            let server = try server(tmp, flag)
            defer { _ = server.stop() }
            let connection = try heldConnection(port: server.port)
            defer { close(connection) }
            #expect(try serverSideCongestionControl(port: server.port) == expected, "\(flag)")
        }
    }

    @Test("one the system does not offer is refused at start, naming those allowed; a malformed name is refused before")
    func unavailableAlgorithm() throws {
        let tmp = try TemporaryFolder()
        #expect {
            _ = try server(tmp, ["--loopback-congestion-control", "nosuchalgorithm"])
        } throws: { error in
            let said = "\(error)"
            return said.contains("congestion control nosuchalgorithm is not available") && said.contains("one of the allowed (")
        }
        let malformed = try run(productsDirectory() + "/iap-server", ["serve", "--data", tmp.sub("data"), "--bundle-id", "com.example.app", "--loopback-congestion-control", "BBR;"])
        #expect(malformed.status != 0)
        #expect(malformed.stderr.contains("must be 'system' or an algorithm's name"), "\(malformed.stderr)")
    }

    @Test("loopback addresses are told from others: 127.0.0.0/8, ::1 and ::ffff:127.x, not 10.0.0.1, ::2 or ::ffff:10.0.0.1")
    func loopbackAddresses() throws {
        for host in ["127.0.0.1", "127.5.6.7", "::1", "::ffff:127.0.0.1"] {
            #expect(ContentListener.isLoopback(try SocketAddress(ipAddress: host, port: 80)), "\(host)")
        }
        for host in ["10.0.0.1", "0.0.0.0", "::2", "::", "::ffff:10.0.0.1"] {
            #expect(!ContentListener.isLoopback(try SocketAddress(ipAddress: host, port: 80)), "\(host)")
        }
    }
}

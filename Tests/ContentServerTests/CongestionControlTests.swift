import Foundation
import IAPTestSupport
import NIOCore
import Testing

@testable import ContentServer

#if canImport(Glibc)
    import Glibc
#endif

/// A server sets the congestion control of its connections that cross no link
/// (`--loopback-congestion-control`, cubic by default): read from the kernel with `ss`, on a
/// connection held open.
@Suite("iap-server's congestion control on loopback", .onTestThreads)
struct CongestionControlTests {
    /// A connection to `port` kept open after one answered request, so that the server has
    /// accepted it and set it up (and any congestion control of its own set on it) before `ss` looks.
    func heldConnection(port: Int) throws -> CInt {
        let fd = try LoopbackSocket.connect(port)
        LoopbackSocket.send(fd, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        let answer = Responses(fd).next()
        try #require(answer.head.hasPrefix("HTTP/1.1 200"), "the server answered /healthz: \(answer.head)")
        return fd
    }

    /// The congestion control of the server's end of its established connection on `port`, as `ss` reports it.
    func serverSideCongestionControl(port: Int) throws -> String? {
        let shown = try run("ss", ["-tniH", "state", "established", "( sport = :\(port) )"])
        try #require(shown.status == 0, "ss (iproute2, which tools/install-deps.sh installs): \(shown.stderr)")
        let words = shown.stdout.split(whereSeparator: \.isWhitespace).map(String.init)
        // The first word after the addresses' line that names an algorithm the kernel offers.
        let offered = try String(contentsOfFile: "/proc/sys/net/ipv4/tcp_available_congestion_control", encoding: .utf8)
            .split(whereSeparator: \.isWhitespace).map(String.init)
        return words.first(where: { offered.contains($0) })
    }

    func server(_ tmp: TemporaryFolder, _ extra: [String]) throws -> ServerProcess {
        try ServerProcess(data: tmp.sub("data-\(UUID().uuidString)"), arguments: ["--bundle-id", "com.example.app"] + extra, folder: tmp)
    }

    @Test("listening on 127.0.0.1 its connections get cubic unless told another (reno) or 'system', which keeps the system's")
    func loopbackConnections() throws {
        let tmp = try TemporaryFolder()
        let system = try systemCongestionControl()
        for (flag, expected) in [
            ([String](), "cubic"), (["--loopback-congestion-control", "cubic"], "cubic"), (["--loopback-congestion-control", "reno"], "reno"),
            (["--loopback-congestion-control", "system"], system),
        ] {
            let server = try server(tmp, flag)
            defer { _ = server.stop() }
            let connection = try heldConnection(port: server.port)
            defer { close(connection) }
            #expect(try serverSideCongestionControl(port: server.port) == expected, "\(flag)")
            // The start says so when it changes anything.
            let log = try String(contentsOfFile: server.log, encoding: .utf8)
            #expect(log.contains("congestion control \(expected) for the connections from this machine") == (expected != system), "\(log)")
        }
    }

    @Test("listening on 0.0.0.0 a connection from this machine gets it too, set on the connection: cubic, reno when told, the system's with 'system'")
    func wildcardListener() throws {
        let tmp = try TemporaryFolder()
        let system = try systemCongestionControl()
        // reno is the one that shows the connection was set: the system's may be cubic already.
        for (flag, expected) in [([String](), "cubic"), (["--loopback-congestion-control", "reno"], "reno"), (["--loopback-congestion-control", "system"], system)] {
            let server = try server(tmp, ["--host", "0.0.0.0", "--public-url", "https://content.example.com"] + flag)
            defer { _ = server.stop() }
            let connection = try heldConnection(port: server.port)
            defer { close(connection) }
            #expect(try serverSideCongestionControl(port: server.port) == expected, "\(flag)")
        }
    }

    func systemCongestionControl() throws -> String {
        try String(contentsOfFile: "/proc/sys/net/ipv4/tcp_congestion_control", encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
    }

    @Test("where it is set: on the listener for a loopback address, on each connection for others; one not available is said and skipped by default, refused when asked for by name")
    func plans() throws {
        #expect(try ContentListener.congestionPlan(.preferred("cubic"), address: try SocketAddress(ipAddress: "127.0.0.1", port: 0)) == .init(listener: "cubic"))
        #expect(try ContentListener.congestionPlan(.required("reno"), address: try SocketAddress(ipAddress: "::1", port: 0)) == .init(listener: "reno"))
        #expect(try ContentListener.congestionPlan(.preferred("cubic"), address: try SocketAddress(ipAddress: "0.0.0.0", port: 0)) == .init(connections: "cubic"))
        #expect(try ContentListener.congestionPlan(.system, address: try SocketAddress(ipAddress: "127.0.0.1", port: 0)) == .init())
        let skipped = try ContentListener.congestionPlan(.preferred("nosuchalgorithm"), address: try SocketAddress(ipAddress: "127.0.0.1", port: 0))
        #expect(skipped.listener == nil && skipped.connections == nil)
        #expect(skipped.note?.contains("congestion control nosuchalgorithm is not one this kernel offers") == true, "\(skipped)")
        #expect(skipped.note?.contains("connections from this machine keep the system's") == true, "\(skipped)")
        #expect(throws: (any Error).self) { try ContentListener.congestionPlan(.required("nosuchalgorithm"), address: try SocketAddress(ipAddress: "127.0.0.1", port: 0)) }
    }

    @Test("one the system does not offer is refused at start, naming those allowed; a malformed name is refused before")
    func unavailableAlgorithm() throws {
        let tmp = try TemporaryFolder()
        #expect {
            _ = try server(tmp, ["--loopback-congestion-control", "nosuchalgorithm"])
        } throws: { error in
            let said = "\(error)"
            return said.contains("congestion control nosuchalgorithm is not one this kernel offers (available: ") && said.contains("this process may set ")
                && said.contains("give --loopback-congestion-control one of those, or 'system'")
        }
        let malformed = try run(productsDirectory() + "/iap-server", ["serve", "--data", tmp.sub("data"), "--bundle-id", "com.example.app", "--loopback-congestion-control", "BBR;"])
        #expect(malformed.status != 0)
        #expect(malformed.stderr.contains("must be 'system' or an algorithm's name"), "\(malformed.stderr)")
    }

    @Test("a connection crosses no link when its peer is at a loopback address or at the connection's own address")
    func sameMachine() throws {
        func address(_ host: String) throws -> SocketAddress { try SocketAddress(ipAddress: host, port: 80) }
        #expect(ContentListener.crossesNoLink(local: try address("10.0.0.5"), remote: try address("127.0.0.1")))
        #expect(ContentListener.crossesNoLink(local: try address("10.0.0.5"), remote: try address("10.0.0.5")))
        #expect(ContentListener.crossesNoLink(local: try address("::ffff:10.0.0.5"), remote: try address("10.0.0.5")))
        #expect(ContentListener.crossesNoLink(local: try address("2001:db8::5"), remote: try address("::1")))
        #expect(!ContentListener.crossesNoLink(local: try address("10.0.0.5"), remote: try address("10.0.0.6")))
        #expect(!ContentListener.crossesNoLink(local: try address("2001:db8::5"), remote: try address("2001:db8::6")))
        #expect(!ContentListener.crossesNoLink(local: try address("10.0.0.5"), remote: nil))
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

import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// A client's side of a real TCP connection to 127.0.0.1, for tests of what happens on a socket.
public enum LoopbackSocket {
    /// A client socket, connected; `receiveBuffer` set before connecting bounds what the
    /// server can send before the client reads.
    public static func connect(_ port: Int, receiveBuffer: Int? = nil) throws -> CInt {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        if var size = receiveBuffer.map(CInt.init) {
            setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, socklen_t(MemoryLayout<CInt>.size))
        }
        var timeout = timeval(tv_sec: 20, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        try #require(connected == 0)
        return fd
    }

    public static func send(_ fd: CInt, _ text: String) {
        let bytes = Array(text.utf8)
        #expect(Glibc.send(fd, bytes, bytes.count, Int32(MSG_NOSIGNAL)) == bytes.count)
    }

    /// Reads until the server closes (or 20 s pass without a byte).
    public static func readToClose(_ fd: CInt) -> (bytes: [UInt8], closed: Bool) {
        var received: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let count = recv(fd, &chunk, chunk.count, 0)
            if count == 0 { return (received, true) }
            if count < 0 { return (received, false) }
            received += chunk[..<count]
        }
    }
}

/// Reads HTTP responses with a `Content-Length` off one connection (``LoopbackSocket``), keeping what arrived past one
/// for the next.
public final class Responses {
    public let fd: CInt
    public var received: [UInt8] = []
    private let owning: Bool
    /// `owning`: the connection is closed with this reader.
    public init(_ fd: CInt, owning: Bool = false) {
        self.fd = fd
        self.owning = owning
    }
    deinit { if owning { close(fd) } }

    public func next() -> (head: String, body: [UInt8]) {
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            if let split = received.firstRange(of: Array("\r\n\r\n".utf8)) {
                let head = String(decoding: received[..<split.lowerBound], as: UTF8.self)
                let length =
                    head.split(separator: "\r\n").first { $0.lowercased().hasPrefix("content-length:") }
                    .flatMap { Int($0.split(separator: ":")[1].trimmingCharacters(in: .whitespaces)) } ?? 0
                if received.count - split.upperBound >= length {
                    let body = Array(received[split.upperBound..<(split.upperBound + length)])
                    received.removeFirst(split.upperBound + length)
                    return (head, body)
                }
            }
            let count = recv(fd, &chunk, chunk.count, 0)
            guard count > 0 else { return (String(decoding: received, as: UTF8.self), []) }
            received += chunk[..<count]
        }
    }
}

import Foundation

/// A loopback port nothing listens on, kept from every other test until the test process ends.
///
/// Tests run in parallel and their servers ask the kernel for a free port. A port found free
/// and let go, or the port of a server a test killed to restart later, was free for the kernel
/// to give the next server another test starts: that test's restart then failed, or its client
/// reached the other test's server (seen in CI: a purchase refused by a server with other trust
/// roots where the test expected "connection refused"). So the port stays bound here, without
/// listening: connecting to it is refused, the kernel gives it to no one asking for a free port,
/// and a server that binds it by number with `SO_REUSEADDR` (iap-server, nginx and PostgreSQL
/// all do) still can, while it is held.
public func freePort() throws -> Int { try holdPort(0) }

/// Holds `port` (0: one the kernel picks) on 127.0.0.1 as ``freePort()`` does, e.g. the port of
/// a server just killed, until a server started again takes it. Fails when something listens
/// there.
@discardableResult
public func holdPort(_ port: Int) throws -> Int {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
    guard fd >= 0 else { throw ServerError(description: "cannot open a socket: \(String(cString: strerror(errno)))") }
    var one: Int32 = 1
    var address = sockaddr_in()
    address.sin_family = sa_family_t(AF_INET)
    address.sin_addr.s_addr = inet_addr("127.0.0.1")
    address.sin_port = in_port_t(UInt16(port).bigEndian)
    var length = socklen_t(MemoryLayout<sockaddr_in>.size)
    let bound = withUnsafeMutablePointer(to: &address) { pointer in
        pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) {
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size)) == 0 && bind(fd, $0, length) == 0
                && getsockname(fd, $0, &length) == 0
        }
    }
    guard bound else {
        let reason = String(cString: strerror(errno))
        close(fd)
        throw ServerError(description: "cannot hold port \(port) on 127.0.0.1: \(reason)")
    }
    // Never closed: a few descriptors for the whole run, against a port another test could take.
    return Int(UInt16(bigEndian: address.sin_port))
}

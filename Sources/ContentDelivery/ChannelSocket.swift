#if os(Linux)
    @_spi(Reflection) import Swift
    import Glibc
    import NIOCore
    import Synchronization

    /// The socket under a NIO TCP channel, and calls on its descriptor, for ``FileSender``,
    /// ``StalledReader``, the fast path and ``ContentAcceptor``.
    ///
    /// NIOPosix keeps a channel's socket descriptor internal (its `BaseSocketChannel.socket`,
    /// whose `BaseSocket.descriptor` is private) and has no call that hands it out. It is read
    /// here at the offsets the runtime's reflection gives for those two properties, checked for
    /// each channel class against a channel's own addresses with `getsockname` and
    /// `getpeername`: a NIO release that stores it otherwise yields `nil`, and the connection
    /// goes through NIO as before, never to another socket. Tests assert that large responses
    /// and new connections' first answers are sent this way, so such a release is noticed.
    enum ChannelSocket {
        /// A duplicate of `channel`'s socket descriptor (the caller closes it), or `nil`.
        /// Call on the channel's event loop while the channel is open.
        static func duplicate(of channel: any Channel) -> CInt? {
            guard let descriptor = descriptor(of: channel) else { return nil }
            let copy = fcntl(descriptor, F_DUPFD_CLOEXEC, 0)
            return copy >= 0 ? copy : nil
        }

        /// `TCP_CORK` of <netinet/tcp.h>, not imported into Swift.
        static let tcpCork: CInt = 3

        /// Sets `TCP_CORK` on a socket descriptor (see `ChannelHandlerContext.setCork`), for the
        /// fast path, which holds a duplicate of the channel's for the sending threads: through
        /// NIO's channel options the call costs a dynamic cast and a generic-metadata lookup more.
        static func setCork(_ descriptor: CInt, _ on: Bool) {
            var value: CInt = on ? 1 : 0
            _ = setsockopt(descriptor, CInt(IPPROTO_TCP), tcpCork, &value, socklen_t(MemoryLayout<CInt>.size))
        }

        /// The bytes the peer of `channel`'s socket has acknowledged so far, or `nil`.
        /// Call on the channel's event loop while the channel is open.
        static func bytesAcknowledged(on channel: any Channel) -> UInt64? {
            guard let descriptor = descriptor(of: channel) else { return nil }
            // `tcpi_bytes_acked` of the kernel's `struct tcp_info` (Linux 4.1 and later), read at
            // its offset: glibc's struct stops before it, and <linux/tcp.h>'s cannot be imported
            // beside glibc's (the two definitions clash in Clang's modules). The layout is kernel
            // ABI, only ever extended at its end; a kernel too old to fill it returns less.
            let tcpInfo: CInt = 11, offset = 120
            var info = [UInt8](repeating: 0, count: 256)
            var length = socklen_t(info.count)
            let result = info.withUnsafeMutableBytes { getsockopt(descriptor, CInt(IPPROTO_TCP), tcpInfo, $0.baseAddress, &length) }
            guard result == 0, Int(length) >= offset + 8 else { return nil }
            return info.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: offset, as: UInt64.self) }
        }

        /// `channel`'s own socket descriptor (not a duplicate: it stays the channel's), read at the
        /// places found for its class, or `nil`. Call on the channel's event loop while the
        /// channel is open. The first channel of each class is also checked against its own
        /// addresses (`getsockname`, `getpeername`): the places are the class's, so one check
        /// holds for every channel of it, and a NIO release that stores the socket otherwise
        /// fails it and is never read from.
        static func descriptor(of channel: any Channel) -> CInt? {
            handle(of: channel)?.descriptor
        }

        /// `channel`'s socket, to read its descriptor at each use without looking it up again,
        /// or `nil` (see `descriptor(of:)`). Call on the channel's event loop while it is open.
        static func handle(of channel: any Channel) -> Handle? {
            let object = channel as AnyObject
            let type = ObjectIdentifier(Swift.type(of: object))
            if let known = layouts.withLock({ $0[type] }) {
                let handle = Handle(socket: socketObject(known, of: object), offset: known.descriptor)
                return handle.descriptor >= 0 ? handle : nil
            }
            guard let socketField = field("socket", of: Swift.type(of: object), where: { $0 is AnyObject.Type }) else { return nil }
            let socket = UnsafeRawPointer(Unmanaged.passUnretained(object).toOpaque()).load(fromByteOffset: socketField, as: AnyObject.self)
            guard let descriptorField = field("descriptor", of: Swift.type(of: socket), where: { $0 == CInt.self }) else { return nil }
            let layout = Layout(socket: socketField, descriptor: descriptorField)
            let handle = Handle(socket: socket, offset: descriptorField)
            // Not kept when the check cannot be made (a peer already gone has no address): the
            // next channel is checked.
            guard handle.descriptor >= 0, matches(handle.descriptor, channel) else { return nil }
            layouts.withLock { $0[type] = layout }
            return handle
        }

        /// A channel's socket object, kept: its descriptor is read at each use. NIO sets that
        /// descriptor to -1 as it closes the socket, on the channel's event loop, so a read there
        /// after the close gives -1, never a number the kernel has since given another
        /// connection; unlike a duplicate, it holds no descriptor of its own. Use on the
        /// channel's event loop only.
        struct Handle {
            fileprivate let socket: AnyObject
            fileprivate let offset: Int

            /// The socket's descriptor now; -1 once the channel has closed it.
            var descriptor: CInt {
                withExtendedLifetime(socket) {
                    UnsafeRawPointer(Unmanaged.passUnretained(socket).toOpaque()).load(fromByteOffset: offset, as: CInt.self)
                }
            }
        }

        /// Where a channel class keeps its socket object, and that object its descriptor: byte
        /// offsets into each instance.
        private struct Layout {
            let socket: Int
            let descriptor: Int
        }

        /// By channel class, once checked (a handful of classes).
        private static let layouts = Mutex<[ObjectIdentifier: Layout]>([:])

        /// Why offsets, not `Mirror`: a mirror boxes the properties it walks, and each read took
        /// about as long as the rest of answering a request on a new connection (11% of the
        /// server's CPU there, `perf`, docs/performance.md, twenty-second stop).
        private static func socketObject(_ layout: Layout, of object: AnyObject) -> AnyObject {
            UnsafeRawPointer(Unmanaged.passUnretained(object).toOpaque()).load(fromByteOffset: layout.socket, as: AnyObject.self)
        }

        /// The byte offset of the stored property `name` of a class instance (its own or a
        /// superclass's), when its type passes `accepts`.
        private static func field(_ name: String, of type: Any.Type, where accepts: (Any.Type) -> Bool) -> Int? {
            var offset: Int?
            // `.classType`, spelled by value: the stdlib declares it a `static var`, which strict
            // concurrency refuses to read.
            _ = _forEachField(of: type, options: _EachFieldOptions(rawValue: 1 << 0)) { fieldName, fieldOffset, fieldType, _ in
                guard String(cString: fieldName) == name else { return true }
                if accepts(fieldType) { offset = fieldOffset }
                return false
            }
            return offset
        }

        private static func matches(_ descriptor: CInt, _ channel: any Channel) -> Bool {
            guard descriptor >= 0, let local = channel.localAddress, let remote = channel.remoteAddress else { return false }
            return address(of: descriptor, getsockname) == local && address(of: descriptor, getpeername) == remote
        }

        private static func address(
            of descriptor: CInt, _ call: (CInt, UnsafeMutablePointer<sockaddr>, UnsafeMutablePointer<socklen_t>) -> CInt
        ) -> SocketAddress? {
            var storage = sockaddr_storage()
            var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
            let result = withUnsafeMutablePointer(to: &storage) { pointer in
                pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { call(descriptor, $0, &length) }
            }
            guard result == 0 else { return nil }
            switch CInt(storage.ss_family) {
            case AF_INET:
                return withUnsafeBytes(of: &storage) { SocketAddress($0.load(as: sockaddr_in.self), host: "") }
            case AF_INET6:
                return withUnsafeBytes(of: &storage) { SocketAddress($0.load(as: sockaddr_in6.self), host: "") }
            default:
                return nil
            }
        }
    }
#endif

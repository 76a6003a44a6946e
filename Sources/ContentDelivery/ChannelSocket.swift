#if os(Linux)
    import Glibc
    import NIOCore
    import Synchronization

    /// The socket under a NIO TCP channel, and calls on its descriptor, for ``FileSender``,
    /// ``StalledReader`` and the fast path.
    ///
    /// NIOPosix keeps a channel's socket descriptor internal (its `BaseSocketChannel.socket`,
    /// whose `BaseSocket.descriptor` is private) and has no call that hands it out. It is read
    /// here by reflection and then checked against the channel's own addresses with
    /// `getsockname` and `getpeername`: a NIO release that stores it otherwise yields `nil`, and
    /// the response goes through NIO's `FileRegion` as before, never to another socket. A test
    /// asserts that large responses are sent this way, so such a release is noticed.
    enum ChannelSocket {
        /// A duplicate of `channel`'s socket descriptor (the caller closes it), or `nil`.
        /// Call on the channel's event loop while the channel is open.
        static func duplicate(of channel: any Channel) -> CInt? {
            guard let descriptor = descriptor(of: channel), matches(descriptor, channel) else { return nil }
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
            guard let descriptor = descriptor(of: channel), matches(descriptor, channel) else { return nil }
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

        private static func descriptor(of channel: any Channel) -> CInt? {
            guard let socket = field("socket", of: channel) else { return nil }
            return field("descriptor", of: socket) as? CInt
        }

        /// Where a stored property was found: how many superclasses up from the object's own
        /// class, and its place among that class's own properties.
        private struct Place {
            let depth: Int
            let index: Int
        }

        private struct Key: Hashable {
            let type: ObjectIdentifier
            let name: String
        }

        /// Places found so far, by class and property (a handful: NIO's channel and socket classes).
        private static let places = Mutex<[Key: Place]>([:])

        /// A stored property of an object or of one of its superclasses.
        ///
        /// Why the places are kept: walking a mirror's children boxes every property up to the
        /// one asked for; read at a known place, one is. With the cork set on the descriptor, the
        /// event loop's work for a response handed to the sending threads fell by 7-12% (30-60 µs
        /// of about 400-500, docs/performance.md, twenty-first stop). A place that no longer
        /// holds the name (another class) is looked for again.
        private static func field(_ name: String, of subject: Any) -> Any? {
            let key = Key(type: ObjectIdentifier(type(of: subject)), name: name)
            if let place = places.withLock({ $0[key] }), let value = value(name, at: place, of: subject) { return value }
            var mirror: Mirror? = Mirror(reflecting: subject)
            var depth = 0
            while let current = mirror {
                for (index, child) in current.children.enumerated() where child.label == name {
                    places.withLock { $0[key] = Place(depth: depth, index: index) }
                    return child.value
                }
                mirror = current.superclassMirror
                depth += 1
            }
            return nil
        }

        private static func value(_ name: String, at place: Place, of subject: Any) -> Any? {
            var mirror = Mirror(reflecting: subject)
            for _ in 0..<place.depth {
                guard let up = mirror.superclassMirror else { return nil }
                mirror = up
            }
            let children = mirror.children
            guard place.index < children.count else { return nil }
            let child = children[children.index(children.startIndex, offsetBy: place.index)]
            return child.label == name ? child.value : nil
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

import NIOCore

/// Tells a client that has stopped reading a response from one that reads slowly, at the
/// read-idle events of the `IdleStateHandler` in front (one every idle timeout while the client
/// sends nothing, as a client downloading does): a response in flight across two of them with no
/// byte acknowledged by the peer in between belongs to a client that stopped reading, or to a
/// network that is gone. Its connection is then closed, as nginx's `send_timeout` closes it,
/// rather than kept for ever with its socket buffers and the response's file; a client that
/// reads slowly acknowledges something in every period and keeps it.
///
/// What the peer acknowledges counts whoever sends the body, NIO or the ``FileSender`` (whose send
/// is then cancelled as the connection closes), so one look covers every response. It costs one
/// `getsockopt(TCP_INFO)` per idle period of a connection with a response in flight and nothing
/// per request or per send. Where the socket cannot be read (not Linux), nothing is cut.
struct StalledReader {
    private var acknowledgedAtLastLook: UInt64?

    /// At a read-idle event while a response is in flight: true when the peer has acknowledged
    /// no byte since the previous event (a stall is found one to two idle timeouts after it began).
    mutating func hasStopped(_ channel: any Channel) -> Bool {
        #if os(Linux)
            guard let acknowledged = ChannelSocket.bytesAcknowledged(on: channel) else { return false }
            defer { acknowledgedAtLastLook = acknowledged }
            return acknowledgedAtLastLook == acknowledged
        #else
            return false
        #endif
    }

    /// No response in flight any more: the next one is watched afresh.
    mutating func reset() {
        acknowledgedAtLastLook = nil
    }
}

import ContentDelivery
import Foundation
import Hummingbird
import HummingbirdCore
import IAPProtocol
import Logging
import NIOCore
import NIOHTTP1
import NIOHTTPTypes
import NIOHTTPTypesHTTP1

/// A connection's pipeline, set up by `ContentListener` as it accepts: the content fast path
/// first, so archive bytes leave through sendfile, and the JSON API through Hummingbird's router.
/// The router's part (the decoder, the codec, the async channel and the task that reads it) is
/// set up only when a connection first asks for something other than content: see
/// `HandedOffConnections`. A Hummingbird `HTTPChannelHandler` for its request loop
/// (`handleHTTP`), which Hummingbird's own server would start for every connection.
struct ContentHTTPChannel: HTTPChannelHandler {
    /// What the protocol hands a server's task for the connection: `ContentListener` starts none.
    struct Connection: ServerChildChannelValue {
        let channel: any Channel
    }
    typealias Value = Connection

    let responder: Responder
    let service: ContentService
    let sender: FileSender?
    let idleTimeout: Duration
    let headerTimeout: Duration
    let handedOff: HandedOffConnections
    static let contentPrefix = "/v1/content/"

    func setup(channel: any Channel, logger: Logger) -> EventLoopFuture<Value> {
        channel.eventLoop.makeCompletedFuture {
            try configure(channel, logger: logger)
            return Connection(channel: channel)
        }
    }

    /// Sets up an accepted connection's pipeline, on its event loop.
    func configure(_ channel: any Channel, logger: Logger) throws {
        // Header floods are cut by the decoder's limits. A head it refuses is answered by
        // ProtocolErrorAnswer (431 or 400 with the error envelope), an error within a request by
        // Hummingbird (400), so NIO's own error handler stays off: two answers would break the
        // connection.
        var limits = NIOHTTPDecoderLimitConfiguration()
        limits.maxHeaderFieldSize = 16 * 1024
        limits.maxHeaderListSize = 64 * 1024
        limits.maxHeaderFieldCount = 100
        // A send that leaves part of its bytes means the socket is full: wait for it to drain
        // rather than try again at once. NIO tries up to 16 more times by default, which for
        // a download across a link is one more sendfile per wake-up, answered EAGAIN (thrown
        // and caught inside NIO as an error), about a thousand per GiB.
        try channel.syncOptions?.setOption(ChannelOptions.writeSpin, value: 0)
        let sync = channel.pipeline.syncOperations
        try sync.addHandler(IdleStateHandler(readTimeout: TimeAmount(idleTimeout)))
        let deadline = RequestHeadDeadline(timeout: headerTimeout, bodyTimeout: idleTimeout)
        // Shutdown waits for responses the HTTP/1 handlers have written to leave (sendfile).
        let quiesce = QuiesceAfterWrites()
        // Plain content requests are answered here from the bytes read; the first other
        // request adds the HTTP/1 handlers behind it and hands the connection to them for good.
        let fastPath = ContentFastPath(
            prefix: Self.contentPrefix, resolver: service, observer: service.metrics, heads: deadline, sender: sender,
            writesToSocket: true,
            installDecoder: { sync in
                try sync.configureHTTPServerPipeline(
                    position: .after(quiesce), withPipeliningAssistance: true, withErrorHandling: false, withOutboundHeaderValidation: false,
                    withEncoderConfiguration: .init(), withDecoderLimitConfiguration: limits)
                try sync.addHandlers(
                    [
                        ProtocolErrorAnswer(limits: "100 header fields, 16 KiB a field, 64 KiB in all"),
                        ContentChannelHandler(prefix: Self.contentPrefix, resolver: service, observer: service.metrics),
                        HTTP10Expectations(),
                        HTTP1ToHTTPServerCodec(secure: false),
                        // No idle timeout here: this handler cannot see content transfers and would cut them.
                        HTTPConnectionStateHandler(idleTimeout: nil, logger: logger),
                    ], position: .after(deadline))
                let http = try NIOAsyncChannel<HTTPRequestPart, HTTPResponsePart>(
                    wrappingChannelSynchronously: channel, configuration: .init(isOutboundHalfClosureEnabled: true))
                // Refused once the server has stopped: the fast path then closes the connection.
                guard handedOff.start({ await handleHTTP(asyncChannel: http, logger: logger) }) else {
                    throw ChannelError.ioOnClosedChannel
                }
            })
        try sync.addHandler(fastPath)
        try sync.addHandler(quiesce)
        try sync.addHandler(deadline)
    }

    func handle(value: Value, logger: Logger) async {}
}

extension ContentHTTPChannel {
    /// The router's answers as Hummingbird's `Application` gives them: each request with an id in
    /// its logger's metadata, an error the router did not turn into a response answered 500, and
    /// `Date` and `Server` fields on every response.
    static func responder(_ router: some HTTPResponder<ServerRequestContext>, logger: Logger) -> Responder {
        { request, writer, channel in
            var logger = logger
            logger[metadataKey: "hb.request.id"] = .stringConvertible(RequestID())
            var response: Response
            do {
                response = try await router.respond(to: request, context: ServerRequestContext(source: .init(channel: channel, logger: logger)))
            } catch let error as HTTPParserError {
                throw error  // the connection's handler answers it and closes
            } catch {
                logger.debug("unrecognised error", metadata: ["error.type": "\(error)"])
                response = Response(status: .internalServerError)
            }
            response.headers[.date] = HTTPDate.format(Date())
            response.headers[.server] = "iap-server"
            try await writer.write(response: response.head, body: response.body)
        }
    }
}

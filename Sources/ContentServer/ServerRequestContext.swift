import HTTPTypes
import Hummingbird
import HummingbirdCore
import NIOCore
import NIOHTTPTypes

/// The request context of iap-server's routes: Hummingbird's basic one, plus the connection, so
/// that a handler can answer `Expect: 100-continue` once it has decided to read the body.
struct ServerRequestContext: RequestContext {
    var coreContext: CoreRequestContextStorage
    let channel: any Channel

    init(source: ApplicationRequestContextSource) {
        coreContext = .init(source: source)
        channel = source.channel
    }

    /// RFC 9110 §10.1.1: a client that sent `Expect: 100-continue` holds the body back until the
    /// server says to send it (curl waits a second, then sends anyway). Said by a handler once it
    /// has checked what it can without the body, so that a refusal (a wrong token, a body too
    /// large) is answered instead and the body never sent. Hummingbird has no interim responses of
    /// its own; NIO's HTTP/1 pipeline passes a 1xx head before the final one.
    func continueIfExpected(_ request: Request) async {
        guard let expect = request.headers[.expect], expect.lowercased() == "100-continue" else { return }
        try? await channel.writeAndFlush(HTTPResponsePart.head(HTTPResponse(status: .continue)))
    }
}

/// The rules of a connection's read deadlines, apart from any channel: when the next request head
/// is due, how long a request body may stall, when the one timer must fire, and when the
/// connection must close. `RequestHeadDeadline` feeds it the channel's events with the time and
/// performs the actions; tests feed it instants of their own choosing, so they run without
/// waiting. (Hummingbird tests its connection state machine the same way.)
///
/// Two deadlines, as nginx's `client_header_timeout` and `client_body_timeout`:
/// - the head: complete within `timeout` of the connection opening or the last response leaving;
/// - the body: while a request's body is open, no more than `bodyTimeout` from the server asking
///   for more of it to the next part arriving. Without it a client that sends a POST head and then
///   nothing (or a byte now and then) held its connection for ever: the head was in time, and the
///   read-idle handler leaves a request in progress alone. The clock stops while the server is
///   busy with what it has and asks for nothing (an upload parsed and written to disk): that time
///   is the server's, not the client's, and a loaded server once cut its own uploads for it.
///
/// One timer at a time, moved forward lazily when it fires early, rather than one re-armed for
/// every request; it is replaced only when a deadline comes due before it.
struct HeadDeadline<Instant: InstantProtocol>: Sendable where Instant.Duration == Duration {
    enum Action: Sendable, Equatable {
        case none
        /// Start the timer (replacing a scheduled one), to fire at this instant.
        case scheduleTimer(at: Instant)
        /// A deadline passed: close the connection.
        case close
    }

    let timeout: Duration
    let bodyTimeout: Duration
    /// When the next request head must be complete; nil while a request is being served.
    private(set) var deadline: Instant?
    /// When the open request body must have sent more; nil when no body is open, or while the
    /// server has asked for nothing since the last part.
    private(set) var bodyDeadline: Instant?
    /// Whether a request's body is open: its head has arrived, its end has not.
    private(set) var bodyOpen = false
    /// When the scheduled timer fires; nil when none is scheduled.
    private(set) var timerAt: Instant?

    init(timeout: Duration, bodyTimeout: Duration? = nil) {
        self.timeout = timeout
        self.bodyTimeout = bodyTimeout ?? timeout
    }

    /// The connection opened, or a response has been sent completely: a head is due within `timeout`.
    mutating func awaitHead(now: Instant) -> Action {
        deadline = now.advanced(by: timeout)
        return schedule()
    }

    /// A complete request head arrived: no head is due while it is served.
    mutating func headReceived() {
        deadline = nil
    }

    /// A request head announcing a body arrived: the body is open, its clock not yet running.
    mutating func bodyOpened() {
        bodyOpen = true
    }

    /// The server asks for more of the open body: the next part is due within `bodyTimeout`.
    /// A clock already running keeps its deadline (the client has sent nothing since).
    mutating func moreRequested(now: Instant) -> Action {
        guard bodyOpen, bodyDeadline == nil else { return .none }
        bodyDeadline = now.advanced(by: bodyTimeout)
        return schedule()
    }

    /// A part of the body arrived: what the server asked for came, and the clock stops until it
    /// asks again.
    mutating func partArrived() {
        bodyDeadline = nil
    }

    /// The request's body is complete.
    mutating func bodyEnded() {
        bodyOpen = false
        bodyDeadline = nil
    }

    /// The timer fired at `now`.
    mutating func timerFired(now: Instant) -> Action {
        timerAt = nil
        guard let next = nextDeadline else { return .none }  // a request is being served; the next response re-arms
        guard now < next else { return .close }
        timerAt = next
        return .scheduleTimer(at: next)
    }

    /// The connection closed; returns whether a scheduled timer must be cancelled.
    mutating func connectionClosed() -> Bool {
        defer {
            deadline = nil
            bodyDeadline = nil
            bodyOpen = false
            timerAt = nil
        }
        return timerAt != nil
    }

    private var nextDeadline: Instant? {
        switch (deadline, bodyDeadline) {
        case (let head?, let body?): min(head, body)
        case (let head?, nil): head
        case (nil, let body?): body
        case (nil, nil): nil
        }
    }

    /// A timer already scheduled at or before the next deadline stays (it moves on when it
    /// fires); one scheduled after it, or none, is replaced.
    private mutating func schedule() -> Action {
        guard let next = nextDeadline else { return .none }
        if let timerAt, timerAt <= next { return .none }
        timerAt = next
        return .scheduleTimer(at: next)
    }
}

/// The rules of the request-head deadline, apart from any channel: when the next request head
/// is due, when the one timer must fire, and when the connection must close. `RequestHeadDeadline`
/// feeds it the channel's events with the time and performs the actions; tests feed it instants
/// of their own choosing, so they run without waiting. (Hummingbird tests its connection state
/// machine the same way.)
///
/// One timer at a time, moved forward lazily when it fires early, rather than one re-armed for
/// every request.
struct HeadDeadline<Instant: InstantProtocol>: Sendable where Instant.Duration == Duration {
    enum Action: Sendable, Equatable {
        case none
        /// Start the timer, to fire at this instant.
        case scheduleTimer(at: Instant)
        /// The head is late: close the connection.
        case close
    }

    let timeout: Duration
    /// When the next request head must be complete; nil while a request is being served.
    private(set) var deadline: Instant?
    /// Whether a timer is scheduled.
    private(set) var timerScheduled = false

    init(timeout: Duration) {
        self.timeout = timeout
    }

    /// The connection opened, or a response has been sent completely: a head is due within `timeout`.
    mutating func awaitHead(now: Instant) -> Action {
        let due = now.advanced(by: timeout)
        deadline = due
        guard !timerScheduled else { return .none }
        timerScheduled = true
        return .scheduleTimer(at: due)
    }

    /// A complete request head arrived: nothing is due while it is served.
    mutating func headReceived() {
        deadline = nil
    }

    /// The timer fired at `now`.
    mutating func timerFired(now: Instant) -> Action {
        timerScheduled = false
        guard let deadline else { return .none }  // a request is being served; the next response re-arms
        guard now < deadline else { return .close }
        timerScheduled = true
        return .scheduleTimer(at: deadline)
    }

    /// The connection closed; returns whether a scheduled timer must be cancelled.
    mutating func connectionClosed() -> Bool {
        defer {
            deadline = nil
            timerScheduled = false
        }
        return timerScheduled
    }
}

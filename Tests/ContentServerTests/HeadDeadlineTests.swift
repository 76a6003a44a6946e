import Testing

@testable import ContentServer

/// The request-head deadline's rules on a clock of the test's own: instants are chosen, never
/// waited for.
@Suite struct HeadDeadlineTests {
    typealias Deadline = HeadDeadline<ContinuousClock.Instant>
    let t0 = ContinuousClock.now

    func at(_ seconds: Double) -> ContinuousClock.Instant { t0 + .milliseconds(Int(seconds * 1000)) }

    @Test func aSilentConnectionIsClosedWhenItsHeadIsLate() {
        var deadline = Deadline(timeout: .seconds(30))
        #expect(deadline.awaitHead(now: at(0)) == .scheduleTimer(at: at(30)))
        #expect(deadline.timerFired(now: at(30)) == .close)
    }

    @Test func aHeadInTimeStopsTheDeadlineUntilTheResponseIsSent() {
        var deadline = Deadline(timeout: .seconds(30))
        _ = deadline.awaitHead(now: at(0))
        deadline.headReceived()
        // A 2 GiB response takes minutes: the timer fires meanwhile and changes nothing.
        #expect(deadline.timerFired(now: at(30)) == Deadline.Action.none)
        // Sent at 100 s: the next head is due at 130 s.
        #expect(deadline.awaitHead(now: at(100)) == .scheduleTimer(at: at(130)))
        #expect(deadline.timerFired(now: at(129.9)) == .scheduleTimer(at: at(130)))
        #expect(deadline.timerFired(now: at(130)) == .close)
    }

    @Test func requestsInARowMoveTheOneTimerLazily() {
        var deadline = Deadline(timeout: .seconds(30))
        #expect(deadline.awaitHead(now: at(0)) == .scheduleTimer(at: at(30)))
        for second in 1...20 {
            deadline.headReceived()
            // No new timer per request: the scheduled one stays.
            #expect(deadline.awaitHead(now: at(Double(second))) == Deadline.Action.none)
        }
        // The timer fires at 30 s, early for the deadline of 50 s, and moves there.
        #expect(deadline.timerFired(now: at(30)) == .scheduleTimer(at: at(50)))
        #expect(deadline.timerFired(now: at(50)) == .close)
    }

    @Test func aSlowLorisTricklingBytesIsStillCutOff() {
        // Bytes arriving without completing a head do not reach the state machine at all: only a
        // complete head meets the deadline.
        var deadline = Deadline(timeout: .seconds(30))
        _ = deadline.awaitHead(now: at(0))
        #expect(deadline.timerFired(now: at(30.001)) == .close)
    }

    @Test func closingCancelsTheTimerOnce() {
        var deadline = Deadline(timeout: .seconds(30))
        _ = deadline.awaitHead(now: at(0))
        let first = deadline.connectionClosed()
        let second = deadline.connectionClosed()
        #expect(first && !second)
        #expect(deadline.deadline == nil)
    }

    /// A deadline of 30 s for heads whose connection opened at 0 s, and whose first request,
    /// arrived then, announced a body.
    func bodyOpenedAtZero(bodyTimeout: Duration) -> Deadline {
        var deadline = Deadline(timeout: .seconds(30), bodyTimeout: bodyTimeout)
        _ = deadline.awaitHead(now: at(0))
        deadline.headReceived()
        deadline.bodyOpened()
        return deadline
    }

    @Test("a request body that stalls is cut off bodyTimeout after the server asked for more; each part it sends moves the deadline")
    func aStalledBodyIsCutOff() {
        var deadline = Deadline(timeout: .seconds(30), bodyTimeout: .seconds(60))
        #expect(deadline.awaitHead(now: at(0)) == .scheduleTimer(at: at(30)))
        deadline.headReceived()
        deadline.bodyOpened()
        // The server asks for the body: the scheduled timer (30 s) is before its deadline and stays.
        #expect(deadline.moreRequested(now: at(1)) == Deadline.Action.none)
        #expect(deadline.timerFired(now: at(30)) == .scheduleTimer(at: at(61)))
        deadline.partArrived()
        // The timer at 61 s stays, and moves on to the new deadline when it fires.
        #expect(deadline.moreRequested(now: at(50)) == Deadline.Action.none)
        #expect(deadline.timerFired(now: at(61)) == .scheduleTimer(at: at(110)))
        #expect(deadline.timerFired(now: at(110)) == .close)
    }

    @Test("the body's clock stops while the server asks for nothing (busy with the parts it has), and does not restart while it runs")
    func aBusyServerDoesNotCutItsOwnUpload() {
        var deadline = bodyOpenedAtZero(bodyTimeout: .seconds(2))
        #expect(deadline.moreRequested(now: at(0)) == .scheduleTimer(at: at(2)))
        deadline.partArrived()
        // Ten seconds parsing what arrived, asking for nothing: the timer finds no deadline.
        #expect(deadline.timerFired(now: at(2)) == Deadline.Action.none)
        #expect(deadline.moreRequested(now: at(10)) == .scheduleTimer(at: at(12)))
        // Asked again with nothing come since: the deadline stays where it was.
        #expect(deadline.moreRequested(now: at(11)) == Deadline.Action.none)
        #expect(deadline.bodyDeadline == at(12))
        #expect(deadline.timerFired(now: at(12)) == .close)
    }

    @Test("a complete body stops its deadline; a shorter body timeout replaces a later timer")
    func aCompleteBodyStopsItsDeadline() {
        var deadline = bodyOpenedAtZero(bodyTimeout: .seconds(5))
        // Due at 6 s, before the timer of 30 s: that timer is replaced.
        #expect(deadline.moreRequested(now: at(1)) == .scheduleTimer(at: at(6)))
        deadline.partArrived()
        #expect(deadline.moreRequested(now: at(2)) == Deadline.Action.none)
        deadline.bodyEnded()
        // The request is being served: nothing is due, and asking for more opens no clock.
        #expect(deadline.timerFired(now: at(6)) == Deadline.Action.none)
        #expect(deadline.moreRequested(now: at(7)) == Deadline.Action.none)
        #expect(deadline.bodyDeadline == nil && deadline.deadline == nil)
        #expect(deadline.awaitHead(now: at(9)) == .scheduleTimer(at: at(39)))
    }

    @Test("a response sent before the body ended (an early refusal): the head deadline runs, and the body's too")
    func anEarlyResponseWithAnOpenBody() {
        var deadline = bodyOpenedAtZero(bodyTimeout: .seconds(60))
        _ = deadline.moreRequested(now: at(0))
        // 401 for an upload sent at 1 s while the client keeps sending: it cannot go on for ever.
        #expect(deadline.awaitHead(now: at(1)) == Deadline.Action.none)
        deadline.partArrived()
        _ = deadline.moreRequested(now: at(20))
        #expect(deadline.timerFired(now: at(30)) == .scheduleTimer(at: at(31)))
        deadline.partArrived()
        _ = deadline.moreRequested(now: at(30.5))
        #expect(deadline.timerFired(now: at(31)) == .close)
    }
}

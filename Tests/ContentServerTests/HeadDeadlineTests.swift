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

    @Test("a request body that stalls is cut off after bodyTimeout without a byte; each part it sends moves the deadline")
    func aStalledBodyIsCutOff() {
        var deadline = Deadline(timeout: .seconds(30), bodyTimeout: .seconds(60))
        #expect(deadline.awaitHead(now: at(0)) == .scheduleTimer(at: at(30)))
        deadline.headReceived()
        // The head announced a body: the scheduled timer (30 s) is before its deadline and stays.
        #expect(deadline.bodyRead(now: at(1)) == Deadline.Action.none)
        #expect(deadline.timerFired(now: at(30)) == .scheduleTimer(at: at(61)))
        #expect(deadline.bodyRead(now: at(50)) == Deadline.Action.none)
        #expect(deadline.timerFired(now: at(61)) == .scheduleTimer(at: at(110)))
        #expect(deadline.timerFired(now: at(110)) == .close)
    }

    @Test("a complete body stops its deadline; a shorter body timeout replaces a later timer")
    func aCompleteBodyStopsItsDeadline() {
        var deadline = Deadline(timeout: .seconds(30), bodyTimeout: .seconds(5))
        _ = deadline.awaitHead(now: at(0))
        deadline.headReceived()
        // Due at 6 s, before the timer of 30 s: that timer is replaced.
        #expect(deadline.bodyRead(now: at(1)) == .scheduleTimer(at: at(6)))
        #expect(deadline.bodyRead(now: at(2)) == Deadline.Action.none)
        deadline.bodyEnded()
        // The request is being served: nothing is due.
        #expect(deadline.timerFired(now: at(6)) == Deadline.Action.none)
        #expect(deadline.bodyDeadline == nil && deadline.deadline == nil)
        #expect(deadline.awaitHead(now: at(9)) == .scheduleTimer(at: at(39)))
    }

    @Test("a response sent before the body ended (an early refusal): the head deadline runs, and the body's too")
    func anEarlyResponseWithAnOpenBody() {
        var deadline = Deadline(timeout: .seconds(30), bodyTimeout: .seconds(60))
        _ = deadline.awaitHead(now: at(0))
        deadline.headReceived()
        _ = deadline.bodyRead(now: at(0))
        // 401 for an upload sent at 1 s while the client keeps sending: it cannot go on for ever.
        #expect(deadline.awaitHead(now: at(1)) == Deadline.Action.none)
        _ = deadline.bodyRead(now: at(20))
        #expect(deadline.timerFired(now: at(30)) == .scheduleTimer(at: at(31)))
        _ = deadline.bodyRead(now: at(30.5))
        #expect(deadline.timerFired(now: at(31)) == .close)
    }
}

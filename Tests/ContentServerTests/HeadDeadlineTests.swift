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
}

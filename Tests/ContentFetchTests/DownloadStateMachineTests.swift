import AsyncHTTPClient
import Foundation
import IAPProtocol
import NIOCore
import Testing
import TransactionQueue

@testable import ContentFetch

/// The download's rules, driven without a network, a journal or a clock.
@Suite struct DownloadStateMachineTests {
    let grant = GrantedDownload(
        productId: "com.example.levels", contentVersion: "1.0", contentLength: 1000, sha256: String(repeating: "a", count: 64),
        url: "http://127.0.0.1:1/v1/content/t/x.zip", expiresAt: Date(timeIntervalSince1970: 2_000_000_000))
    let now = Date(timeIntervalSince1970: 1_800_000_000)

    func granted() throws -> DownloadStateMachine {
        var machine = DownloadStateMachine(transactionId: "1000", productId: "com.example.levels", now: now)
        #expect(try machine.handle(.granted(grant), now: now) == DownloadStateMachine.Action.none)
        return machine
    }

    @Test func theUsualPathSavesEachLastingStateAndTellsObservers() throws {
        var machine = try granted()
        #expect(machine.state == .waiting)
        #expect(machine.record.expectedLength == 1000 && machine.record.url == grant.url)
        #expect(try machine.handle(.accepted, now: now) == .saveAndEmit(removePartial: false))
        #expect(machine.state == .active)
        // Accepting again (another connection's response) changes nothing.
        #expect(try machine.handle(.accepted, now: now) == DownloadStateMachine.Action.none)
        #expect(try machine.handle(.installed(contentPath: "/c/p/1.0"), now: now) == .saveAndEmit(removePartial: true))
        #expect(machine.state == .finished)
        #expect(machine.record.contentPath == "/c/p/1.0" && machine.record.installedAt == now)
        let update = machine.update()
        #expect(update.progress == 1 && update.bytesReceived == 1000 && update.contentURL == "/c/p/1.0" && update.timeRemaining == 0)
    }

    @Test func aRetryShowsItsReasonWithoutSavingAndTheNextResponseClearsIt() throws {
        var machine = try granted()
        _ = try machine.handle(.accepted, now: now)
        let reason = FetchError(.network, "connection reset")
        #expect(try machine.handle(.retrying(reason), now: now) == .emit)
        #expect(machine.state == .waiting && machine.record.error == reason)
        #expect(try machine.handle(.accepted, now: now) == .saveAndEmit(removePartial: false))
        #expect(machine.record.error == nil)
    }

    @Test func pauseAndResume() throws {
        var machine = try granted()
        _ = try machine.handle(.accepted, now: now)
        #expect(try machine.handle(.pause, now: now) == .saveAndEmit(removePartial: false))
        #expect(machine.state == .paused)
        #expect(try machine.handle(.pause, now: now) == DownloadStateMachine.Action.none)
        #expect(try machine.handle(.resume, now: now) == .saveAndEmit(removePartial: false))
        #expect(machine.state == .waiting)
        #expect(throws: DownloadStateMachine.InvalidTransition.self) { try machine.handle(.resume, now: now) }
    }

    @Test func cancelForgetsTheBytesAndRemovesThePartialFile() throws {
        var machine = try granted()
        machine.updateBytes {
            $0.recordedLength = 600; $0.etag = "\"e\""; $0.segments = [Segment(start: 0, end: 1000, done: 600)]
        }
        #expect(try machine.handle(.cancel, now: now) == .saveAndEmit(removePartial: true))
        #expect(machine.state == .cancelled)
        #expect(machine.record.recordedLength == 0 && machine.record.etag == nil && machine.record.segments == nil)
        // Granted again later: it starts over from zero, waiting.
        #expect(try machine.handle(.granted(grant), now: now) == .saveAndEmit(removePartial: true))
        #expect(machine.state == .waiting)
    }

    @Test func aNewArchiveStartsOverButTheSameGrantAgainKeepsTheBytes() throws {
        var machine = try granted()
        machine.updateBytes { $0.recordedLength = 600 }
        var renewed = grant
        renewed.url = "http://127.0.0.1:1/v1/content/fresh/x.zip"
        #expect(try machine.handle(.granted(renewed), now: now) == DownloadStateMachine.Action.none)
        #expect(machine.record.recordedLength == 600 && machine.record.url == renewed.url)
        var newer = grant
        newer.contentVersion = "1.1"
        newer.sha256 = String(repeating: "b", count: 64)
        newer.contentLength = 2000
        #expect(try machine.handle(.granted(newer), now: now) == .saveAndEmit(removePartial: true))
        #expect(machine.record.recordedLength == 0 && machine.record.expectedLength == 2000 && machine.record.contentVersion == "1.1")
    }

    @Test func finishedIsFinal() throws {
        var machine = try granted()
        _ = try machine.handle(.installed(contentPath: "/c"), now: now)
        for event: DownloadStateMachine.Event in [.accepted, .pause, .cancel, .fail(FetchError(.network, "x")), .retrying(FetchError(.network, "x"))] {
            #expect(throws: DownloadStateMachine.InvalidTransition.self) { try machine.handle(event, now: now) }
            #expect(machine.state == .finished)
        }
    }

    @Test func aBusyFailureLeavesTheOtherProcesssJournalAlone() throws {
        var machine = try granted()
        #expect(try machine.handle(.fail(FetchError(.busy, "another iap-fetch")), now: now) == .emit)
        #expect(machine.state == .failed)
        var other = try granted()
        #expect(try other.handle(.fail(FetchError(.integrity, "hash")), now: now) == .saveAndEmit(removePartial: false))
    }

    @Test func aRefundDiscardsTheBytesOnDisk() throws {
        var machine = try granted()
        machine.updateBytes { $0.recordedLength = 4 << 20 }
        #expect(try machine.handle(.fail(FetchError(.revoked, "refunded")), now: now) == .saveAndEmit(removePartial: true))
        #expect(machine.state == .failed && machine.record.recordedLength == 0 && machine.record.error?.code == .revoked)
    }

    @Test func beforeTheGrantNothingIsSavedAndUpdatesHaveNoSize() throws {
        var machine = DownloadStateMachine(transactionId: "1000", productId: "com.example.levels", now: now)
        #expect(throws: DownloadStateMachine.InvalidTransition.self) { try machine.handle(.accepted, now: now) }
        #expect(throws: DownloadStateMachine.InvalidTransition.self) { try machine.handle(.installed(contentPath: "/c"), now: now) }
        #expect(try machine.handle(.pause, now: now) == .emit)
        #expect(try machine.handle(.resume, now: now) == .emit)
        #expect(try machine.handle(.fail(FetchError(.revoked, "refunded")), now: now) == .emit)
        let update = machine.update()
        #expect(update.state == .failed && update.expectedContentLength == -1 && update.contentVersion == nil && update.error?.code == .revoked)
    }

    @Test func byteBookkeepingCannotChangeTheState() throws {
        var machine = try granted()
        machine.updateBytes { record in
            record.state = .finished
            record.contentPath = "/nowhere"
            record.recordedLength = 10
        }
        #expect(machine.state == .waiting && machine.record.contentPath == nil && machine.record.recordedLength == 10)
    }
}

@Suite struct RetryPolicyTests {
    @Test func backoffDoublesWithJitterUpToTheSameAgain() {
        let policy = RetryPolicy(maxAttempts: 5, base: .milliseconds(250))
        #expect(policy.delay(after: 1, random: 0) == .milliseconds(250))
        #expect(policy.delay(after: 2, random: 0) == .milliseconds(500))
        #expect(policy.delay(after: 3, random: 1) == .milliseconds(2000))
    }

    @Test func triesUntilSuccessOrTheLimitAndStopsAtOnceOnWhatIsNotRetryable() async throws {
        let policy = RetryPolicy(maxAttempts: 3, base: .zero)
        var attempts: [Int] = []
        let value = try await policy.run(
            { attempt -> Int in
                attempts.append(attempt)
                if attempt < 3 { throw FetchError(.network, "down") }
                return 7
            }, retryable: { _ in true }, willRetry: { _, _ in RetryPolicy.Wait.none })
        #expect(value == 7 && attempts == [1, 2, 3])

        attempts = []
        await #expect(throws: FetchError(.network, "down 3")) {
            try await policy.run(
                { attempt -> Int in
                    attempts.append(attempt)
                    throw FetchError(.network, "down \(attempt)")
                }, retryable: { _ in true }, willRetry: { _, _ in RetryPolicy.Wait.none })
        }
        #expect(attempts == [1, 2, 3])

        attempts = []
        await #expect(throws: FetchError(.revoked, "refunded")) {
            try await policy.run(
                { attempt -> Int in
                    attempts.append(attempt)
                    throw FetchError(.revoked, "refunded")
                }, retryable: { ($0 as? FetchError)?.code == .network }, willRetry: { _, _ in RetryPolicy.Wait.none })
        }
        #expect(attempts == [1])
    }

    @Test("a server that cannot be reached is tried for the patience, not a number of times; another error counts as before")
    func unreachableIsTriedForAWhile() async throws {
        let policy = RetryPolicy(maxAttempts: 2, base: .zero, patience: .seconds(30))
        var tries: [Int] = []
        var heard: [String] = []
        let value = try await policy.run(
            { attempt -> Int in
                tries.append(attempt)
                if tries.count <= 6 { throw Unreachable(reason: FetchError(.network, "refused \(tries.count)")) }
                return 7
            }, retryable: { _ in true },
            willRetry: { _, error in
                heard.append((error as? FetchError)?.message ?? "not a FetchError")
                return .backoff
            })
        // Six refusals with two attempts allowed: they did not use the attempts up.
        #expect(value == 7 && tries == [1, 1, 1, 1, 1, 1, 1])
        #expect(heard == (1...6).map { "refused \($0)" }, "willRetry hears the reason, as a FetchError")

        // Past the patience the Unreachable is thrown, for the caller to tell from other failures.
        let impatient = RetryPolicy(maxAttempts: 5, base: .zero, patience: .zero)
        let thrown = await #expect(throws: Unreachable.self) {
            try await impatient.run(
                { _ -> Int in throw Unreachable(reason: FetchError(.network, "refused")) }, retryable: { _ in true },
                willRetry: { _, _ in .backoff })
        }
        #expect(thrown?.reason == FetchError(.network, "refused"))

        // Other errors still count: refusals in between do not reset the attempts.
        tries = []
        await #expect(throws: FetchError(.network, "reset")) {
            try await policy.run(
                { attempt -> Int in
                    tries.append(attempt)
                    if tries.count % 2 == 1 { throw FetchError(.network, "reset") }
                    throw Unreachable(reason: FetchError(.network, "refused"))
                }, retryable: { _ in true }, willRetry: { _, _ in .backoff })
        }
        #expect(tries == [1, 2, 2])
    }

    @Test("Retry-After on 503 and 429, in seconds or as a date, capped; other statuses and values ask for nothing")
    func retryAfter() {
        let cap = Duration.seconds(60)
        let now = Date(timeIntervalSince1970: 1_795_330_800)
        func after(_ status: UInt, _ value: String?) -> Duration? {
            RetryLater.from(status: status, retryAfter: value, cap: cap, now: now, what: "x")?.after
        }
        #expect(after(503, "7") == .seconds(7))
        #expect(after(429, " 0 ") == .zero)
        #expect(after(503, "3600") == cap)
        #expect(after(503, "99999999999999999999999") == cap)
        #expect(after(503, "Sun, 22 Nov 2026 07:00:30 GMT") == .seconds(30))
        #expect(after(503, "Sun, 22 Nov 2026 06:00:00 GMT") == .zero)
        for value in ["-5", "1.5", "soon", "", nil] as [String?] {
            #expect(after(503, value) == nil, "\(value ?? "nil")")
        }
        #expect(after(500, "7") == nil && after(502, "7") == nil)
        let said = RetryLater.from(status: 503, retryAfter: "3600", cap: cap, now: now, what: "the archive")?.reason.message ?? ""
        #expect(said == "the server is unavailable for now (503) for the archive: trying again in 60 s (it asked for 3600), as it asked")
    }

    @Test("a wait the server asked for is kept even when the backoff's is shorter")
    func waitsAsAsked() async throws {
        let policy = RetryPolicy(maxAttempts: 2, base: .zero)
        let clock = ContinuousClock()
        let started = clock.now
        _ = try await policy.run(
            { attempt -> Int in
                if attempt == 1 { throw FetchError(.network, "busy") }
                return 1
            }, retryable: { _ in true }, willRetry: { _, _ in .atLeast(.milliseconds(300)) })
        // A lower bound only: the wait asked for must have passed.
        #expect(clock.now - started >= .milliseconds(300))
    }
}

@Suite struct GrantClientTests {
    let transaction = QueuedTransaction(transactionId: "1000", productId: "com.example.levels", signedTransaction: "x")

    @Test func errorAnswersMapToWhatTheDownloadCanDo() {
        func failure(_ status: UInt, _ body: String) -> FetchError {
            GrantClient.failure(status: status, body: Array(body.utf8), transaction: transaction)
        }
        #expect(failure(403, #"{"error":{"code":"revoked","message":"refunded"}}"#).code == .revoked)
        #expect(failure(403, #"{"error":{"code":"wrong-bundle-id","message":"no"}}"#).code == .refused)
        #expect(failure(401, #"{"error":{"code":"untrusted-chain","message":"no"}}"#).code == .refused)
        #expect(failure(404, #"{"error":{"code":"no-content","message":"none"}}"#).code == .noContent)
        // Another 404 is not the content server saying "no content" (a wrong --server, a proxy):
        // a failure that names the address to check, never purchases quietly left undelivered.
        let elsewhere = failure(404, "<html>Not Found</html>")
        #expect(elsewhere.code == .refused && elsewhere.message.contains("check that --server is the content server's address"))
        #expect(failure(404, #"{"error":{"code":"not-found","message":"no route"}}"#).code == .refused)
        #expect(failure(503, #"{"error":{"code":"storage","message":"later"}}"#).code == .network)
        // Not an envelope (a proxy's page): still a reason a person can read.
        let proxy = failure(502, "<html>Bad Gateway</html>")
        #expect(proxy.code == .network && proxy.message.contains("Bad Gateway"))
    }

    @Test func connectionErrorsSayWhatToCheck() {
        #expect(GrantClient.describe(IOError(errnoCode: ECONNREFUSED, reason: "connection reset (error set)")).contains("connection refused: is the server running"))
        #expect(GrantClient.describe(HTTPClientError.connectTimeout).contains("check the server's address"))
    }

    @Test("a failure to connect is an Unreachable naming the server; a failure after connecting is not")
    func whatCountsAsUnreachable() {
        let url = "https://content.example.com:8443/v1/content/grant/a.zip"
        let refused = connectionFailure(IOError(errnoCode: ECONNREFUSED, reason: "connection reset (error set)"), url: url) as? Unreachable
        #expect(refused?.reason.message == "cannot reach https://content.example.com:8443: connection refused: is the server running, and listening at that address and port?")
        // An IPv6 address is named as a URL writes it, so that the port is told apart.
        let v6 = connectionFailure(IOError(errnoCode: ECONNREFUSED, reason: "connect"), url: "http://[::1]:8080/v1/content/g/a.zip") as? Unreachable
        #expect(v6?.reason.message.hasPrefix("cannot reach http://[::1]:8080: ") == true, "\(v6?.reason.message ?? "nil")")
        for error: any Error in [IOError(errnoCode: ENETUNREACH, reason: "connect"), HTTPClientError.connectTimeout, ChannelError.connectTimeout(.seconds(10))] {
            #expect(connectionFailure(error, url: url) is Unreachable, "\(error)")
        }
        for error: any Error in [IOError(errnoCode: ECONNRESET, reason: "read"), HTTPClientError.readTimeout, HTTPClientError.remoteConnectionClosed, FetchError(.network, "x")] {
            #expect(connectionFailure(error, url: url) == nil, "\(error)")
        }
    }
}

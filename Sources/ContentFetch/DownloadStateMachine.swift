import Foundation
import IAPProtocol

/// Every state a download passes through, and why, in one value.
///
/// The queue feeds it events (a response accepted, a retry, pause, cancel, a failure, the
/// install); `handle` checks that the event is allowed in the current state, changes the record
/// and returns the ``Action`` the queue must perform: nothing, tell observers, or save the journal
/// and tell observers. The queue performs actions in one place, so a state is never saved without
/// being reported or reported without being saved. The same shape as SwiftNIO's
/// `HTTPServerPipelineHandler.ConnectionState`: the rules here, the I/O in the caller, and tests
/// that drive the rules without a network.
///
/// ```
///            accepted              install
///  waiting ───────────▶ active ─────────────▶ finished
///     ▲  ◀─── retrying ───┘ │
///     │ resume    pause     │ fail
///  paused ◀─────────────────┤──────────────▶ failed
///                           │ cancel (from any state but finished)
///                           └──────────────▶ cancelled
/// ```
/// A finished download granted again is downloaded again: the queue checks first whether its
/// installed folder is still there.
/// A download whose grant is not known yet (no version, no size) is ``isGranted`` false: it can
/// wait, pause, resume, fail and be cancelled, and nothing is saved for it.
struct DownloadStateMachine: Sendable, Equatable {
    /// What happened to the download.
    enum Event: Sendable, Equatable {
        /// The grant is known: the download takes its archive, version, size and URL. Another
        /// archive than the one recorded (a new version), or a cancelled download, starts over
        /// from zero.
        case granted(GrantedDownload)
        /// A response for the archive was accepted: bytes are coming.
        case accepted
        /// An attempt failed and another will follow; the reason is shown meanwhile.
        case retrying(FetchError)
        case pause
        case resume
        /// The partial file goes and the download forgets its bytes.
        case cancel
        /// No more attempts in this run; the transaction stays unfinished.
        case fail(FetchError)
        /// Installed at `contentPath`: the download is finished.
        case installed(contentPath: String)
    }

    /// What the caller must do after a transition.
    enum Action: Sendable, Equatable {
        /// Nothing changed that anyone needs to know.
        case none
        /// Tell observers; the journal keeps the previous state (a transient state, or one
        /// whose journal belongs to another process).
        case emit
        /// Save the journal, remove the partial file (and the manifest kept beside it) when
        /// `removePartial`, then tell observers.
        case saveAndEmit(removePartial: Bool)
    }

    /// An event that the current state does not allow.
    struct InvalidTransition: Error, Sendable, Equatable, CustomStringConvertible {
        let state: DownloadState
        let event: Event
        var description: String { "a \(state) download cannot take \(event)" }
    }

    private(set) var record: DownloadRecord
    /// Whether the grant (so the archive's version and size) is known: a grant always names the
    /// archive's SHA-256.
    var isGranted: Bool { !record.sha256.isEmpty }

    var state: DownloadState { record.state }
    var id: String { record.id }

    /// A download known only by its transaction, before the server granted anything.
    init(transactionId: String, productId: String, now: Date = Date()) {
        record = DownloadRecord(
            id: "\(transactionId)-\(productId)", transactionId: transactionId, productId: productId, contentVersion: "",
            sha256: "", expectedLength: -1, url: "", etag: nil, recordedLength: 0, state: .waiting, error: nil,
            updatedAt: now, installedAt: nil, contentPath: nil)
    }

    /// A download the journal knows.
    init(record: DownloadRecord) {
        self.record = record
    }

    /// Applies `event`: the new state and the action to perform, or `InvalidTransition`.
    mutating func handle(_ event: Event, now: Date = Date()) throws(InvalidTransition) -> Action {
        let state = record.state
        func refuse() -> InvalidTransition { InvalidTransition(state: state, event: event) }
        let action: Action
        switch event {
        case .granted(let download):
            let wasGranted = isGranted
            let startOver =
                !wasGranted || record.sha256 != download.sha256
                || record.contentVersion != download.contentVersion || state == .cancelled || state == .finished
            if startOver {
                record.sha256 = download.sha256
                record.contentVersion = download.contentVersion
                record.expectedLength = download.contentLength
                record.discardBytes()
                record.installedAt = nil
                record.contentPath = nil
            }
            record.url = download.url
            record.state = .waiting
            record.error = nil
            // The partial file of another archive is worthless; one granted again stays.
            action = wasGranted && startOver ? .saveAndEmit(removePartial: true) : .none
        case .accepted:
            guard isGranted, [.waiting, .active, .paused, .failed].contains(state) else { throw refuse() }
            guard state != .active else { return .none }
            record.state = .active
            record.error = nil
            action = .saveAndEmit(removePartial: false)
        case .retrying(let reason):
            guard !state.isFinal || state == .failed else { throw refuse() }
            record.state = .waiting
            record.error = reason
            action = .emit
        case .pause:
            guard state != .paused else { return .none }
            guard [.waiting, .active, .failed].contains(state) else { throw refuse() }
            record.state = .paused
            action = isGranted ? .saveAndEmit(removePartial: false) : .emit
        case .resume:
            guard state == .paused else { throw refuse() }
            record.state = .waiting
            record.error = nil
            action = isGranted ? .saveAndEmit(removePartial: false) : .emit
        case .cancel:
            guard state != .finished else { throw refuse() }
            record.discardBytes()
            record.state = .cancelled
            record.error = nil
            action = isGranted ? .saveAndEmit(removePartial: true) : .emit
        case .fail(let reason):
            guard state != .finished, state != .cancelled else { throw refuse() }
            record.state = .failed
            record.error = reason
            // A refunded purchase is granted nothing more: its bytes on disk (up to 2 GiB) would
            // only wait for a refund reversal, which starts over.
            let worthless = reason.code == .revoked
            if worthless { record.discardBytes() }
            // A busy download's journal belongs to the process that holds it: leave it alone.
            action = isGranted && reason.code != .busy ? .saveAndEmit(removePartial: worthless) : .emit
        case .installed(let path):
            guard isGranted, [.waiting, .active].contains(state) else { throw refuse() }
            record.state = .finished
            record.error = nil
            record.installedAt = now
            record.contentPath = path
            action = .saveAndEmit(removePartial: true)
        }
        record.updatedAt = now
        return action
    }

    /// Changes what the record says about the bytes on disk (segments, durable marks, the
    /// validator): never its state, which only `handle` changes.
    mutating func updateBytes(_ change: (inout DownloadRecord) -> Void) {
        let (state, error, installedAt, contentPath) = (record.state, record.error, record.installedAt, record.contentPath)
        change(&record)
        record.state = state
        record.error = error
        record.installedAt = installedAt
        record.contentPath = contentPath
    }

    /// What observers see now; `received` and `rate` while bytes arrive.
    func update(received bytes: Int64? = nil, rate: RateEstimator = RateEstimator()) -> DownloadUpdate {
        guard isGranted else {
            return DownloadUpdate(
                id: record.id, transactionId: record.transactionId, productId: record.productId, contentVersion: nil,
                state: record.state, progress: 0, bytesReceived: 0, expectedContentLength: -1, timeRemaining: -1,
                bytesPerSecond: 0, error: record.error, contentURL: nil)
        }
        let finished = record.state == .finished
        // A delta update counts only the bytes it fetches.
        let expected = record.delta?.bytesToFetch ?? record.expectedLength
        let received = finished ? expected : (bytes ?? record.recordedLength)
        return DownloadUpdate(
            id: record.id, transactionId: record.transactionId, productId: record.productId, contentVersion: record.contentVersion,
            state: record.state, progress: expected > 0 ? Double(received) / Double(expected) : 0,
            bytesReceived: received, expectedContentLength: expected,
            timeRemaining: finished ? 0 : rate.timeRemaining(expected - received),
            bytesPerSecond: rate.bytesPerSecond, error: record.error, contentURL: finished ? record.contentPath : nil,
            bytesToFetch: expected, bytesToWrite: record.delta?.bytesToWrite, delta: record.delta?.summary)
    }
}

import CatalogPostgres
import ContentDelivery
import NIOHTTP1
import Prometheus
import Synchronization

/// The server's Prometheus metrics, on a registry of its own (not the process-global
/// MetricsSystem, so that several servers can live in one process, as in tests).
final class ServerMetrics: ContentObserver, Sendable {
    let registry = PrometheusCollectorRegistry()
    let bytesServed: Counter
    let activeTransfers: Gauge
    let transferDuration: DurationHistogram
    let verificationDuration: DurationHistogram
    /// The content path's statuses, made once: looking a counter up in the registry takes a lock,
    /// on every content request.
    private let responses: [UInt: Counter]

    init() {
        var responses: [UInt: Counter] = [:]
        for code: UInt in [200, 206, 304, 400, 401, 403, 404, 405, 412, 416, 500] {
            responses[code] = Self.responseCounter(code, in: registry)
        }
        self.responses = responses
        bytesServed = registry.makeCounter(descriptor: describe("iap_content_bytes_served_total", "Archive bytes sent (counted when a response ends)."))
        activeTransfers = registry.makeGauge(descriptor: describe("iap_content_active_transfers", "Content responses of more than 64 KiB being sent now."))
        // Downloads of large archives over slow links take minutes: buckets reach an hour.
        transferDuration = registry.makeDurationHistogram(
            descriptor: describe("iap_content_transfer_duration_seconds", "Time from the first to the last byte of content responses of more than 64 KiB."),
            buckets: [
                .milliseconds(10), .milliseconds(100), .seconds(1), .seconds(5), .seconds(15), .seconds(30), .seconds(60),
                .seconds(120), .seconds(300), .seconds(600), .seconds(1200), .seconds(1800), .seconds(3600),
            ])
        verificationDuration = registry.makeDurationHistogram(
            descriptor: describe("iap_verification_duration_seconds", "Time to verify a signed transaction or notification."),
            buckets: [
                .microseconds(100), .microseconds(250), .microseconds(500), .milliseconds(1), .milliseconds(2),
                .milliseconds(5), .milliseconds(10), .milliseconds(50), .milliseconds(250),
            ])
    }

    /// PostgreSQL's state as the catalog's pool keeper sees it, read at each scrape: whether it
    /// answers (alert on 0), and how many times a pool left waiting out its backoff was replaced.
    func database(_ catalog: PostgresCatalog) {
        registry.makeGauge(descriptor: describe("iap_database_answering", "1 while PostgreSQL answers, 0 while it does not (checked each second when idle).")).set(
            Int64(catalog.isAnswering ? 1 : 0))
        let replacements = catalog.poolReplacements
        let counted = reportedReplacements.withLock { reported in
            defer { reported = replacements }
            return replacements - reported
        }
        if counted > 0 {
            registry.makeCounter(
                descriptor: describe("iap_database_pool_replacements_total", "Connection pools replaced because PostgreSQL answered again while they waited out their retry backoff.")
            ).increment(by: Int64(counted))
        }
    }

    private let reportedReplacements = Mutex(0)

    func grant(_ outcome: String) {
        registry.makeCounter(descriptor: describe("iap_grants_total", "Download grant requests by outcome."), labels: [("outcome", outcome)]).increment()
    }

    /// A connection the server could not accept for want of file descriptors (`reason` is
    /// `process-limit` or `system-limit`): alert on it, it means clients wait.
    func acceptFailure(_ reason: String) {
        registry.makeCounter(
            descriptor: describe("iap_accept_failures_total", "Connections that could not be accepted for want of file descriptors."),
            labels: [("reason", reason)]
        ).increment()
    }

    /// A content request refused because the archive (or manifest) on disk is not what was
    /// published: alert on it, buyers cannot download that version from this replica.
    func damagedArchiveRefused() {
        registry.makeCounter(
            descriptor: describe("iap_damaged_archive_refusals_total", "Content requests refused because the file on disk is not the one published (iap-server check).")
        ).increment()
    }

    /// The periodic read found an archive whose bytes are not the published ones at the
    /// published size (``ServerConfiguration/archiveCheckInterval``): alert on it.
    func rotFound() {
        registry.makeCounter(
            descriptor: describe(
                "iap_archives_found_damaged_total", "Archives the periodic read (--archive-check-interval) found with other bytes than published at their published size.")
        ).increment()
    }

    /// A pass of the periodic read through every published archive has ended.
    func archiveCheckPassed() {
        registry.makeCounter(
            descriptor: describe("iap_archive_check_passes_total", "Passes of the periodic read (--archive-check-interval) through every published archive.")
        ).increment()
    }

    func notification(_ type: String, _ outcome: String) {
        registry.makeCounter(
            descriptor: describe("iap_notifications_total", "App Store Server Notifications by type and outcome."),
            labels: [("type", type), ("outcome", outcome)]
        ).increment()
    }

    /// Responses of up to this many archive bytes leave in one write with their head: they are
    /// counted by status and in the bytes served, but not as transfers (the gauge and the
    /// duration histogram). A scrape cannot see one in flight, it is not timed, and recording
    /// both cost about 5% of the server's CPU on 4 KiB ranges: two atomics and a lock per
    /// request, shared by every event loop.
    static let transferThreshold = ContentObserverLimits.untimedBytes

    func responseStarted(status: HTTPResponseStatus, bytes: UInt64) {
        if bytes > Self.transferThreshold { activeTransfers.increment() }
        (responses[status.code] ?? Self.responseCounter(status.code, in: registry)).increment()
    }

    /// The content responses counter for one status (the common ones are made once, up front).
    private static func responseCounter(_ code: UInt, in registry: PrometheusCollectorRegistry) -> Counter {
        registry.makeCounter(descriptor: describe("iap_content_responses_total", "Content responses by status."), labels: [("status", String(code))])
    }

    func responseFinished(status: HTTPResponseStatus, bytes: UInt64, duration: Duration, succeeded: Bool) {
        guard bytes > 0 else { return }
        if succeeded { bytesServed.increment(by: Int64(bytes)) }
        guard bytes > Self.transferThreshold else { return }
        activeTransfers.decrement()
        transferDuration.record(duration)
    }
}

/// A metric's full name (kept as one string, as the dashboards know it) and its help text.
private func describe(_ name: String, _ help: String) -> MetricNameDescriptor {
    MetricNameDescriptor(metricName: name, unitName: "", helpText: help)
}

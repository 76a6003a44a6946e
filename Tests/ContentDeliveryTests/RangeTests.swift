import ContentDelivery
import Foundation
import IAPProtocol
import Testing

@Suite("Range and conditional request evaluation (RFC 9110)")
struct RangeTests {
    let etag = "\"abc\""
    let date = "Sun, 22 Nov 2026 07:00:00 GMT"

    func decide(_ range: String?, size: UInt64 = 1000, ifRange: String? = nil, ifNoneMatch: String? = nil, maxRanges: Int = 16) -> RangeDecision {
        RangeEvaluator.evaluate(size: size, etag: etag, lastModified: date, range: range, ifRange: ifRange, ifNoneMatch: ifNoneMatch, maxRanges: maxRanges)
    }

    func r(_ a: UInt64, _ b: UInt64) -> ByteRange { ByteRange(first: a, last: b) }

    @Test("a-b, a- and -n, with ends past the size clamped")
    func forms() {
        #expect(decide(nil) == .full)
        #expect(decide("bytes=0-9") == .partial([r(0, 9)]))
        #expect(decide("bytes=990-") == .partial([r(990, 999)]))
        #expect(decide("bytes=-10") == .partial([r(990, 999)]))
        #expect(decide("bytes=-5000") == .partial([r(0, 999)]))
        #expect(decide("bytes=500-99999") == .partial([r(500, 999)]))
        #expect(decide("bytes=999-999") == .partial([r(999, 999)]))
        #expect(decide("bytes=0-99999999999999999999999") == .partial([r(0, 999)]))
        #expect(decide("BYTES = 1-2") == .partial([r(1, 2)]))
    }

    @Test("unsatisfiable ranges answer 416; partly satisfiable lists keep the satisfiable ones")
    func unsatisfiable() {
        #expect(decide("bytes=1000-") == .unsatisfiable)
        #expect(decide("bytes=5000-6000") == .unsatisfiable)
        #expect(decide("bytes=-0") == .unsatisfiable)
        #expect(decide("bytes=5000-6000, 0-1") == .partial([r(0, 1)]))
        #expect(decide("bytes=0-1", size: 0) == .unsatisfiable)
    }

    @Test("invalid or non-bytes Range headers are ignored (200)")
    func invalid() {
        for header in ["bytes=abc", "bytes=5-1", "bytes=", "bytes=1-2-3", "items=0-1", "bytez=0-1", "byte=0-1", "0-1", "bytes=-", "bytes=+1-2", "bytes=1 -2x"] {
            #expect(decide(header) == .full, "\(header)")
        }
    }

    @Test("several ranges are sorted and coalesced when they overlap or touch; too many answer 200")
    func multiple() {
        #expect(decide("bytes=500-599,0-9") == .partial([r(0, 9), r(500, 599)]))
        #expect(decide("bytes=0-9,5-20,21-30,100-110") == .partial([r(0, 30), r(100, 110)]))
        #expect(decide("bytes=0-0,0-0,0-0") == .partial([r(0, 0)]))
        #expect(decide("bytes=0-1,-10") == .partial([r(0, 1), r(990, 999)]))
        let many = "bytes=" + (0..<17).map { "\($0 * 10)-\($0 * 10 + 1)" }.joined(separator: ",")
        #expect(decide(many) == .full)
        let thousands = "bytes=" + (0..<5000).map { "\($0)-\($0)" }.joined(separator: ",")
        #expect(decide(thousands) == .full)
    }

    @Test("If-Range is compared strongly; a mismatch answers 200 with the whole representation")
    func ifRange() {
        #expect(decide("bytes=0-9", ifRange: etag) == .partial([r(0, 9)]))
        #expect(decide("bytes=0-9", ifRange: "\"other\"") == .full)
        #expect(decide("bytes=0-9", ifRange: "W/\"abc\"") == .full)
        #expect(decide("bytes=0-9", ifRange: date) == .partial([r(0, 9)]))
        #expect(decide("bytes=0-9", ifRange: "Mon, 23 Nov 2026 07:00:00 GMT") == .full)
    }

    @Test("If-None-Match uses weak comparison and answers 304 before ranges are looked at")
    func ifNoneMatch() {
        #expect(decide(nil, ifNoneMatch: etag) == .notModified)
        #expect(decide("bytes=0-1", ifNoneMatch: "W/\"abc\"") == .notModified)
        #expect(decide(nil, ifNoneMatch: "\"x\", \"abc\"") == .notModified)
        #expect(decide(nil, ifNoneMatch: "*") == .notModified)
        #expect(decide(nil, ifNoneMatch: "\"x\"") == .full)
    }

    /// The representation's date in seconds: `date` above.
    let modifiedAt: Int64 = 1_795_330_800

    func precondition(ifMatch: String? = nil, ifUnmodifiedSince: String? = nil, ifNoneMatch: String? = nil, range: String? = nil) -> RangeDecision {
        RangeEvaluator.evaluate(
            size: 1000, etag: etag, lastModified: date, modifiedAt: modifiedAt, range: range, ifRange: nil, ifNoneMatch: ifNoneMatch,
            ifMatch: ifMatch, ifUnmodifiedSince: ifUnmodifiedSince)
    }

    @Test("If-Match is compared strongly and answers 412 before anything else when no tag matches")
    func ifMatch() {
        #expect(precondition(ifMatch: etag) == .full)
        #expect(precondition(ifMatch: "\"x\", \"abc\"") == .full)
        #expect(precondition(ifMatch: "*") == .full)
        #expect(precondition(ifMatch: "\"x\"") == .preconditionFailed)
        #expect(precondition(ifMatch: "W/\"abc\"") == .preconditionFailed)
        // Before If-None-Match and ranges (RFC 9110 §13.2.2), as nginx orders them.
        #expect(precondition(ifMatch: "\"x\"", ifNoneMatch: etag) == .preconditionFailed)
        #expect(precondition(ifMatch: "\"x\"", range: "bytes=0-9") == .preconditionFailed)
        #expect(precondition(ifMatch: etag, range: "bytes=0-9") == .partial([r(0, 9)]))
        #expect(precondition(ifMatch: etag, ifNoneMatch: etag) == .notModified)
    }

    @Test("If-Unmodified-Since answers 412 for a date before the representation's, in all three date formats; an invalid date is ignored")
    func ifUnmodifiedSince() {
        #expect(precondition(ifUnmodifiedSince: date) == .full)
        #expect(precondition(ifUnmodifiedSince: "Mon, 23 Nov 2026 07:00:00 GMT") == .full)
        #expect(precondition(ifUnmodifiedSince: "Sun, 22 Nov 2026 06:59:59 GMT") == .preconditionFailed)
        #expect(precondition(ifUnmodifiedSince: "Sunday, 22-Nov-26 06:59:59 GMT") == .preconditionFailed)
        #expect(precondition(ifUnmodifiedSince: "Sun Nov 22 06:59:59 2026") == .preconditionFailed)
        #expect(precondition(ifUnmodifiedSince: "Sun Nov 22 07:00:00 2026") == .full)
        #expect(precondition(ifUnmodifiedSince: "Thu, 01 Jan 2015 00:00:00 GMT", range: "bytes=0-9") == .preconditionFailed)
        // Not an HTTP date: ignored (RFC 9110 §13.1.4), where nginx answers 412.
        for value in ["garbage", "", "2015-01-01T00:00:00Z", "Thu, 01 Jan 2015 00:00:00 UTC", "Thu, 31 Feb 2015 00:00:00 GMT"] {
            #expect(precondition(ifUnmodifiedSince: value) == .full, "\(value)")
        }
        // If-Match present: If-Unmodified-Since is not evaluated.
        #expect(precondition(ifMatch: etag, ifUnmodifiedSince: "Thu, 01 Jan 2015 00:00:00 GMT") == .full)
    }

    @Test("HTTP dates: IMF-fixdate, RFC 850 and asctime read alike; anything else is no date")
    func httpDates() {
        let seconds: Int64 = 784_111_777  // Sun, 06 Nov 1994 08:49:37 GMT, RFC 9110's example
        #expect(HTTPDate.parse("Sun, 06 Nov 1994 08:49:37 GMT") == seconds)
        #expect(HTTPDate.parse("Sunday, 06-Nov-94 08:49:37 GMT") == seconds)
        #expect(HTTPDate.parse("Sun Nov  6 08:49:37 1994") == seconds)
        #expect(HTTPDate.parse("Sun Nov 16 08:49:37 1994") == seconds + 10 * 86_400)
        #expect(HTTPDate.parse(HTTPDate.format(Date(timeIntervalSince1970: 1_795_530_672))) == 1_795_530_672)
        #expect(HTTPDate.parse("Sun, 06 Nov 1994 23:59:60 GMT") == seconds + 15 * 3600 + 10 * 60 + 22)
        for text in [
            "Sun, 6 Nov 1994 08:49:37 GMT", "Sun, 06 Nov 1994 08:49:37 UTC", "Sun 06 Nov 1994 08:49:37 GMT", "Sun, 06 Nov 94 08:49:37 GMT",
            "Sun, 06 Xyz 1994 08:49:37 GMT", "Sun, 06 Nov 1994 24:00:00 GMT", "Sun, 06 Nov 1994 8:49:37 GMT", "Sun, +6 Nov 1994 08:49:37 GMT",
            "Sun, 30 Feb 1994 08:49:37 GMT", "Sun Nov 6 08:49:37 1994", "Sunday, 06-Nov-1994 08:49:37 GMT", "",
        ] {
            #expect(HTTPDate.parse(text) == nil, "\(text)")
        }
    }
}

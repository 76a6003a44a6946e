import ContentDelivery
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
}

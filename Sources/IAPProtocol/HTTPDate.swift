import Foundation

/// HTTP dates (RFC 9110 §5.6.7).
///
/// Formatting is not cached here: the content server formats a response's `Date` once per second
/// per connection, and a file's `Last-Modified` once when the file is opened. Parsing serves
/// the server's `If-Unmodified-Since` and the client's `Retry-After`.
///
/// Parsing is our own rather than Foundation's `DateFormatter` or a framework's: a recipient must
/// take all three formats the RFC lists (IMF-fixdate, the obsolete RFC 850 and asctime forms),
/// the server parses on its event loop, and Hummingbird's parser is internal to it.
public enum HTTPDate {
    static let days = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"]
    static let longDays = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
    static let months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]

    /// IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`.
    public static func format(_ date: Date) -> String {
        var time = time_t(Int(date.timeIntervalSince1970))
        var parts = tm()
        gmtime_r(&time, &parts)
        func two(_ n: Int32) -> String { n < 10 ? "0\(n)" : "\(n)" }
        return "\(days[Int(parts.tm_wday)]), \(two(parts.tm_mday)) \(months[Int(parts.tm_mon)]) \(parts.tm_year + 1900) "
            + "\(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec)) GMT"
    }

    /// Seconds since 1970 of an HTTP date in any of its three formats; nil when `text` is none of
    /// them (a recipient then ignores the field that carried it). Two-digit RFC 850 years are read
    /// as the RFC says: one that looks more than 50 years ahead is in the past century.
    public static func parse<Text: StringProtocol>(_ text: Text) -> Int64? {
        let fields = String(text).split(separator: " " as Character, omittingEmptySubsequences: false).map(String.init)
        let day: Int?, month: Int?, year: Int?, clock: String
        switch fields.count {
        case 6 where fields[5] == "GMT" && fields[0].hasSuffix(",") && days.contains(String(fields[0].dropLast())):
            // IMF-fixdate: Sun, 06 Nov 1994 08:49:37 GMT
            (day, month, year, clock) = (number(fields[1], digits: 2), months.firstIndex(of: fields[2]), number(fields[3], digits: 4), fields[4])
        case 4 where fields[3] == "GMT" && fields[0].hasSuffix(",") && longDays.contains(String(fields[0].dropLast())):
            // RFC 850: Sunday, 06-Nov-94 08:49:37 GMT
            let date = fields[1].split(separator: "-", omittingEmptySubsequences: false).map(String.init)
            guard date.count == 3, let short = number(date[2], digits: 2) else { return nil }
            (day, month, clock) = (number(date[0], digits: 2), months.firstIndex(of: date[1]), fields[2])
            let century = 2000 + short
            year = century > currentYear() + 50 ? century - 100 : century
        case 5 where days.contains(fields[0]):
            // asctime: Sun Nov 16 08:49:37 1994
            (day, month, year, clock) = (number(fields[2], digits: 2), months.firstIndex(of: fields[1]), number(fields[4], digits: 4), fields[3])
        case 6 where days.contains(fields[0]) && fields[2].isEmpty:
            // asctime with a one-digit day, padded with a space: Sun Nov  6 08:49:37 1994
            (day, month, year, clock) = (number(fields[3], digits: 1), months.firstIndex(of: fields[1]), number(fields[5], digits: 4), fields[4])
        default:
            return nil
        }
        let time = clock.split(separator: ":", omittingEmptySubsequences: false).map { number(String($0), digits: 2) }
        guard let day, let month, let year, (1...31).contains(day), year >= 1900, time.count == 3,
            let hour = time[0], let minute = time[1], let second = time[2], hour < 24, minute < 60, second <= 60
        else { return nil }
        var parts = tm()
        parts.tm_year = Int32(year - 1900)
        parts.tm_mon = Int32(month)
        parts.tm_mday = Int32(day)
        parts.tm_hour = Int32(hour)
        parts.tm_min = Int32(minute)
        // A leap second is read as the second before it: timegm would carry it into the next minute.
        parts.tm_sec = Int32(min(second, 59))
        let seconds = timegm(&parts)
        // timegm carries 31 Feb into March: a day the month does not have is no date.
        guard parts.tm_mday == Int32(day), parts.tm_mon == Int32(month) else { return nil }
        return Int64(seconds)
    }

    /// Exactly `digits` ASCII digits.
    private static func number(_ text: String, digits: Int) -> Int? {
        guard text.utf8.count == digits, text.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) else { return nil }
        return Int(text)
    }

    private static func currentYear() -> Int {
        var now = time(nil)
        var parts = tm()
        gmtime_r(&now, &parts)
        return Int(parts.tm_year) + 1900
    }
}

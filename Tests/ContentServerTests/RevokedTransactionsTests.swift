import Testing

@testable import ContentServer

@Suite("The revoked ids in memory")
struct RevokedTransactionsTests {
    @Test("an App Store id is kept as a number; any other spelling as itself, so every id maps back exactly")
    func spellings() {
        #expect(RevokedTransactions.number("2000000000000001") == 2_000_000_000_000_001)
        #expect(RevokedTransactions.number("0") == 0)
        #expect(RevokedTransactions.number("9999999999999999999") == 9_999_999_999_999_999_999)
        // Another spelling of a number, or none, stays a string.
        for other in ["", "0123", "00", "12a", "-1", "+1", " 1", "1 ", "10000000000000000000", "١٢٣", "1.0"] {
            #expect(RevokedTransactions.number(other) == nil, "\(other)")
        }

        var ids = RevokedTransactions(["2000000000000001", "0123", "sandbox-7", "5"])
        #expect(ids.count == 4)
        #expect(ids.contains("2000000000000001") && ids.contains("0123") && ids.contains("sandbox-7") && ids.contains("5"))
        // "123" is not "0123", "05" is not "5".
        #expect(!ids.contains("123") && !ids.contains("05") && !ids.contains("2000000000000002"))
        #expect(!ids.insert("5") && ids.insert("05") && ids.count == 5)
        ids.remove("0123")
        ids.remove("2000000000000001")
        #expect(!ids.contains("0123") && !ids.contains("2000000000000001") && ids.count == 3)
        #expect(ids == RevokedTransactions(["5", "05", "sandbox-7"]))
        #expect(ids != RevokedTransactions(["5", "5", "sandbox-7"]))
    }
}

import Foundation
import Testing

@testable import PurchaseVerification

@Suite("Duplicate member names in signed JSON")
struct DuplicateMembersTests {
    func verdict(_ json: String) -> DuplicateMembers.Failure? {
        do {
            try DuplicateMembers.check(Array(json.utf8))
            return nil
        } catch {
            return error
        }
    }

    @Test(arguments: [
        #"{}"#, #"[]"#, #"{"a":1,"b":[{"a":2},{"a":3}],"c":{"a":{"a":null}}}"#,
        #" { "a" : -0.5e+10 , "b" : [ true , false , null ] } "#, #"{"a\"b":"\u00e9\ud83d\ude00"}"#, #""just a string""#, "12",
    ])
    func wellFormedJSONWithoutRepeatsPasses(_ json: String) {
        #expect(verdict(json) == nil)
    }

    @Test func aRepeatedNameIsFoundAtAnyDepthAndAfterUnescaping() {
        #expect(verdict(#"{"bundleId":"a","x":1,"bundleId":"b"}"#) == .duplicate("bundleId"))
        #expect(verdict(#"{"data":{"bundleId":"a","bundleId":"b"}}"#) == .duplicate("bundleId"))
        #expect(verdict(#"[{"ok":1},{"k":1,"k":2}]"#) == .duplicate("k"))
        #expect(verdict(#"{"bundleId":"a","bundle\u0049d":"b"}"#) == .duplicate("bundleId"))
        #expect(verdict(#"{"\ud83d\ude00":1,"😀":2}"#) == .duplicate("😀"))
    }

    @Test(arguments: [
        "", "{", #"{"a"}"#, #"{"a":}"#, #"{"a":1,}"#, "[1,]", "01", "1.", "-", #""\x""#, #""\ud83d""#, "\"a\u{1}\"", "tru", "{} {}",
        #"{"a":1}garbage"#,
    ])
    func notJSONIsMalformed(_ text: String) {
        #expect(verdict(text) == .malformed)
    }

    @Test func nestingIsBounded() {
        let deep = String(repeating: "[", count: 10_000) + String(repeating: "]", count: 10_000)
        #expect(verdict(deep) == .malformed)
        let fine = String(repeating: "[", count: DuplicateMembers.maxDepth - 1) + String(repeating: "]", count: DuplicateMembers.maxDepth - 1)
        #expect(verdict(fine) == nil)
    }

    @Test func invalidUTF8InANameIsMalformed() {
        #expect((try? DuplicateMembers.check([UInt8(ascii: "{"), UInt8(ascii: "\""), 0xFF, UInt8(ascii: "\""), UInt8(ascii: ":"), UInt8(ascii: "1"), UInt8(ascii: "}")])) == nil)
    }
}

import Foundation
import PurchaseVerification
import Testing

@Suite("What RFC 7515 and a careful JSON reader refuse")
struct JWSStrictnessTests {
    @Test("a crit header is refused: no JWS extension is implemented")
    func critical() async throws {
        let fixture = try Fixture()
        let payload = try fixture.payloadJSON(fixture.transaction())
        for crit in [["exp"], [String]()] {
            let token = try fixture.token(header: ["alg": "ES256", "x5c": fixture.authority.x5c, "crit": crit, "exp": 1], payload: payload)
            #expect(await VerificationErrorCode.of { _ = try await fixture.verifier().verifyTransaction(token) } == .unsupportedCriticalHeader)
        }
        // Not a list of names: malformed.
        let odd = try fixture.token(header: ["alg": "ES256", "x5c": fixture.authority.x5c, "crit": "exp"], payload: payload)
        #expect(await VerificationErrorCode.of { _ = try await fixture.verifier().verifyTransaction(odd) } == .malformed)
    }

    @Test("a name twice in the header or the payload is refused, however it is spelled")
    func duplicates() async throws {
        let fixture = try Fixture()
        let payload = String(decoding: try fixture.payloadJSON(fixture.transaction()), as: UTF8.self)
        let x5c = fixture.authority.x5c.map { "\"\($0)\"" }.joined(separator: ",")
        for (header, body) in [
            (#"{"alg":"ES256","alg":"ES256","x5c":[\#(x5c)]}"#, payload),
            (#"{"alg":"ES256","x5c":[\#(x5c)]}"#, #"{"bundleId":"com.example.other","# + payload.dropFirst()),
            (#"{"alg":"ES256","x5c":[\#(x5c)]}"#, #"{"bundle\u0049d":"com.example.other","# + payload.dropFirst()),
        ] {
            let token = try fixture.authority.signCompact(header: Data(header.utf8), payload: Data(body.utf8))
            let code = await VerificationErrorCode.of { _ = try await fixture.verifier().verifyTransaction(token) }
            #expect(code == .malformed)
        }
        // The untouched payload verifies: the refusals above are about the repeats.
        let clean = try fixture.authority.signCompact(header: Data(#"{"alg":"ES256","x5c":[\#(x5c)]}"#.utf8), payload: Data(payload.utf8))
        #expect(await VerificationErrorCode.of { _ = try await fixture.verifier().verifyTransaction(clean) } == nil)
    }
}

import Foundation
import IAPProtocol
import Testing

@Suite struct ErrorShapeTests {
    enum SampleCode: String, ErrorCode {
        case io
        case notFound = "not-found"
    }

    @Test func anErrorTravelsAsTheEnvelopeAndReadsBack() throws {
        let error = CodedError<SampleCode>(.notFound, "no such thing: create it first")
        let line = WireJSON.line(error.envelope)
        #expect(String(decoding: line, as: UTF8.self) == #"{"error":{"code":"not-found","message":"no such thing: create it first"}}"# + "\n")
        let read = ErrorEnvelope.read(line)
        #expect(read == error.envelope)
        #expect(read.code(as: SampleCode.self) == .notFound)
        #expect(read.code() == APIErrorCode.notFound)
    }

    @Test func codesAreSharedWordsAcrossFamilies() {
        let library = CodedError<SampleCode>(.io, "disk full")
        #expect(library.apiError == APIError(APIErrorCode(rawValue: "io"), "disk full"))
        #expect(CodedError<SampleCode>(CodedError<APIErrorCode>(.notFound, "x"), or: .io).code == .notFound)
        #expect(CodedError<SampleCode>(CodedError<APIErrorCode>(.revoked, "x"), or: .io).code == .io)
    }

    @Test func somethingThatIsNotAnEnvelopeStillGivesAReason() {
        let read = ErrorEnvelope.read(Array("<html>502 Bad Gateway</html>".utf8), fallbackCode: "http-502")
        #expect(read.error.code == "http-502" && read.error.message == "<html>502 Bad Gateway</html>")
        #expect(read.code() == APIErrorCode(rawValue: "http-502"))
        #expect(ErrorEnvelope.read(Array(repeating: UInt8(ascii: "x"), count: 10_000)).error.message.utf8.count == 200)
    }

    @Test func codedErrorsRoundTripAsJSONForJournals() throws {
        let error = CodedError<SampleCode>(.io, "cannot write")
        let data = try JSONEncoder().encode(error)
        #expect(String(decoding: data, as: UTF8.self).contains(#""code":"io""#))
        #expect(try JSONDecoder().decode(CodedError<SampleCode>.self, from: data) == error)
    }
}

@Suite struct ContractTests {
    @Test func grantsDecodeWithDatesAsTheServerWritesThem() throws {
        let grants = DownloadGrants(
            transactionId: "1",
            downloads: [
                GrantedDownload(
                    productId: "p", contentVersion: "1.0", contentLength: 10, sha256: "ab", url: "http://h/v1/content/t/p-1.0.zip",
                    expiresAt: Date(timeIntervalSince1970: 1_800_000_000))
            ])
        let data = WireJSON.line(grants)
        #expect(String(decoding: data, as: UTF8.self).contains(#""expiresAt":"2027-01-15T08:00:00Z""#))
        #expect(try WireJSON.decoder().decode(DownloadGrants.self, from: data) == grants)
    }

    @Test func routesBuildThePathsTheServerServes() {
        #expect(Route.content(token: "k1.a.b", productId: "com.example.p", contentVersion: "1.2") == "/v1/content/k1.a.b/com.example.p-1.2.zip")
        #expect(Route.product("com.example.p") == "/v1/products/com.example.p")
        #expect(Route.content(token: "t", productId: "p", contentVersion: "1").hasPrefix(Route.contentPrefix))
    }

    @Test func productInfoLeadsWithTheLatestVersion() {
        let latest = ProductInfo.Version(contentVersion: "2.0", contentLength: 2, extractedLength: 4, sha256: "b", publishedAt: Date(timeIntervalSince1970: 2))
        let older = ProductInfo.Version(contentVersion: "1.0", contentLength: 1, extractedLength: 2, sha256: "a", publishedAt: Date(timeIntervalSince1970: 1))
        let info = ProductInfo(productId: "p", versions: [latest, older])
        #expect(info.contentVersion == "2.0" && info.sha256 == "b" && info.contentLength == 2)
    }
}

@Suite struct BundleIdentifierTests {
    @Test func takesWhatXcodeAndOlderAppsUse() {
        for id in ["com.example.app", "com.Example-2.my_app", "a", String(repeating: "a", count: 255)] {
            #expect(BundleIdentifier.problem(id) == nil, "\(id)")
        }
    }

    @Test func namesWhatIsWrong() {
        #expect(BundleIdentifier.problem("") == "it is empty")
        #expect(BundleIdentifier.problem("com.example.app\n")?.contains("whitespace") == true)
        #expect(BundleIdentifier.problem("com.exämple")?.contains("which a bundle identifier cannot") == true)
        #expect(BundleIdentifier.problem(".com.example")?.contains("empty part") == true)
        #expect(BundleIdentifier.problem("com.example.")?.contains("empty part") == true)
        #expect(BundleIdentifier.problem(String(repeating: "a", count: 256))?.contains("at most 255") == true)
        #expect(BundleIdentifier.refusal("a b", from: "--bundle-id")?.hasPrefix("--bundle-id 'a b' is not a bundle identifier: it holds whitespace") == true)
    }
}

@Suite struct DecodingFailureTests {
    struct Inner: Codable { let sha256: String }
    struct Document: Codable {
        let version: Int
        let entries: [Inner]
    }

    func failure(_ json: String) -> String? {
        do {
            _ = try JSONDecoder().decode(Document.self, from: Data(json.utf8))
            return nil
        } catch let error as DecodingError {
            return error.plainDescription
        } catch {
            return "not a DecodingError: \(error)"
        }
    }

    @Test func namesTheFieldAndWhatIsWrongWithIt() {
        #expect(failure("{nope")?.hasPrefix("it is not valid JSON") == true)
        #expect(failure(#"{"version": 1}"#) == "field entries is missing")
        #expect(failure(#"{"version": "1", "entries": []}"#) == "field version is not a whole number")
        #expect(failure(#"{"version": 1, "entries": [{"sha256": "a"}, {"sha256": 5}]}"#) == "field entries[1].sha256 is not a string")
        #expect(failure(#"{"version": 1, "entries": [{}]}"#) == "field entries[0].sha256 is missing")
        #expect(failure(#"{"version": null, "entries": []}"#) == "field version is null where a whole number belongs")
        #expect(failure(#"{"version": 1, "entries": []}"#) == nil)
    }
}

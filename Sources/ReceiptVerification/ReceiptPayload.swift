import Foundation
import PurchaseVerification
import SwiftASN1

/// The receipt payload's ASN.1: a SET of `SEQUENCE { type INTEGER, version INTEGER, value OCTET
/// STRING }`, the in-app purchases a nested SET of the same shape inside field 17's value.
/// Reading is strict where two readers could disagree (a field twice, a non-UTF-8 string) and
/// bounded everywhere: the shape is fixed, so nothing recurses beyond it, and counts are capped.
///
/// Read with ``TLVReader`` rather than swift-asn1's tree parser: this is the hot path of receipt
/// verification, and building a node tree for 50 purchases cost 95% of a verification (issue 15's
/// goal is 2,000 receipts per second on two cores). swift-asn1 still encodes (the sandbox).
public enum ReceiptPayload {
    enum Field {
        static let receiptType = 0, bundleId = 2, appVersion = 3, opaqueValue = 4, sha1Hash = 5, creationDate = 12, inAppPurchase = 17
        static let originalAppVersion = 19, expirationDate = 21
        static let quantity = 1701, productId = 1702, transactionId = 1703, purchaseDate = 1704, originalTransactionId = 1705
        static let originalPurchaseDate = 1706, expiresDate = 1708, webOrderLineItemId = 1711, cancellationDate = 1712
    }

    /// More purchases than any real receipt holds; refused rather than parsed without end.
    public static let maximumPurchases = 10_000

    /// Reads a payload (the signed content of the container).
    public static func decode(_ bytes: ArraySlice<UInt8>) throws(VerificationError) -> AppReceipt {
        let fields = try attributes(bytes, what: "the receipt payload")
        var seen = Set<Int>()
        var receiptType: String?, bundleId: String?, appVersion: String?, originalAppVersion: String?
        var creationDate: Date?, expirationDate: Date?, opaqueValue: [UInt8] = [], sha1Hash: [UInt8] = []
        var purchases: [InAppPurchase] = []
        for (type, value) in fields {
            if type != Field.inAppPurchase {
                guard seen.insert(type).inserted else { throw malformed("field \(type) appears twice in the receipt") }
            }
            switch type {
            case Field.receiptType: receiptType = try string(value, type)
            case Field.bundleId: bundleId = try string(value, type)
            case Field.appVersion: appVersion = try string(value, type)
            case Field.originalAppVersion: originalAppVersion = try string(value, type)
            case Field.creationDate: creationDate = try date(value, type)
            case Field.expirationDate: expirationDate = try date(value, type)
            case Field.opaqueValue: opaqueValue = Array(value)
            case Field.sha1Hash: sha1Hash = Array(value)
            case Field.inAppPurchase:
                guard purchases.count < maximumPurchases else { throw malformed("the receipt holds more than \(maximumPurchases) purchases") }
                purchases.append(try purchase(value))
            default: continue  // Apple adds fields; unknown ones are not ours to judge.
            }
        }
        guard let bundleId else { throw malformed("the receipt has no bundle id (field 2)") }
        guard let appVersion else { throw malformed("the receipt has no app version (field 3)") }
        guard let creationDate else { throw malformed("the receipt has no creation date (field 12)") }
        return AppReceipt(
            receiptType: receiptType, bundleId: bundleId, appVersion: appVersion, originalAppVersion: originalAppVersion,
            creationDate: creationDate, expirationDate: expirationDate, opaqueValue: opaqueValue, sha1Hash: sha1Hash, inAppPurchases: purchases)
    }

    static func purchase(_ bytes: ArraySlice<UInt8>) throws(VerificationError) -> InAppPurchase {
        var seen = Set<Int>()
        var quantity = 1, productId: String?, transactionId: String?, originalTransactionId: String?
        var purchaseDate: Date?, originalPurchaseDate: Date?, expiresDate: Date?, webOrderLineItemId: Int64?, cancellationDate: Date?
        for (type, value) in try attributes(bytes, what: "an in-app purchase") {
            guard seen.insert(type).inserted else { throw malformed("field \(type) appears twice in one in-app purchase") }
            switch type {
            case Field.quantity:
                let value = try integer(value, type)
                guard let small = Int(exactly: value), small >= 0 else { throw malformed("quantity \(value) is out of range") }
                quantity = small
            case Field.productId: productId = try string(value, type)
            case Field.transactionId: transactionId = try string(value, type)
            case Field.originalTransactionId: originalTransactionId = try string(value, type)
            case Field.purchaseDate: purchaseDate = try date(value, type)
            case Field.originalPurchaseDate: originalPurchaseDate = try date(value, type)
            case Field.expiresDate: expiresDate = try date(value, type)
            case Field.webOrderLineItemId: webOrderLineItemId = try integer(value, type)
            case Field.cancellationDate: cancellationDate = try date(value, type)
            default: continue
            }
        }
        guard let productId, !productId.isEmpty else { throw malformed("an in-app purchase has no product id (field 1702)") }
        guard let transactionId, !transactionId.isEmpty else { throw malformed("an in-app purchase has no transaction id (field 1703)") }
        guard let purchaseDate else { throw malformed("in-app purchase \(transactionId) has no purchase date (field 1704)") }
        return InAppPurchase(
            quantity: quantity, productId: productId, transactionId: transactionId, originalTransactionId: originalTransactionId ?? transactionId,
            purchaseDate: purchaseDate, originalPurchaseDate: originalPurchaseDate, expiresDate: expiresDate, webOrderLineItemId: webOrderLineItemId,
            cancellationDate: cancellationDate)
    }

    /// The `(type, value)` pairs of a SET of attribute sequences.
    static func attributes(_ bytes: ArraySlice<UInt8>, what: String) throws(VerificationError) -> [(Int, ArraySlice<UInt8>)] {
        var outer = TLVReader(bytes)
        guard let root = try outer.next(what), root.tag == 0x31, outer.isAtEnd else {
            throw malformed("\(what) is not an ASN.1 SET of attributes")
        }
        var result: [(Int, ArraySlice<UInt8>)] = []
        var set = TLVReader(root.content)
        while !set.isAtEnd {
            guard let attribute = try set.next(what), attribute.tag == 0x30 else {
                throw malformed("\(what) holds something other than an attribute SEQUENCE")
            }
            var parts = TLVReader(attribute.content)
            guard let typeNode = try parts.next(what), typeNode.tag == 0x02, let versionNode = try parts.next(what), versionNode.tag == 0x02,
                let valueNode = try parts.next(what), valueNode.tag == 0x04, parts.isAtEnd
            else {
                throw malformed("an attribute of \(what) is not {type INTEGER, version INTEGER, value OCTET STRING}")
            }
            guard let type = Int(exactly: try integerContent(typeNode.content, "an attribute type")) else {
                throw malformed("an attribute type of \(what) is out of range")
            }
            _ = try integerContent(versionNode.content, "an attribute version")
            result.append((type, valueNode.content))
        }
        return result
    }

    /// The one primitive value inside an attribute's OCTET STRING.
    static func node(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> (UInt8, ArraySlice<UInt8>) {
        var reader = TLVReader(value)
        guard let node = try reader.next("field \(type)"), reader.isAtEnd, node.tag & 0x20 == 0 else {
            throw malformed("field \(type)'s value is not one primitive ASN.1 value")
        }
        return (node.tag, node.content)
    }

    static func string(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> String {
        let (tag, bytes) = try node(value, type)
        // UTF8String (12) or IA5String (22).
        guard tag == 0x0C || tag == 0x16 else { throw malformed("field \(type) is not a UTF8String or IA5String") }
        guard let text = String(validating: bytes, as: UTF8.self) else { throw malformed("field \(type) is not valid UTF-8") }
        if tag == 0x16, !bytes.allSatisfy({ $0 < 0x80 }) { throw malformed("field \(type) is an IA5String with non-ASCII bytes") }
        return text
    }

    /// RFC 3339 in an IA5String; an empty string is no date (Apple leaves some empty).
    static func date(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> Date? {
        let (tag, bytes) = try node(value, type)
        guard tag == 0x16 || tag == 0x0C else { throw malformed("field \(type) is not an IA5String date") }
        if bytes.isEmpty { return nil }
        guard let date = RFC3339.parse(bytes) else {
            throw malformed("field \(type) is not an RFC 3339 date: \(String(decoding: bytes.prefix(40), as: UTF8.self))")
        }
        return date
    }

    static func integer(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> Int64 {
        let (tag, bytes) = try node(value, type)
        guard tag == 0x02 else { throw malformed("field \(type) is not an INTEGER") }
        return try integerContent(bytes, "field \(type)")
    }

    /// A two's-complement INTEGER's content, at most 64 bits, minimally encoded.
    static func integerContent(_ bytes: ArraySlice<UInt8>, _ what: String) throws(VerificationError) -> Int64 {
        guard !bytes.isEmpty, bytes.count <= 8 else { throw malformed("\(what) is not an INTEGER that fits 64 bits") }
        var value: Int64 = bytes.first! & 0x80 != 0 ? -1 : 0
        for byte in bytes { value = value << 8 | Int64(byte) }
        return value
    }

    static func malformed(_ message: String) -> VerificationError { VerificationError(.malformed, message) }

    // MARK: Encoding (the sandbox's receipts)

    /// Encodes a receipt payload in DER, fields in Apple's order of types.
    public static func encode(_ receipt: AppReceipt) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.appendConstructedNode(identifier: .set) { set in
            func attribute(_ type: Int, _ value: [UInt8]) throws { try appendAttribute(type, value, to: &set) }
            if let type = receipt.receiptType { try attribute(Field.receiptType, try utf8(type)) }
            try attribute(Field.bundleId, try utf8(receipt.bundleId))
            try attribute(Field.appVersion, try utf8(receipt.appVersion))
            try attribute(Field.opaqueValue, receipt.opaqueValue)
            try attribute(Field.sha1Hash, receipt.sha1Hash)
            try attribute(Field.creationDate, try ia5Date(receipt.creationDate))
            for purchase in receipt.inAppPurchases { try attribute(Field.inAppPurchase, try encode(purchase)) }
            if let original = receipt.originalAppVersion { try attribute(Field.originalAppVersion, try utf8(original)) }
            if let expiration = receipt.expirationDate { try attribute(Field.expirationDate, try ia5Date(expiration)) }
        }
        return serializer.serializedBytes
    }

    /// One `SEQUENCE { type, version 1, value }` of a payload SET.
    static func appendAttribute(_ type: Int, _ value: [UInt8], to set: inout DER.Serializer) throws {
        try set.appendConstructedNode(identifier: .sequence) { sequence in
            try sequence.serialize(type)
            try sequence.serialize(1)
            try sequence.serialize(ASN1OctetString(contentBytes: value[...]))
        }
    }

    static func encode(_ purchase: InAppPurchase) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.appendConstructedNode(identifier: .set) { set in
            func attribute(_ type: Int, _ value: [UInt8]) throws { try appendAttribute(type, value, to: &set) }
            try attribute(Field.quantity, try integer(Int64(purchase.quantity)))
            try attribute(Field.productId, try utf8(purchase.productId))
            try attribute(Field.transactionId, try utf8(purchase.transactionId))
            try attribute(Field.purchaseDate, try ia5Date(purchase.purchaseDate))
            try attribute(Field.originalTransactionId, try utf8(purchase.originalTransactionId))
            try attribute(Field.originalPurchaseDate, try ia5Date(purchase.originalPurchaseDate ?? purchase.purchaseDate))
            try attribute(Field.expiresDate, try ia5Date(purchase.expiresDate))
            if let line = purchase.webOrderLineItemId { try attribute(Field.webOrderLineItemId, try integer(line)) }
            try attribute(Field.cancellationDate, try ia5Date(purchase.cancellationDate))
        }
        return serializer.serializedBytes
    }

    static func utf8(_ text: String) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.serialize(ASN1UTF8String(text))
        return serializer.serializedBytes
    }

    static func ia5Date(_ date: Date?) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.serialize(try ASN1IA5String(date.map { $0.formatted(.iso8601) } ?? ""))
        return serializer.serializedBytes
    }

    static func integer(_ value: Int64) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.serialize(value)
        return serializer.serializedBytes
    }
}

/// Definite-length DER/BER tag-length-value reading over a byte slice, without allocation.
/// Indefinite lengths are refused (payloads are DER; the container's BER is libcrypto's to read).
struct TLVReader {
    struct Element {
        let tag: UInt8
        let content: ArraySlice<UInt8>
    }

    private var bytes: ArraySlice<UInt8>

    init(_ bytes: ArraySlice<UInt8>) { self.bytes = bytes }

    var isAtEnd: Bool { bytes.isEmpty }

    mutating func next(_ what: String) throws(VerificationError) -> Element? {
        guard let tag = bytes.first else { return nil }
        var index = bytes.startIndex + 1
        guard tag & 0x1F != 0x1F else { throw ReceiptPayload.malformed("\(what) uses a multi-byte ASN.1 tag") }
        guard index < bytes.endIndex else { throw ReceiptPayload.malformed("\(what) is truncated") }
        let first = bytes[index]
        index += 1
        var length = 0
        if first < 0x80 {
            length = Int(first)
        } else {
            let count = Int(first & 0x7F)
            guard count > 0 else { throw ReceiptPayload.malformed("\(what) uses an indefinite length inside the payload") }
            guard count <= 4, bytes.endIndex - index >= count else { throw ReceiptPayload.malformed("\(what) has an impossible length") }
            for _ in 0..<count {
                length = length << 8 | Int(bytes[index])
                index += 1
            }
        }
        guard length <= bytes.endIndex - index else { throw ReceiptPayload.malformed("\(what) claims \(length) bytes but holds \(bytes.endIndex - index)") }
        let content = bytes[index..<index + length]
        bytes = bytes[(index + length)...]
        return Element(tag: tag, content: content)
    }
}

/// RFC 3339 timestamps as receipts carry them (`2026-11-23T19:00:00Z`, optionally with a
/// fraction or an offset). Hand-written for the same reason as ``TLVReader``: Foundation's
/// ISO 8601 parser was a tenth of a verification.
enum RFC3339 {
    static func parse(_ bytes: ArraySlice<UInt8>) -> Date? {
        let b = Array(bytes)
        guard b.count >= 20, b[4] == UInt8(ascii: "-"), b[7] == UInt8(ascii: "-"), b[10] == UInt8(ascii: "T") || b[10] == UInt8(ascii: "t"),
            b[13] == UInt8(ascii: ":"), b[16] == UInt8(ascii: ":")
        else { return nil }
        func number(_ from: Int, _ count: Int) -> Int? {
            var value = 0
            for i in from..<from + count {
                guard b[i] >= 0x30, b[i] <= 0x39 else { return nil }
                value = value * 10 + Int(b[i] - 0x30)
            }
            return value
        }
        guard let year = number(0, 4), let month = number(5, 2), let day = number(8, 2), let hour = number(11, 2), let minute = number(14, 2),
            let second = number(17, 2), (1...12).contains(month), (1...31).contains(day), hour < 24, minute < 60, second < 61
        else { return nil }
        var index = 19
        var fraction = 0.0
        if b[index] == UInt8(ascii: ".") {
            index += 1
            var scale = 0.1
            let start = index
            while index < b.count, b[index] >= 0x30, b[index] <= 0x39 {
                fraction += Double(b[index] - 0x30) * scale
                scale /= 10
                index += 1
            }
            guard index > start, index - start <= 9 else { return nil }
        }
        guard index < b.count else { return nil }
        var offset = 0
        switch b[index] {
        case UInt8(ascii: "Z"), UInt8(ascii: "z"):
            guard index + 1 == b.count else { return nil }
        case UInt8(ascii: "+"), UInt8(ascii: "-"):
            guard index + 6 == b.count, b[index + 3] == UInt8(ascii: ":"), let h = number(index + 1, 2), let m = number(index + 4, 2), h < 24, m < 60 else {
                return nil
            }
            offset = (h * 60 + m) * 60 * (b[index] == UInt8(ascii: "+") ? 1 : -1)
        default: return nil
        }
        // Days from 1970-01-01 in the proleptic Gregorian calendar (Howard Hinnant's days_from_civil).
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yearOfEra = y - era * 400
        let dayOfYear = (153 * (month + (month > 2 ? -3 : 9)) + 2) / 5 + day - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        let days = era * 146_097 + dayOfEra - 719_468
        let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offset
        return Date(timeIntervalSince1970: TimeInterval(seconds) + fraction)
    }
}

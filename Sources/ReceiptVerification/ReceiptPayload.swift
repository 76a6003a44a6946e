import Foundation
import PurchaseVerification
import SwiftASN1

/// The receipt payload's ASN.1: a SET of `SEQUENCE { type INTEGER, version INTEGER, value OCTET
/// STRING }`, the in-app purchases a nested SET of the same shape inside field 17's value.
/// Reading is strict where two readers could disagree (a field twice, a non-UTF-8 string) and
/// bounded everywhere (swift-asn1 limits nesting; counts are capped here).
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
        do {
            let root = try BER.parse(bytes)
            guard root.identifier == .set, case .constructed(let children) = root.content else {
                throw malformed("\(what) is not an ASN.1 SET of attributes")
            }
            var result: [(Int, ArraySlice<UInt8>)] = []
            for child in children {
                guard child.identifier == .sequence, case .constructed(let parts) = child.content else {
                    throw malformed("\(what) holds something other than an attribute SEQUENCE")
                }
                var iterator = parts.makeIterator()
                guard let typeNode = iterator.next(), let versionNode = iterator.next(), let valueNode = iterator.next(), iterator.next() == nil else {
                    throw malformed("an attribute of \(what) is not {type, version, value}")
                }
                let type = try Int(berEncoded: typeNode)
                _ = try Int(berEncoded: versionNode)
                let value = try ASN1OctetString(berEncoded: valueNode)
                result.append((type, value.bytes))
            }
            return result
        } catch let error as VerificationError {
            throw error
        } catch {
            throw malformed("\(what) is not valid ASN.1: \(error)")
        }
    }

    static func node(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> (ASN1Identifier, ArraySlice<UInt8>) {
        guard let node = try? BER.parse(value), case .primitive(let bytes) = node.content else {
            throw malformed("field \(type)'s value is not a primitive ASN.1 value")
        }
        return (node.identifier, bytes)
    }

    static func string(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> String {
        let (identifier, bytes) = try node(value, type)
        guard identifier == .utf8String || identifier == .ia5String else { throw malformed("field \(type) is not a UTF8String or IA5String") }
        guard let text = String(validating: bytes, as: UTF8.self) else { throw malformed("field \(type) is not valid UTF-8") }
        if identifier == .ia5String, !bytes.allSatisfy({ $0 < 0x80 }) { throw malformed("field \(type) is an IA5String with non-ASCII bytes") }
        return text
    }

    /// RFC 3339 in an IA5String; an empty string is no date (Apple leaves some empty).
    static func date(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> Date? {
        let text = try string(value, type)
        if text.isEmpty { return nil }
        if let date = try? Date(text, strategy: .iso8601) { return date }
        if let date = try? Date(text, strategy: Date.ISO8601FormatStyle(includingFractionalSeconds: true)) { return date }
        throw malformed("field \(type) is not an RFC 3339 date: \(text.prefix(40))")
    }

    static func integer(_ value: ArraySlice<UInt8>, _ type: Int) throws(VerificationError) -> Int64 {
        guard let node = try? BER.parse(value), let number = try? Int64(berEncoded: node) else {
            throw malformed("field \(type) is not an INTEGER that fits 64 bits")
        }
        return number
    }

    static func malformed(_ message: String) -> VerificationError { VerificationError(.malformed, message) }

    // MARK: Encoding (the sandbox's receipts)

    /// Encodes a receipt payload in DER, fields in Apple's order of types.
    public static func encode(_ receipt: AppReceipt) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.appendConstructedNode(identifier: .set) { set in
            func attribute(_ type: Int, _ value: [UInt8]) throws {
                try set.appendConstructedNode(identifier: .sequence) { sequence in
                    try sequence.serialize(type)
                    try sequence.serialize(1)
                    try sequence.serialize(ASN1OctetString(contentBytes: value[...]))
                }
            }
            if let type = receiptType(receipt) { try attribute(Field.receiptType, try utf8(type)) }
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

    static func receiptType(_ receipt: AppReceipt) -> String? { receipt.receiptType }

    static func encode(_ purchase: InAppPurchase) throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.appendConstructedNode(identifier: .set) { set in
            func attribute(_ type: Int, _ value: [UInt8]) throws {
                try set.appendConstructedNode(identifier: .sequence) { sequence in
                    try sequence.serialize(type)
                    try sequence.serialize(1)
                    try sequence.serialize(ASN1OctetString(contentBytes: value[...]))
                }
            }
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

import Foundation

extension DecodingError {
    /// What is wrong with a JSON document, in a user's words and with the field's path
    /// (`entries[3].sha256`): Foundation's own description of a `DecodingError` is its Swift
    /// structure ("dataCorrupted(Swift.DecodingError.Context(codingPath: …") and names no field.
    public var plainDescription: String {
        switch self {
        case .dataCorrupted(let context):
            // Bytes that are not JSON at all fail at the root; the decoders of Darwin and of
            // swift-foundation word it differently, and only some give the parser's reason.
            if context.codingPath.isEmpty, context.underlyingError != nil || context.debugDescription.contains("not valid JSON") {
                return "it is not valid JSON" + (context.underlyingError.map { ": \(($0 as NSError).localizedDescription)" } ?? "")
            }
            return Self.at(context.codingPath, context.debugDescription)
        case .keyNotFound(let key, let context):
            return "field \(Self.path(context.codingPath + [key])) is missing"
        case .typeMismatch(let type, let context):
            return "field \(Self.path(context.codingPath)) is not \(Self.kind(type))"
        case .valueNotFound(let type, let context):
            return "field \(Self.path(context.codingPath)) is null where \(Self.kind(type)) belongs"
        @unknown default:
            return "\(self)"
        }
    }

    private static func at(_ codingPath: [any CodingKey], _ text: String) -> String {
        codingPath.isEmpty ? text : "field \(path(codingPath)): \(text)"
    }

    /// `entries[3].sha256`.
    private static func path(_ codingPath: [any CodingKey]) -> String {
        var text = ""
        for key in codingPath {
            if let index = key.intValue {
                text += "[\(index)]"
            } else {
                text += (text.isEmpty ? "" : ".") + key.stringValue
            }
        }
        return text.isEmpty ? "(the whole document)" : text
    }

    private static func kind(_ type: Any.Type) -> String {
        switch type {
        case is String.Type: "a string"
        case is Bool.Type: "true or false"
        case is any BinaryInteger.Type: "a whole number"
        case is any BinaryFloatingPoint.Type: "a number"
        case is [Any].Type: "an array"
        case is [String: Any].Type: "an object"
        default: "a \(type)"
        }
    }
}

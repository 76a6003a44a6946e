import Foundation

/// The `ContentInfo.plist` at the root of a content package: which product and version it holds.
public struct ContentInfo: Sendable, Equatable {
    /// The archive path of the property list.
    public static let fileName = "ContentInfo.plist"
    /// The folder that holds the payload, as StoreKit handed it to apps.
    public static let payloadFolder = "Contents"

    public var productIdentifier: ProductIdentifier
    public var contentVersion: ContentVersion

    public init(productIdentifier: ProductIdentifier, contentVersion: ContentVersion) {
        self.productIdentifier = productIdentifier
        self.contentVersion = contentVersion
    }

    private struct Keys: Decodable {
        var ContentVersion: String?
        var IAPProductIdentifier: String?
    }

    /// Reads a property list (XML or binary), as Xcode's In-App Purchase Content target writes it.
    /// - Parameter source: names the file in error messages.
    public init(plist data: Data, source: String) throws(ArchiveError) {
        let keys: Keys
        do {
            keys = try PropertyListDecoder().decode(Keys.self, from: data)
        } catch {
            throw .invalid("\(source) is not a readable property list: save it as an XML property list with the keys ContentVersion and IAPProductIdentifier")
        }
        guard let version = keys.ContentVersion else {
            throw .invalid("\(source) has no ContentVersion string: add one, such as <key>ContentVersion</key><string>1.0</string>")
        }
        guard let product = keys.IAPProductIdentifier else {
            throw .invalid("\(source) has no IAPProductIdentifier string: add the product identifier the content belongs to")
        }
        do {
            self.contentVersion = try ContentVersion(version)
            self.productIdentifier = try ProductIdentifier(product)
        } catch {
            throw .invalid("\(source): \(error.message)")
        }
    }

    /// The canonical XML property list: the same bytes for the same product and version, always.
    public var plistData: Data {
        let xml = """
            <?xml version="1.0" encoding="UTF-8"?>
            <!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
            <plist version="1.0">
            <dict>
            \t<key>ContentVersion</key>
            \t<string>\(contentVersion.string)</string>
            \t<key>IAPProductIdentifier</key>
            \t<string>\(productIdentifier.rawValue)</string>
            </dict>
            </plist>

            """
        // Both values are restricted to characters that need no XML escaping.
        return Data(xml.utf8)
    }
}

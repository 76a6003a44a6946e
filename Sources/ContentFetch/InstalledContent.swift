import ContentArchive
import Foundation

/// A product's content as a fetcher installed it: what an app reads at launch to find the content
/// it has, as it kept `SKDownload.contentURL` with StoreKit's hosted content.
public struct InstalledContent: Sendable, Equatable, Codable {
    public var productId: String
    public var contentVersion: String
    /// `<content>/<productId>/<contentVersion>`: `ContentInfo.plist` and `Contents/`.
    public var contentURL: URL

    public init(productId: String, contentVersion: String, contentURL: URL) {
        self.productId = productId
        self.contentVersion = contentVersion
        self.contentURL = contentURL
    }

    /// Every product installed in `contentDirectory`, by product id, each with its installed
    /// version. Only complete installs count: a version folder appears by one rename once
    /// extracted and verified, and its `ContentInfo.plist` must name that product and version;
    /// hidden folders (an extraction in progress, an old version being removed) and anything else
    /// are ignored. Were two versions of a product there (a run stopped between installing one
    /// and removing the other), the newest is given.
    public static func all(in contentDirectory: String) -> [InstalledContent] {
        let products = (try? FileManager.default.contentsOfDirectory(atPath: contentDirectory)) ?? []
        return products.sorted().compactMap { name in
            guard !name.hasPrefix("."), (try? ProductIdentifier(name)) != nil else { return nil }
            return product(name, in: contentDirectory)
        }
    }

    /// The installed content of `productId` in `contentDirectory`, or nil when none is installed.
    public static func product(_ productId: String, in contentDirectory: String) -> InstalledContent? {
        guard let product = try? ProductIdentifier(productId) else { return nil }
        let folder = contentDirectory + "/" + productId
        var newest: (version: ContentVersion, content: InstalledContent)?
        for name in (try? FileManager.default.contentsOfDirectory(atPath: folder)) ?? [] where !name.hasPrefix(".") {
            guard let version = try? ContentVersion(name),
                isComplete(folder + "/" + name, as: ContentInfo(productIdentifier: product, contentVersion: version))
            else { continue }
            if let newest, !(newest.version < version) { continue }
            newest = (version, InstalledContent(productId: productId, contentVersion: name, contentURL: URL(fileURLWithPath: folder + "/" + name, isDirectory: true)))
        }
        return newest?.content
    }

    /// Whether `folder` holds a complete install of `info`: its `ContentInfo.plist` names that
    /// product and version (a version folder appears by one rename, once extracted and verified).
    static func isComplete(_ folder: String, as info: ContentInfo) -> Bool {
        let plist = folder + "/" + ContentInfo.fileName
        guard let data = FileManager.default.contents(atPath: plist) else { return false }
        return (try? ContentInfo(plist: data, source: plist)) == info
    }
}

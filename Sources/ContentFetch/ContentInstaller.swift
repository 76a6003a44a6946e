import ContentArchive
import Foundation

/// Installs a verified archive as `<content>/<productId>/<contentVersion>/` (the `contentURL`)
/// with ``SafeExtractor``, atomically, then removes the product's older versions.
struct ContentInstaller: Sendable {
    let contentDirectory: String

    func destination(productId: String, contentVersion: String) -> String {
        contentDirectory + "/" + productId + "/" + contentVersion
    }

    /// Whether `record`'s version is installed already (an earlier run stopped before it could
    /// record that it had installed it).
    func isInstalled(_ record: DownloadRecord) -> Bool {
        guard let expected = try? expectedInfo(record) else { return false }
        let plist = destination(productId: record.productId, contentVersion: record.contentVersion) + "/" + ContentInfo.fileName
        guard let data = FileManager.default.contents(atPath: plist) else { return false }
        return (try? ContentInfo(plist: data, source: plist)) == expected
    }

    /// Extracts `archive` for `record` and returns the installed folder.
    func install(archive: String, for record: DownloadRecord) throws(FetchError) -> String {
        let expected = try expectedInfo(record)
        let destination = destination(productId: record.productId, contentVersion: record.contentVersion)
        let parent = contentDirectory + "/" + record.productId
        // An extraction killed part-way leaves its temporary folder: remove it before trying again.
        for name in (try? FileManager.default.contentsOfDirectory(atPath: parent)) ?? []
        where name.hasPrefix(".\(record.contentVersion).extracting-") {
            try? FileManager.default.removeItem(atPath: parent + "/" + name)
        }
        if !isInstalled(record) {
            do {
                try SafeExtractor.extract(archive: archive, to: destination, expecting: expected)
            } catch {
                throw FetchError(.install, error.message)
            }
        }
        for name in (try? FileManager.default.contentsOfDirectory(atPath: parent)) ?? []
        where !name.hasPrefix(".") && name != record.contentVersion {
            if let version = try? ContentVersion(name), version < expected.contentVersion {
                try? FileManager.default.removeItem(atPath: parent + "/" + name)
            }
        }
        return destination
    }

    private func expectedInfo(_ record: DownloadRecord) throws(FetchError) -> ContentInfo {
        do {
            return ContentInfo(
                productIdentifier: try ProductIdentifier(record.productId),
                contentVersion: try ContentVersion(record.contentVersion))
        } catch {
            throw FetchError(.install, "the grant names an invalid product or version: \(error)")
        }
    }
}

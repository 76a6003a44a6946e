import ContentArchive
import DurableFiles
import Foundation
import Synchronization

/// Installs a verified archive as `<content>/<productId>/<contentVersion>/` (the `contentURL`)
/// with ``SafeExtractor``, atomically, then removes the product's other versions.
struct ContentInstaller: Sendable {
    let contentDirectory: String

    func destination(productId: String, contentVersion: String) -> String {
        contentDirectory + "/" + productId + "/" + contentVersion
    }

    /// Whether `record`'s version is installed already (an earlier run stopped before it could
    /// record that it had installed it).
    func isInstalled(_ record: DownloadRecord) -> Bool {
        guard let expected = try? expectedInfo(record) else { return false }
        return InstalledContent.isComplete(destination(productId: record.productId, contentVersion: record.contentVersion), as: expected)
    }

    /// An extraction of `record`'s whole archive as it downloads, following `manifest`'s layout
    /// (the grant's, checked when fetched); nil for a delta or a version installed already.
    func streamingExtraction(of manifest: ArchiveManifest, for record: DownloadRecord) -> StreamingExtractor? {
        guard record.delta == nil, !isInstalled(record) else { return nil }
        return try? StreamingExtractor(manifest: manifest, destination: destination(productId: record.productId, contentVersion: record.contentVersion))
    }

    /// Installs `archive` for `record` and returns the installed folder: puts `extracted` in
    /// place when it took every byte of the archive and agrees with it, else extracts the archive.
    /// With `manifest`, records the installed files for the next update.
    func install(archive: String, for record: DownloadRecord, manifest: ArchiveManifest? = nil, extracted: StreamingExtractor? = nil) throws(FetchError) -> String {
        try install(record, manifest: manifest) { (destination, expected) throws(ArchiveError) in
            // `finish` refuses, having given up, an extraction that did not take every byte or was abandoned.
            if let extracted, extracted.destination == destination, (try? extracted.finish(archive: archive, expecting: expected)) != nil {
                return [:]
            }
            extracted?.abandon(because: "the archive is extracted instead")
            // The archive is removed once installed: nothing gains from keeping it cached.
            try SafeExtractor.extract(archive: archive, to: destination, expecting: expected, readOnce: true)
            return [:]
        }
    }

    /// Builds `record`'s version from a delta update: fetched entries from `partial`, the others
    /// from the installed version `plan` names; returns the installed folder.
    func installDelta(
        partial: String, manifest: ArchiveManifest, plan: DeltaPlan, installed known: InstalledVersion?, for record: DownloadRecord
    ) throws(FetchError) -> String {
        let previous = destination(productId: record.productId, contentVersion: plan.previousVersion)
        guard let installed = known ?? installedVersion(productId: record.productId), installed.contentVersion == plan.previousVersion else {
            throw FetchError(.install, "\(record.productId) \(plan.previousVersion), which the update starts from, is no longer installed")
        }
        // Not looked at again here (the plan looked at every one): each is checked as it is used.
        // A link shares the installed file's inode, so its identity is the installed file's: one
        // changed since it was recorded fails the install (and the fetcher falls back to the
        // whole archive) instead of being installed as the new version's. A copy (where links
        // are impossible) is hashed against the manifest. The identities seen are the new
        // version's: its record needs no second look at those files.
        let reused = DeltaPlan.sources(for: manifest, installed: installed, folder: previous, looking: false)
        Failpoint.hit("delta-sources-chosen")
        let recorded = Dictionary(installed.files.map { ($0.path, $0) }, uniquingKeysWith: { first, _ in first })
        let linked = Mutex<[String: FileIdentity]>([:])
        let stillInstalled: @Sendable (String, String, String) -> Bool = { path, source, link in
            guard let was = recorded[source], let now = FileIdentity.of(link), was.isIdentity(now) else { return false }
            linked.withLock { $0[path] = now }
            return true
        }
        return try install(record, manifest: manifest) { (destination, expected) throws(ArchiveError) in
            try SafeExtractor.assemble(
                partialArchive: partial, manifest: manifest, fetched: Set(plan.fetched), reused: reused,
                previousFolder: previous, to: destination, expecting: expected, linked: stillInstalled)
            return linked.withLock { $0 }
        }
    }

    /// Removes the folders of extractions that processes no longer running left in `productId`'s
    /// folder (a run killed while downloading), whatever their version: each holds up to an
    /// archive's worth of bytes. Live ones are locked by their process and stay.
    func removeLeftoverExtractions(productId: String) {
        // At any age: one this sweep takes before its process locked it is abandoned by that
        // process, which then installs from its archive.
        _ = UnfinishedFiles.removeLeftovers(in: contentDirectory + "/" + productId, minimumAge: 0) {
            $0.hasPrefix(".") && $0.contains(StreamingExtractor.marker)
        }
    }

    /// Puts `record`'s version in place with `build` (unless an earlier run did), then removes
    /// the product's other versions, only once the new one is complete, and records the new one's
    /// files when `manifest` is given. `build` returns the identities it saw of the files it
    /// placed, by entry path, which the record then takes as they are.
    private func install(
        _ record: DownloadRecord, manifest: ArchiveManifest?,
        build: (String, ContentInfo) throws(ArchiveError) -> [String: FileIdentity]
    ) throws(FetchError) -> String {
        let expected = try expectedInfo(record)
        let destination = destination(productId: record.productId, contentVersion: record.contentVersion)
        let parent = contentDirectory + "/" + record.productId
        // What killed runs left: an extraction's temporary folder, an older version half removed.
        // (Streamed extractions' folders are swept when the download starts: ``removeLeftoverExtractions(productId:)``.)
        for name in (try? FileManager.default.contentsOfDirectory(atPath: parent)) ?? []
        where name.hasPrefix(".\(record.contentVersion).extracting-") || (name.hasPrefix(".") && name.contains(Self.removingMarker)) {
            try? FileManager.default.removeItem(atPath: parent + "/" + name)
        }
        var known: [String: FileIdentity] = [:]
        if !isInstalled(record) {
            do { known = try build(destination, expected) } catch { throw FetchError(.install, error.message) }
        }
        // Every other version leaves at once, newer ones too: the server grants what this
        // purchase should have, and after a rollback that is an older version, which must not
        // sit beside the one rolled back (an app looking for the newest would take the bad
        // one). Each is renamed out of sight: an app never finds it half removed, and a run
        // killed while removing it leaves a hidden folder the next install removes. Its files then go while the new version's are recorded: on a 5,000-file delta
        // update those were two 50 ms steps, one after the other, between the install and the
        // finish (docs/performance.md).
        var leaving: [String] = []
        for name in (try? FileManager.default.contentsOfDirectory(atPath: parent)) ?? []
        where !name.hasPrefix(".") && name != record.contentVersion {
            // Only folders named as versions are ours to remove.
            guard (try? ContentVersion(name)) != nil else { continue }
            let hidden = parent + "/." + name + Self.removingMarker + String(UInt32.random(in: 0...UInt32.max))
            if rename(parent + "/" + name, hidden) == 0 {
                leaving.append(hidden)
            } else {
                try? FileManager.default.removeItem(atPath: parent + "/" + name)
            }
        }
        if !leaving.isEmpty { Failpoint.hit("old-version-hidden") }
        DispatchQueue.concurrentPerform(iterations: 2) { [leaving, known] lane in
            if lane == 0 {
                for path in leaving { try? FileManager.default.removeItem(atPath: path) }
            } else if let manifest {
                recordInstalled(manifest, at: destination, known: known)
            }
        }
        return destination
    }

    /// In the name of an older version's folder while it is being removed.
    static let removingMarker = ".removing-"

    /// The version of `productId` installed with a manifest, which a delta update starts from.
    func installedVersion(productId: String) -> InstalledVersion? {
        let path = InstalledVersion.path(contentDirectory: contentDirectory, productId: productId)
        guard let data = FileManager.default.contents(atPath: path),
            let installed = InstalledVersion.decode(data),
            installed.productId == productId
        else { return nil }
        let folder = destination(productId: productId, contentVersion: installed.contentVersion)
        return access(folder, F_OK) == 0 ? installed : nil
    }

    /// Remembers `manifest` and the identity of each file installed at `folder`, for the next update.
    /// `known`: identities already seen of files at `folder`, by entry path.
    func recordInstalled(_ manifest: ArchiveManifest, at folder: String, known: [String: FileIdentity] = [:]) {
        let path = InstalledVersion.path(contentDirectory: contentDirectory, productId: manifest.productId.rawValue)
        try? FileManager.default.createDirectory(atPath: (path as NSString).deletingLastPathComponent, withIntermediateDirectories: true)
        let record = InstalledVersion.record(manifest: manifest, folder: folder, known: known)
        try? AtomicFile.write(record.encoded(), to: path, permissions: 0o644)
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

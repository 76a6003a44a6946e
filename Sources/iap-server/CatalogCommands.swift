import ArgumentParser
import CommandLineReporting
import ContentArchive
import ContentCatalog
import Foundation
import IAPProtocol

struct Publish: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Publish an archive into the catalog (the same checks as PUT /v1/admin/archives).",
        discussion:
            "Exit codes: 0 published (or identical bytes already published), 1 invalid archive, 2 version conflict, 3 storage failure, 128 + N stopped by signal N (nothing is published, and the partial copy is removed)."
    )

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The archive (<id>-<version>.zip); its manifest beside it is checked too.") var archive: String
    @Option(help: "The manifest (default: beside the archive, if present).") var manifest: String?
    @Option(help: "Stage the version for this percentage of purchases (1-100; default 100: every purchase).") var rollout: Int?
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        // The copy into the store is removed if the command is stopped part-way.
        let handlers = Interruption.removeUnfinishedFilesOnStop(tool: "iap-server")
        defer { withExtendedLifetime(handlers) {} }
        do throws(CatalogError) {
            let beside = ArchiveVerifier.manifestBeside(archive)
            let manifestPath = manifest ?? (FileManager.default.fileExists(atPath: beside) ? beside : nil)
            var decoded: ArchiveManifest?
            if let manifestPath {
                do { decoded = try ArchiveManifest.load(path: manifestPath) } catch { throw CatalogError(.invalidArchive, error.message) }
            }
            let chosen = decoded
            let outcome = try await storeOptions.withStore(data: data) { store throws(CatalogError) in
                try await store.publish(archiveAt: archive, manifest: chosen, rolloutPercent: rollout)
            }
            switch outcome {
            case .published(let v):
                print("published \(v.productId) \(v.contentVersion) (\(v.size) bytes, sha256 \(v.sha256))\(v.rolloutPercent.map { ", staged for \($0)% of purchases" } ?? "")")
            case .unchanged(let v): print("unchanged: \(v.productId) \(v.contentVersion) is already published with these bytes")
            }
        } catch {
            let code: Int32 =
                switch error.code {
                case .invalidArchive, .notFound: 1
                case .conflict: 2
                case .storage: 3
                }
            throw reporter.failure(error, exitCode: code)
        }
    }
}

/// Exit codes of the catalog commands: 1 invalid input or unknown version, 3 storage.
func catalogFailure(_ error: CatalogError) -> Error {
    reporter.failure(error, exitCode: error.code == .storage ? 3 : 1)
}

struct Rollout: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Stage a published version for a percentage of purchases, widen it, or promote it to all.",
        discussion: """
            Which purchases get a staged version is stable by original transaction id: widening keeps those \
            that have it. Takes effect with the next grant, on every replica sharing the data folder. \
            Exit codes: 0 done, 1 unknown version or invalid percentage, 3 storage failure.
            """)

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The product identifier.") var productId: String
    @Argument(help: "The content version.") var contentVersion: String
    @Option(help: "The share of purchases, 1-100.") var percent: Int?
    @Flag(help: "Give the version to every purchase (the same as --percent 100).") var promote = false
    @Flag(name: .customLong("allow-unserved"), help: "Narrow it even if some purchases are then served no version at all.")
    var allowUnserved = false
    @OptionGroup var storeOptions: StoreOptions

    func validate() throws {
        guard (percent != nil) != promote else { throw ValidationError("give either --percent <1-100> or --promote") }
    }

    func run() async throws {
        do throws(CatalogError) {
            let v = try await storeOptions.withStore(data: data, existing: true) { store throws(CatalogError) in
                try await store.setRollout(productId: productId, contentVersion: contentVersion, percent: promote ? 100 : percent!, allowingUnserved: allowUnserved)
            }
            print("\(v.productId) \(v.contentVersion): \(v.rolloutPercent.map { "staged for \($0)% of purchases" } ?? "every purchase")")
        } catch {
            throw catalogFailure(error)
        }
    }
}

struct Rollback: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Roll a published version back: from the next grant on, each purchase gets the newest version still served to it.",
        discussion: """
            Grants made before stay valid until they expire (--token-ttl). Refused when the version is the last \
            one served to some purchases (they would get no content), unless --allow-unserved. \
            Exit codes: 0 done, 1 unknown version or refused, 3 storage failure.
            """)

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The product identifier.") var productId: String
    @Argument(help: "The content version.") var contentVersion: String
    @Flag(name: .customLong("allow-unserved"), help: "Roll it back even if some purchases are then served no version at all.")
    var allowUnserved = false
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        do throws(CatalogError) {
            let v = try await storeOptions.withStore(data: data, existing: true) { store throws(CatalogError) in
                try await store.rollBack(productId: productId, contentVersion: contentVersion, allowingUnserved: allowUnserved)
            }
            print("\(v.productId) \(v.contentVersion): rolled back")
        } catch {
            throw catalogFailure(error)
        }
    }
}

struct Remove: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Remove a rolled-back version: its archive and manifest are deleted, and its number is never served or published again.",
        discussion: """
            Roll the version back first (iap-server rollback): a version still served to some purchases is refused. \
            Grants made before fail from then on (404 no-content); iap-fetch gets a new grant on its next run. A running \
            server closes the files it kept open within seconds; replicas with archive folders of their own delete their \
            copies when they next read the catalog. Removing a removed version again only retries deleting its files. \
            Exit codes: 0 done, 1 unknown version or refused, 3 storage failure.
            """)

    @Option(help: "The server's data folder.") var data: String
    @Argument(help: "The product identifier.") var productId: String
    @Argument(help: "The content version.") var contentVersion: String
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        do throws(CatalogError) {
            let removal = try await storeOptions.withStore(data: data, existing: true) { store throws(CatalogError) in
                try await store.remove(productId: productId, contentVersion: contentVersion)
            }
            let freed = removal.freedBytes > 0 ? "deleted \(removal.freedBytes) bytes of archive and manifest" : "its files were gone already"
            print("\(productId) \(contentVersion): removed (\(freed)); the version number stays taken")
        } catch {
            throw catalogFailure(error)
        }
    }
}

struct Catalog: AsyncParsableCommand {
    static let configuration = CommandConfiguration(abstract: "List published products and versions.")

    @Option(help: "The server's data folder.") var data: String
    @Flag(help: "Print JSON.") var json = false
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        do {
            // Listing only looks: a data folder without a catalog (a mistyped --data) is not made.
            let catalog: [(productId: String, versions: [PublishedVersion])]
            if !storeOptions.hasCatalog(data: data) {
                catalog = []
            } else {
                catalog = try await storeOptions.withStore(data: data) { store throws(CatalogError) in try await store.catalog() }
            }
            if json {
                let encoder = JSONEncoder()
                encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
                encoder.dateEncodingStrategy = .iso8601
                struct Entry: Encodable { let productId: String; let versions: [PublishedVersion] }
                print(String(decoding: try encoder.encode(catalog.map { Entry(productId: $0.productId, versions: $0.versions) }), as: UTF8.self))
                return
            }
            if catalog.isEmpty { print("nothing published yet: iap-server publish --data \(data) <archive.zip>") }
            for (product, versions) in catalog {
                let served = ContentStore.servedShare(versions)
                print(product + (served < 100 ? "  (\(100 - served)% of purchases are served no version: rollout --promote one)" : ""))
                for v in versions {
                    let state =
                        v.removedAt.map { "  removed \($0.formatted(.iso8601))" } ?? v.rolledBackAt.map { "  rolled back \($0.formatted(.iso8601))" }
                        ?? v.rolloutPercent.map { "  staged: \($0)% of purchases" } ?? ""
                    print("  \(v.contentVersion)  \(v.size) bytes  sha256 \(v.sha256.prefix(16))…  published \(v.publishedAt.formatted(.iso8601))\(state)")
                }
            }
        } catch let error as CatalogError {
            throw reporter.failure(error, exitCode: 3)
        }
    }
}

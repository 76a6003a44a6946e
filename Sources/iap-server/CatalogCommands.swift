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
            "Publishing bytes already published again checks the store's copy and puts it back when it is missing or damaged (iap-server check finds those). Exit codes: 0 published (or identical bytes already published), 1 invalid archive, 2 version conflict, 3 storage failure, 128 + N stopped by signal N (nothing is published, and the partial copy is removed)."
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
            case .repaired(let v):
                print("repaired: \(v.productId) \(v.contentVersion) is published with these bytes, and the store's damaged or missing copy was put back")
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

struct Check: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Check that every published archive and manifest is in the store with its published size and SHA-256.",
        discussion: """
            Reads every published version's files once (about as fast as the disk reads; a check of sizes \
            alone with --quick), with memory flat in their sizes, and drops from the page cache what it \
            read that was not cached before, so it can run beside a serving replica. Each damaged version \
            is printed as it is found, with the fix: publish its archive again (iap-server publish, or \
            PUT /v1/admin/archives), which puts the store's copy back. A running server refuses to serve \
            an archive whose size is not the published one, or that it cannot read, or whose bytes its \
            periodic read (--archive-check-interval) or this check found damaged (503 archive-damaged), \
            and /readyz names it: a find of other bytes at the published size is recorded beside the \
            archive (<sha256>.damaged.json), which every server using the folder reads within \
            --revocation-refresh; publishing again, or a check that finds the file intact, deletes it. \
            Exit codes: 0 every archive intact, 1 some damaged or missing (or no catalog at --data), 3 the catalog cannot be read.
            """)

    @Option(help: "The server's data folder.") var data: String
    @Flag(help: "Look at sizes only (stat), without reading the archives.") var quick = false
    @Flag(help: "Print JSON.") var json = false
    @OptionGroup var storeOptions: StoreOptions

    func run() async throws {
        let started = ContinuousClock.now
        let report: ArchiveCheckReport
        let messages: [String]
        do throws(CatalogError) {
            (report, messages) = try await storeOptions.withStore(data: data, existing: true) { store throws(CatalogError) in
                let report = try await store.checkArchives(readingContents: !quick) { version, damage in
                    if !json { print(damage.message(for: version, in: store)) }
                }
                return (report, report.damaged.map { $0.damage.message(for: $0.version, in: store) })
            }
        } catch {
            throw catalogFailure(error)
        }
        let seconds = (ContinuousClock.now - started) / .seconds(1)
        if json {
            struct Entry: Encodable { let productId, contentVersion, sha256, problem, message: String }
            struct Output: Encodable { let checked: Int; let bytesRead: Int64; let seconds: Double; let contentsRead: Bool; let damaged: [Entry] }
            let entries = zip(report.damaged, messages).map {
                Entry(productId: $0.version.productId, contentVersion: $0.version.contentVersion, sha256: $0.version.sha256, problem: $0.damage.code, message: $1)
            }
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
            print(
                String(
                    decoding: try encoder.encode(
                        Output(checked: report.checked, bytesRead: report.bytesRead, seconds: seconds, contentsRead: !quick, damaged: entries)),
                    as: UTF8.self))
        } else {
            let how = quick ? "sizes of" : "\(report.bytesRead) bytes of"
            let time = String(format: "%.1f", seconds)
            print(
                report.damaged.isEmpty
                    ? "all \(report.checked) published version(s) intact (\(how) archives and manifests checked in \(time) s)"
                    : "\(report.damaged.count) of \(report.checked) published version(s) damaged or missing (\(how) archives and manifests checked in \(time) s)")
        }
        if !report.damaged.isEmpty { throw ExitCode(1) }
    }
}

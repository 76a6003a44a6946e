import ContentArchive
import Foundation
import IAPTestSupport
import SandboxStore
import Testing

/// A content server with products published, a sandbox store it trusts, and a device folder:
/// everything a fetch test needs, on real processes and files. The one fixture of the fetch tests.
struct Shop {
    /// What a product's content is made of.
    enum Source {
        /// `payload.bin` of this many random bytes.
        case random(Int)
        /// The files of a folder.
        case folder(String)
    }

    static let bundleId = "com.example.app"
    let tmp: TemporaryFolder
    let store: SandboxStore
    let server: ServerProcess
    /// The payload of each random product, as installed under `Contents/payload.bin`.
    let payloads: [String: Data]
    /// The manifest of each product's archive, as packed.
    let manifests: [String: ArchiveManifest]
    var content: String { tmp.sub("device") }
    var queue: String { tmp.sub("sandbox/queue") }
    /// The server's flags, for restarting it on the same data.
    var serverArguments: [String] { ["--bundle-id", Self.bundleId, "--trust-root", store.rootCertificatePath, "--environment", "sandbox"] }

    /// Publishes version 1.0 of each product, packed at `level`, and starts the server (trusting
    /// the store's receipt chain too with `receipts`, for StoreKit 1 purchases).
    init(products: [String: Source], level: Int = 0, serverArguments extra: [String] = [], receipts: Bool = false) throws {
        tmp = try TemporaryFolder()
        store = try SandboxStore.initialize(folder: tmp.sub("sandbox"), bundleId: Self.bundleId)
        var extra = extra
        if receipts {
            _ = try store.receiptAuthority()
            extra += ["--trust-root", store.receiptRootCertificatePath]
        }
        var payloads: [String: Data] = [:]
        var manifests: [String: ArchiveManifest] = [:]
        for (product, source) in products {
            let folder: String
            switch source {
            case .folder(let path):
                folder = path
            case .random(let size):
                folder = tmp.sub("src/\(product)")
                try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
                let payload = try #require(FileHandle(forReadingAtPath: "/dev/urandom")).readData(ofLength: size)
                try payload.write(to: URL(fileURLWithPath: folder + "/payload.bin"))
                payloads[product] = payload
            }
            manifests[product] = try Self.publish(
                folder: folder, product: product, version: "1.0", level: level, data: tmp.sub("data"), scratch: tmp.sub("archives"))
        }
        self.payloads = payloads
        self.manifests = manifests
        server = try ServerProcess(
            data: tmp.sub("data"),
            arguments: [
                "--bundle-id", Self.bundleId, "--trust-root", store.rootCertificatePath, "--environment", "sandbox",
            ] + extra, folder: tmp)
    }

    /// A shop selling `products`, each `size` random bytes, every one bought once in that order;
    /// with the purchases' transaction ids.
    static func everyOneBought(_ products: [String], size: Int) throws -> (shop: Shop, transactions: [String]) {
        let shop = try Shop(products: Dictionary(uniqueKeysWithValues: products.map { ($0, Source.random(size)) }))
        let transactions = try products.map { try shop.store.purchase(productId: $0).transaction.transactionId! }
        return (shop, transactions)
    }

    /// Packs `folder` as `product` `version` and publishes it with `iap-server publish`.
    @discardableResult
    static func publish(folder: String, product: String, version: String, level: Int = 0, data: String, scratch: String) throws -> ArchiveManifest {
        let packed = try ArchivePacker.pack(
            folder: folder,
            options: .init(
                productId: try ProductIdentifier(product), contentVersion: try ContentVersion(version), outputDirectory: scratch, level: level))
        let published = try run(productsDirectory() + "/iap-server", ["publish", "--data", data, packed.archivePath])
        #expect(published.status == 0, "\(published.stderr)")
        return packed.manifest
    }

    /// Publishes another version of a product on this shop's server.
    func publish(folder: String, product: String, version: String) throws {
        try Self.publish(folder: folder, product: product, version: version, level: 1, data: tmp.sub("data"), scratch: tmp.sub("v\(version)"))
    }

    func installed(_ product: String, version: String = "1.0") -> Data? {
        FileManager.default.contents(atPath: content + "/\(product)/\(version)/Contents/payload.bin")
    }

    /// `iap-fetch run` on this shop's queue, to completion, with `--json`.
    func fetch(_ extra: [String] = [], prefix: [String] = []) throws -> ProcessResult {
        let args = ["run", "--server", server.base, "--queue", queue, "--content-dir", content, "--json"] + extra
        if prefix.isEmpty { return try run(productsDirectory() + "/iap-fetch", args) }
        return try run("sh", ["-c", prefix.joined(separator: " ") + "; exec \"$0\" \"$@\"", productsDirectory() + "/iap-fetch"] + args)
    }

    /// Starts `iap-fetch run` on this shop's queue in the background.
    func startClient(_ extra: [String], environment: [String: String]? = nil) throws -> (Process, Pipe) {
        let errors = Pipe()
        let client = try launch(
            productsDirectory() + "/iap-fetch",
            ["run", "--server", server.base, "--queue", queue, "--content-dir", content] + extra,
            environment: environment, stderr: errors)
        return (client, errors)
    }
}

import ContentArchive
import Foundation
import IAPTestSupport
import SandboxStore
import Testing

/// A content server with products published, a sandbox store it trusts, and a device folder:
/// everything a fetch test needs, on real processes and files.
struct Shop {
    let tmp: TemporaryFolder
    let store: SandboxStore
    let server: ServerProcess
    /// The payload of each product, as installed under `Contents/payload.bin`.
    let payloads: [String: Data]
    var content: String { tmp.sub("device") }
    var queue: String { tmp.sub("sandbox/queue") }

    /// Publishes one product per entry, each holding `payload.bin` of that many random bytes.
    init(randomProducts: [String: Int]) throws {
        tmp = try TemporaryFolder()
        store = try SandboxStore.initialize(folder: tmp.sub("sandbox"), bundleId: "com.example.app")
        var payloads: [String: Data] = [:]
        let random = try #require(FileHandle(forReadingAtPath: "/dev/urandom"))
        for (product, size) in randomProducts {
            let folder = tmp.sub("src/\(product)")
            try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
            let payload = random.readData(ofLength: size)
            try payload.write(to: URL(fileURLWithPath: folder + "/payload.bin"))
            payloads[product] = payload
            let packed = try ArchivePacker.pack(folder: folder, options: .init(
                productId: try ProductIdentifier(product), contentVersion: try ContentVersion("1.0"), outputDirectory: tmp.sub("archives"), level: 0))
            let published = try run(productsDirectory() + "/iap-server", ["publish", "--data", tmp.sub("data"), packed.archivePath])
            #expect(published.status == 0, "\(published.stderr)")
        }
        self.payloads = payloads
        server = try ServerProcess(data: tmp.sub("data"), arguments: [
            "--bundle-id", "com.example.app", "--trust-root", store.rootCertificatePath, "--environment", "sandbox"], folder: tmp)
    }

    func installed(_ product: String) -> Data? {
        FileManager.default.contents(atPath: content + "/\(product)/1.0/Contents/payload.bin")
    }

    /// Starts `iap-fetch run` on this shop's queue in the background.
    func startClient(_ extra: [String]) throws -> (Process, Pipe) {
        let client = Process()
        client.executableURL = URL(fileURLWithPath: productsDirectory() + "/iap-fetch")
        client.arguments = ["run", "--server", server.base, "--queue", queue, "--content-dir", content] + extra
        let errors = Pipe()
        client.standardOutput = FileHandle.nullDevice
        client.standardError = errors
        try client.run()
        return (client, errors)
    }
}

import AppStoreServerAPI
import ArgumentParser
import AsyncHTTPClient
import CertificateTrust
import CommandLineReporting
import DurableFiles
import Foundation
import IAPProtocol
import Logging
import NIOCore
import NIOSSL
import PurchaseVerification
import SandboxStore
import SandboxStoreServer
import ServerStartup
import TransactionQueue

#if canImport(FoundationNetworking)
    import FoundationNetworking
#endif

@main
struct IAPSandbox: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap-sandbox",
        abstract: "A local App Store for tests and demos: signs StoreKit 2 transactions and notifications with its own test chain.",
        discussion: "Trust its root on a test server with: iap-server serve --trust-root <dir>/root.cer --environment sandbox",
        version: IAPContentVersion.current,
        subcommands: [Init.self, Purchase.self, Transactions.self, Finish.self, Refund.self, ReceiptCommand.self, APIKeyCommand.self, Serve.self])
}

/// Errors go to stderr and exit 1 (64 for usage, from ArgumentParser).
let reporter = Reporter(tool: "iap-sandbox")

func iso(_ date: Date?) -> String { date.map { $0.formatted(.iso8601) } ?? "-" }

struct Init: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Create a store: a P-256 root → intermediate → leaf chain with Apple's marker OIDs; exports <dir>/root.cer.")

    @Option(help: "The store's folder.") var dir: String
    @Option(name: .customLong("bundle-id"), help: "The app's bundle identifier.") var bundleId: String

    func validate() throws {
        if let refusal = BundleIdentifier.refusal(bundleId, from: "--bundle-id") { throw ValidationError(refusal) }
    }

    func run() throws {
        do {
            let store = try SandboxStore.initialize(folder: dir, bundleId: bundleId)
            print(
                """
                created a sandbox store for \(store.bundleId) in \(dir)
                  trust root  \(store.rootCertificatePath)   (pass it to iap-server with --trust-root)
                  keys        \(dir)/*.key (mode 0600)
                  queue       \(dir)/queue
                """)
        } catch { throw reporter.failure(error) }
    }
}

struct Purchase: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Buy a product: prints the signed transaction and queues it, unfinished, in <dir>/queue.")

    enum Kind: String, ExpressibleByArgument, CaseIterable {
        case nonConsumable = "non-consumable", consumable, autoRenewable = "auto-renewable"
        var type: ProductType {
            switch self {
            case .nonConsumable: .nonConsumable
            case .consumable: .consumable
            case .autoRenewable: .autoRenewable
            }
        }
    }

    @Option(help: "The store's folder.") var dir: String
    @Option(name: .customLong("product-id"), help: "The product to buy.") var productId: String
    @Option(help: "non-consumable, consumable or auto-renewable.") var type: Kind = .nonConsumable
    enum Environment: String, ExpressibleByArgument, CaseIterable {
        case sandbox = "Sandbox", production = "Production"
        init?(argument: String) {
            guard let match = Self.allCases.first(where: { $0.rawValue.lowercased() == argument.lowercased() }) else { return nil }
            self = match
        }
        var value: AppStoreEnvironment { self == .sandbox ? .sandbox : .production }
    }

    @Option(help: "Sandbox or Production.") var environment: Environment = .sandbox
    @Option(help: "Expiry (ISO 8601, e.g. 2027-01-01T00:00:00Z), for subscriptions.") var expires: String?
    @Flag(help: "Print one JSON object instead of the bare signed transaction.") var json = false
    @Option(name: .customLong("storekit"), help: "2 (signed transactions) or 1: a StoreKit 1 purchase, proven by the device's app receipt (<dir>/device-receipt, rewritten).")
    var storeKit = 2

    func validate() throws {
        guard storeKit == 1 || storeKit == 2 else { throw ValidationError("--storekit must be 1 or 2") }
        if let expires, (try? Date(expires, strategy: .iso8601)) == nil {
            throw ValidationError("--expires \(expires) is not an ISO 8601 date such as 2027-01-01T00:00:00Z")
        }
        if expires != nil, type != .autoRenewable {
            throw ValidationError("--expires applies to --type auto-renewable only")
        }
    }

    func run() throws {
        let expiry = expires.flatMap { try? Date($0, strategy: .iso8601) }
        do {
            let store = try SandboxStore(folder: dir)
            let purchase = try store.purchase(productId: productId, type: type.type, environment: environment.value, expires: expiry, storeKit1: storeKit == 1)
            if json {
                var object: [String: Any] = [
                    "transactionId": purchase.transaction.transactionId ?? "", "productId": productId,
                    "signedTransaction": purchase.signedTransaction,
                ]
                if storeKit == 1 { object["receiptPath"] = store.deviceReceiptPath }
                let data = try JSONSerialization.data(withJSONObject: object, options: [.sortedKeys, .withoutEscapingSlashes])
                print(String(decoding: data, as: UTF8.self))
            } else if storeKit == 1 {
                print("\(purchase.transaction.transactionId ?? "")  StoreKit 1; the app receipt is \(store.deviceReceiptPath)")
            } else {
                print(purchase.signedTransaction)
            }
        } catch let error as SandboxError { throw reporter.failure(error) }
    }
}

struct Transactions: ParsableCommand {
    static let configuration = CommandConfiguration(abstract: "List the store's transactions: finished or not, and when; refunded or not.")

    @Option(help: "The store's folder.") var dir: String
    @Flag(help: "Print JSON.") var json = false

    func run() throws {
        do {
            let records = try SandboxStore(folder: dir).records()
            if json {
                let encoder = JSONEncoder()
                encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
                encoder.dateEncodingStrategy = .iso8601
                print(String(decoding: try encoder.encode(records), as: UTF8.self))
                return
            }
            if records.isEmpty { print("no transactions yet: buy with iap-sandbox purchase --dir \(dir) --product-id <id>") }
            for r in records {
                let state = r.finishedAt.map { "finished \(iso($0))" } ?? "UNFINISHED"
                let refund = r.refundedAt.map { "  refunded \(iso($0))" } ?? ""
                print("\(r.transactionId)  \(r.productId)  \(r.environment ?? "-")  bought \(iso(r.purchaseDate))  \(state)\(refund)")
            }
        } catch let error as SandboxError { throw reporter.failure(error) }
    }
}

struct Finish: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Finish a transaction as the app does once it has delivered what was bought (100 coins, say).",
        discussion: """
            iap-fetch finishes the transactions whose content it installed; a purchase without hosted content is \
            left unfinished for the app, which this plays. Finishing is one-way: a finished transaction stays finished.
            """)

    @Option(help: "The store's folder.") var dir: String
    @Argument(help: "The transaction to finish (see iap-sandbox transactions).") var transactionId: String

    func run() throws {
        let queue: FileTransactionQueue
        do { queue = try SandboxStore(folder: dir).queue } catch { throw reporter.failure(error) }
        do {
            guard let queued = try queue.transaction(transactionId) else {
                throw reporter.failure("not-found", "transaction \(transactionId) was not bought in this sandbox store: list them with iap-sandbox transactions --dir \(dir)")
            }
            if let at = queued.finishedAt {
                print("transaction \(transactionId) (\(queued.productId)) was already finished at \(iso(at))")
                return
            }
            let finished = try queue.finishNow(transactionId)
            print("finished transaction \(transactionId) (\(finished.productId)) at \(iso(finished.finishedAt))")
        } catch let error as TransactionQueueError { throw reporter.failure(error) }
    }
}

struct Refund: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Refund a purchase: signs a REFUND notification V2 whose transaction carries revocationDate, prints it, and POSTs it to --notify.")

    @Option(help: "The store's folder.") var dir: String
    @Argument(help: "The transaction to refund.") var transactionId: String
    @Option(help: "The server's notification URL, e.g. http://127.0.0.1:8080/v1/notifications.") var notify: String?
    @Option(
        name: .customLong("ca-file"),
        help: "A certificate authority (PEM) trusted beside the system's for an https:// --notify URL: a staging server behind a private authority; repeatable.")
    var caFiles: [String] = []

    func validate() throws {
        if let notify, URL(string: notify).map({ $0.scheme == "http" || $0.scheme == "https" }) != true {
            throw ValidationError("--notify \(notify) is not an http(s) URL")
        }
    }

    func run() async throws {
        // Read before the refund is made: a wrong --ca-file changes nothing.
        let tls: TLSConfiguration
        do { tls = try AuthorityFile.clientConfiguration(adding: caFiles) } catch {
            throw reporter.failure("ca-file", error.explanation(givenAs: "--ca-file"))
        }
        let refund: SandboxStore.Refund
        do { refund = try SandboxStore(folder: dir).refund(transactionId: transactionId) } catch { throw reporter.failure(error) }
        let body = try WireJSON.encoder().encode(NotificationRequest(signedPayload: refund.signedPayload))
        print(String(decoding: body, as: UTF8.self))
        guard let notify else { return }
        let store: SandboxStore
        do { store = try SandboxStore(folder: dir) } catch { throw reporter.failure(error) }
        let uuid = refund.notification.notificationUUID ?? ""
        let later = "the refund is recorded, and iap-server reconcile can fetch it from the notification history"
        let answer: Result<(status: Int, body: Data), any Error>
        let client = HTTPClient(eventLoopGroupProvider: .singleton, configuration: .init(tlsConfiguration: tls))
        do {
            var request = HTTPClientRequest(url: notify)
            request.method = .POST
            request.headers.add(name: "Content-Type", value: "application/json")
            request.body = .bytes(ByteBuffer(bytes: body))
            let response = try await client.execute(request, timeout: .seconds(30))
            let data = try await response.body.collect(upTo: 64 << 10)
            answer = .success((Int(response.status.code), Data(data.readableBytesView)))
        } catch {
            answer = .failure(error)
        }
        try? await client.shutdown()
        switch answer {
        case .success(let (status, _)) where (200...206).contains(status):
            // Apple counts 200-206 as delivered.
            try? store.recordSendAttempt(notificationUUID: uuid, result: SendAttempt.success)
            Console.err("notified \(notify): \(status)\n")
        case .success(let (status, data)):
            try? store.recordSendAttempt(notificationUUID: uuid, result: "UNSUCCESSFUL_HTTP_RESPONSE_CODE")
            throw reporter.failure(
                "notify-failed", "the server at \(notify) answered \(status) to the REFUND notification: \(String(decoding: data.prefix(500), as: UTF8.self)); \(later)")
        case .failure(let error):
            // Apple's own attempt results: a refused certificate is a TLS_ISSUE.
            if let refusal = CertificateRefusal(error) {
                try? store.recordSendAttempt(notificationUUID: uuid, result: "TLS_ISSUE")
                let fix =
                    refusal == .untrusted
                    ? "is not trusted: when a private certificate authority signs it, pass that authority's certificate (PEM) with --ca-file"
                    : "is for another name: use a name the certificate holds in --notify"
                throw reporter.failure("notify-failed", "the TLS certificate of \(notify) \(fix); \(later)")
            }
            try? store.recordSendAttempt(notificationUUID: uuid, result: "NO_RESPONSE")
            throw reporter.failure("notify-failed", "could not POST the notification to \(notify): \(error); \(later) once the server runs")
        }
    }
}

struct ReceiptCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "receipt",
        abstract: "Issue the app receipt a StoreKit 1 device holds now: every purchase, refunded ones with their cancellation date.",
        discussion: """
            PKCS#7 SignedData (BER, indefinite lengths) signed by the store's RSA receipt chain, as Apple's are. \
            Trust its root on a test server with --trust-root <dir>/receipt-root.cer. Prints base64 (what apps send) unless --output.
            """)

    @Option(help: "The store's folder.") var dir: String
    @Option(help: "Write the receipt's bytes (DER/BER) to this file instead of printing base64.") var output: String?
    @Option(help: "Sandbox or Production: which purchases, and the receipt type.") var environment: Purchase.Environment = .sandbox
    @Option(name: .customLong("app-version"), help: "The app version the receipt names.") var appVersion = "1.0"
    @Flag(help: "Sign with SHA-1, as receipts before 2016 were.") var sha1 = false

    func run() throws {
        do {
            let store = try SandboxStore(folder: dir)
            let bytes = try store.receipt(environment: environment.value, appVersion: appVersion, sha1: sha1)
            if let output {
                do { try AtomicFile.write(Data(bytes), to: output, permissions: 0o644) } catch { throw SandboxError(.io, error.message) }
                Console.err("wrote \(bytes.count) bytes to \(output); trust root \(store.receiptRootCertificatePath)\n")
            } else {
                print(Data(bytes).base64EncodedString())
            }
        } catch let error as SandboxError { throw reporter.failure(error) }
    }
}

struct APIKeyCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "api-key",
        abstract: "Make an App Store Server API key for this store, as App Store Connect does: writes the .p8 and prints its key id and issuer id.",
        discussion: "Give the three to iap-server reconcile (--key-file, --key-id, --issuer-id), or to Apple's AppStoreServerAPIClient.")

    @Option(help: "The store's folder.") var dir: String
    @Option(help: "Where to write the private key (PKCS#8 PEM, mode 0600); default <dir>/SubscriptionKey_<id>.p8.") var output: String?
    @Flag(help: "Print one JSON object.") var json = false

    func run() throws {
        do {
            let store = try SandboxStore(folder: dir)
            let key = try store.createAPIKey()
            let path = output ?? "\(dir)/SubscriptionKey_\(key.keyId).p8"
            do { try AtomicFile.write(Data(key.privateKeyPEM.utf8), to: path, permissions: 0o600) } catch {
                throw SandboxError(.io, error.message)
            }
            if json {
                let object = ["keyId": key.keyId, "issuerId": key.issuerId, "keyFile": path, "bundleId": store.bundleId]
                let data = try JSONSerialization.data(withJSONObject: object, options: [.sortedKeys, .withoutEscapingSlashes])
                print(String(decoding: data, as: UTF8.self))
            } else {
                print(
                    """
                    key id     \(key.keyId)
                    issuer id  \(key.issuerId)
                    key file   \(path)
                    """)
            }
        } catch let error as SandboxError { throw reporter.failure(error) } catch { throw reporter.failure("io", "\(error)") }
    }
}

struct Serve: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Serve the store's App Store Server API: Get Transaction Info, Get Transaction History (v2), Get Notification History.",
        discussion: """
            Requests need a bearer token signed with a key from iap-sandbox api-key, as Apple's API does. \
            Point a client at http://<host>:<port> instead of https://api.storekit-sandbox.apple.com.
            """)

    @Option(help: "The store's folder.") var dir: String
    @Option(help: "The address to listen on.") var host = "127.0.0.1"
    @Option(help: "The port to listen on; 0 picks a free one.") var port = 9090
    @Option(help: "Which environment's transactions and notifications to serve (Apple runs one host for each).")
    var environment: Purchase.Environment = .sandbox
    @Option(name: .customLong("port-file"), help: "Write the bound port to this file once listening (for scripts).") var portFile: String?

    func run() async throws {
        let store: SandboxStore
        do { store = try SandboxStore(folder: dir) } catch { throw reporter.failure(error) }
        var logger = Logger(label: "iap-sandbox")
        logger.logLevel = .notice
        let host = URLHost.bare(self.host), portFile = self.portFile
        do {
            try await SandboxAPIServer.run(api: SandboxStoreAPI(store: store, environment: environment.value), host: host, port: port, logger: logger) { port in
                Console.out("iap-sandbox App Store Server API on http://\(URLHost.inURL(host)):\(port)\n")
                if let portFile { try? AtomicFile.write(Data(String(port).utf8), to: portFile, permissions: 0o644) }
            }
        } catch let error as ServerStartError {
            throw reporter.failure(error)
        }
    }
}

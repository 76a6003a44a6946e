// swift-tools-version:6.0
import PackageDescription

let package = Package(
    name: "iap-content",
    platforms: [.macOS(.v15)],
    products: [
        .library(name: "IAPProtocol", targets: ["IAPProtocol"]),
        .library(name: "DurableFiles", targets: ["DurableFiles"]),
        .library(name: "ContentArchive", targets: ["ContentArchive"]),
        .library(name: "PurchaseVerification", targets: ["PurchaseVerification"]),
        .library(name: "AppStoreServerAPI", targets: ["AppStoreServerAPI"]),
        .library(name: "AppStoreServerClient", targets: ["AppStoreServerClient"]),
        .library(name: "ReceiptVerification", targets: ["ReceiptVerification"]),
        .library(name: "SandboxStore", targets: ["SandboxStore"]),
        .library(name: "SandboxStoreServer", targets: ["SandboxStoreServer"]),
        .library(name: "TransactionQueue", targets: ["TransactionQueue"]),
        .library(name: "ContentDelivery", targets: ["ContentDelivery"]),
        .library(name: "DownloadGrants", targets: ["DownloadGrants"]),
        .library(name: "ContentCatalog", targets: ["ContentCatalog"]),
        .library(name: "CatalogPostgres", targets: ["CatalogPostgres"]),
        .library(name: "ServerStartup", targets: ["ServerStartup"]),
        .library(name: "ContentServer", targets: ["ContentServer"]),
        .library(name: "ContentFetch", targets: ["ContentFetch"]),
        .library(name: "CertificateTrust", targets: ["CertificateTrust"]),
        .executable(name: "iap-pack", targets: ["iap-pack"]),
        .executable(name: "iap-sandbox", targets: ["iap-sandbox"]),
        .executable(name: "iap-server", targets: ["iap-server"]),
        .executable(name: "iap-fetch", targets: ["iap-fetch"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.5.0"),
        .package(url: "https://github.com/apple/swift-crypto.git", "3.12.3"..<"5.0.0"),
        .package(url: "https://github.com/apple/swift-system.git", from: "1.4.0"),
        .package(url: "https://github.com/apple/swift-certificates.git", from: "1.10.0"),
        .package(url: "https://github.com/apple/swift-asn1.git", from: "1.3.0"),
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.80.0"),
        .package(url: "https://github.com/apple/swift-nio-extras.git", from: "1.20.0"),
        .package(url: "https://github.com/apple/swift-http-types.git", from: "1.0.0"),
        .package(url: "https://github.com/apple/swift-log.git", from: "1.6.0"),
        .package(url: "https://github.com/apple/swift-metrics.git", from: "2.5.0"),
        .package(url: "https://github.com/swift-server/swift-prometheus.git", from: "2.1.0"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle.git", from: "2.6.0"),
        .package(url: "https://github.com/hummingbird-project/hummingbird.git", from: "2.20.0"),
        .package(url: "https://github.com/groue/GRDB.swift.git", from: "7.0.0"),
        .package(url: "https://github.com/swift-server/async-http-client.git", from: "1.20.0"),
        .package(url: "https://github.com/vapor/multipart-kit.git", from: "4.7.0"),
        .package(url: "https://github.com/vapor/postgres-nio.git", from: "1.33.0"),
        .package(url: "https://github.com/apple/swift-nio-ssl.git", from: "2.37.0"),
    ],
    targets: [
        // libdeflate (Debian: libdeflate-dev) compresses about twice as fast as zlib at the same ratio.
        .systemLibrary(name: "CLibDeflate", pkgConfig: "libdeflate", providers: [.apt(["libdeflate-dev"])]),
        // zlib (Debian: zlib1g-dev) for streaming inflate, which libdeflate (whole-buffer only) cannot do.
        .systemLibrary(name: "CZlib", pkgConfig: "zlib", providers: [.apt(["zlib1g-dev"])]),
        .systemLibrary(name: "CLinuxWriteback"),
        .systemLibrary(name: "CLinuxSendfile"),
        // OpenSSL's libcrypto (Debian: libssl-dev) for PKCS#7, which app receipts are and no Swift package here reads.
        .systemLibrary(name: "COpenSSL", pkgConfig: "libcrypto", providers: [.apt(["libssl-dev"])]),
        // The HTTP contract (routes, bodies, the error envelope) and the one error shape.
        .target(name: "IAPProtocol"),
        // Atomic writes, folder syncs, advisory locks, hex: what every durable file here needs.
        .target(name: "DurableFiles", dependencies: ["CLinuxWriteback", "IAPProtocol"]),
        // The four executables' one way to report an error and exit (or to stop on a signal).
        .target(
            name: "CommandLineReporting",
            dependencies: ["DurableFiles", "IAPProtocol", .product(name: "ArgumentParser", package: "swift-argument-parser")]
        ),
        .target(
            name: "ContentArchive",
            dependencies: [
                "CLibDeflate", "CZlib", "CLinuxWriteback", "DurableFiles", "IAPProtocol",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "SystemPackage", package: "swift-system"),
            ]
        ),
        .executableTarget(
            name: "iap-pack",
            dependencies: [
                "CommandLineReporting", "ContentArchive", "IAPProtocol",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]
        ),
        .target(name: "Base64URL"),
        .target(
            name: "PurchaseVerification",
            dependencies: [
                "Base64URL", "IAPProtocol",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
            ],
            resources: [.copy("Resources/AppleRootCA-G3.cer"), .copy("Resources/AppleIncRootCertificate.cer")]
        ),
        // StoreKit 1 app receipts: PKCS#7 (libcrypto) and their ASN.1 payload (swift-asn1).
        .target(
            name: "ReceiptVerification",
            dependencies: [
                "COpenSSL", "IAPProtocol", "PurchaseVerification",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
            ]
        ),
        // The App Store Server API's contract: bodies, Apple's error codes, bearer tokens.
        .target(
            name: "AppStoreServerAPI",
            dependencies: ["Base64URL", "IAPProtocol", .product(name: "Crypto", package: "swift-crypto")]
        ),
        // A client of that API (what `iap-server reconcile` asks).
        .target(
            name: "AppStoreServerClient",
            dependencies: [
                "AppStoreServerAPI", "CertificateTrust", "IAPProtocol",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ]
        ),
        .target(
            name: "TransactionQueue",
            dependencies: ["Base64URL", "DurableFiles", "IAPProtocol", .product(name: "SystemPackage", package: "swift-system")]
        ),
        .target(
            name: "SandboxStore",
            dependencies: [
                "AppStoreServerAPI", "Base64URL", "COpenSSL", "DurableFiles", "IAPProtocol", "PurchaseVerification", "ReceiptVerification",
                "TransactionQueue",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "_CryptoExtras", package: "swift-crypto"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
            ]
        ),
        // The sandbox's App Store Server API over HTTP (Hummingbird), at Apple's paths.
        // What a server process does to start and says when it cannot: its open-file limit, and
        // why it cannot listen, in words an operator acts on (both servers).
        .target(
            name: "ServerStartup",
            dependencies: ["IAPProtocol", .product(name: "NIOCore", package: "swift-nio")]
        ),
        .target(
            name: "SandboxStoreServer",
            dependencies: [
                "AppStoreServerAPI", "Base64URL", "PurchaseVerification", "ReceiptVerification", "SandboxStore", "ServerStartup",
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HTTPTypes", package: "swift-http-types"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
            ]
        ),
        .executableTarget(
            name: "iap-sandbox",
            dependencies: [
                "AppStoreServerAPI", "CertificateTrust", "CommandLineReporting", "DurableFiles", "IAPProtocol", "SandboxStore", "SandboxStoreServer",
                "TransactionQueue", "PurchaseVerification", "ServerStartup",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
            ]
        ),
        // Range requests and sendfile delivery of archive bytes: one small NIO module.
        // Private certificate authorities and refused certificates, for every TLS client here.
        .target(name: "CertificateTrust", dependencies: [.product(name: "NIOSSL", package: "swift-nio-ssl")]),
        .target(
            name: "ContentDelivery",
            dependencies: [
                "CLinuxSendfile", "IAPProtocol",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ]
        ),
        .target(
            name: "DownloadGrants",
            dependencies: ["Base64URL", "DurableFiles", "IAPProtocol", .product(name: "Crypto", package: "swift-crypto")]
        ),
        .target(
            name: "ContentCatalog",
            dependencies: [
                "ContentArchive", "DurableFiles", "IAPProtocol",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "GRDB", package: "GRDB.swift"),
            ]
        ),
        // The catalog's state in PostgreSQL, for several replicas (the SQLite default stays in ContentCatalog).
        .target(
            name: "CatalogPostgres",
            dependencies: [
                "CertificateTrust", "ContentCatalog", "IAPProtocol",
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "Logging", package: "swift-log"),
            ]
        ),
        .target(
            name: "ContentServer",
            dependencies: [
                "AppStoreServerAPI", "AppStoreServerClient", "Base64URL", "CatalogPostgres", "CertificateTrust", "ContentArchive", "ContentCatalog", "ContentDelivery",
                "DownloadGrants", "DurableFiles", "IAPProtocol", "PurchaseVerification", "ReceiptVerification", "ServerStartup",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdCore", package: "hummingbird"),
                .product(name: "MultipartKit", package: "multipart-kit"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOExtras", package: "swift-nio-extras"),
                .product(name: "NIOHTTPTypes", package: "swift-nio-extras"),
                .product(name: "NIOHTTPTypesHTTP1", package: "swift-nio-extras"),
                .product(name: "HTTPTypes", package: "swift-http-types"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
            ]
        ),
        .target(
            name: "ContentFetch",
            dependencies: [
                "CLinuxWriteback", "CertificateTrust", "ContentArchive", "DurableFiles", "IAPProtocol", "TransactionQueue",
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "SystemPackage", package: "swift-system"),
            ]
        ),
        .executableTarget(
            name: "iap-fetch",
            dependencies: [
                "CommandLineReporting", "Base64URL", "ContentFetch", "DurableFiles", "IAPProtocol", "TransactionQueue",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]
        ),
        .executableTarget(
            name: "iap-server",
            dependencies: [
                "AppStoreServerAPI", "AppStoreServerClient", "CommandLineReporting", "ContentCatalog", "ContentServer", "DownloadGrants", "DurableFiles", "IAPProtocol",
                "PurchaseVerification", "ReceiptVerification", "ServerStartup",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
            ]
        ),
        .target(name: "BenchSupport", path: "tools/bench-support"),
        .executableTarget(
            name: "verify-bench",
            dependencies: ["BenchSupport", "PurchaseVerification", "SandboxStore"],
            path: "tools/verify-bench"
        ),
        .executableTarget(
            name: "receipt-bench",
            dependencies: ["BenchSupport", "PurchaseVerification", "ReceiptVerification", "SandboxStore"],
            path: "tools/receipt-bench"
        ),
        .testTarget(name: "IAPProtocolTests", dependencies: ["IAPProtocol"]),
        .testTarget(name: "DurableFilesTests", dependencies: ["DurableFiles"]),
        .testTarget(name: "DownloadGrantsTests", dependencies: ["DownloadGrants", "IAPTestSupport"]),
        .testTarget(
            name: "ContentCatalogTests",
            dependencies: ["CatalogPostgres", "ContentCatalog", "ContentArchive", "IAPTestSupport", .product(name: "Logging", package: "swift-log")]),
        .testTarget(name: "TransactionQueueTests", dependencies: ["TransactionQueue", "IAPTestSupport"]),
        .testTarget(
            name: "SandboxStoreTests",
            dependencies: [
                "SandboxStore", "SandboxStoreServer", "AppStoreServerAPI", "AppStoreServerClient", "Base64URL", "TransactionQueue", "IAPTestSupport",
                "PurchaseVerification", .product(name: "X509", package: "swift-certificates"),
            ]
        ),
        .testTarget(
            name: "ContentDeliveryTests",
            dependencies: [
                "ContentDelivery", "IAPProtocol", "IAPTestSupport",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOEmbedded", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ]
        ),
        .testTarget(
            name: "ContentArchiveTests",
            dependencies: ["ContentArchive", "IAPTestSupport", .product(name: "SystemPackage", package: "swift-system")]
        ),
        // Helpers for tests that run the real executables (servers on ephemeral ports, curl).
        .target(name: "IAPTestSupport", dependencies: ["CatalogPostgres", "ContentCatalog"], path: "Tests/Support"),
        .testTarget(
            name: "ContentServerTests",
            dependencies: [
                "ContentServer", "ContentDelivery", "DownloadGrants", "ContentCatalog", "ContentArchive", "SandboxStore", "IAPTestSupport",
                "AppStoreServerAPI", "AppStoreServerClient", "ReceiptVerification", .product(name: "NIOCore", package: "swift-nio"),
            ]
        ),
        .testTarget(
            name: "ContentFetchTests",
            dependencies: [
                "ContentFetch", "SandboxStore", "TransactionQueue", "ContentArchive", "DownloadGrants", "DurableFiles", "IAPTestSupport",
                .product(name: "AsyncHTTPClient", package: "async-http-client"), .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ]
        ),
        .testTarget(
            name: "ReceiptVerificationTests",
            dependencies: [
                "ReceiptVerification", "SandboxStore", "PurchaseVerification", "IAPTestSupport",
                .product(name: "X509", package: "swift-certificates"), .product(name: "SwiftASN1", package: "swift-asn1"),
            ]
        ),
        .testTarget(
            name: "PurchaseVerificationTests",
            dependencies: ["PurchaseVerification", "SandboxStore", "TransactionQueue", "IAPTestSupport"]
        ),
    ]
)

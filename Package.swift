// swift-tools-version:6.0
import PackageDescription

let package = Package(
    name: "iap-content",
    platforms: [.macOS(.v15)],
    products: [
        .library(name: "ContentArchive", targets: ["ContentArchive"]),
        .library(name: "PurchaseVerification", targets: ["PurchaseVerification"]),
        .library(name: "SandboxStore", targets: ["SandboxStore"]),
        .library(name: "TransactionQueue", targets: ["TransactionQueue"]),
        .executable(name: "iap-pack", targets: ["iap-pack"]),
        .executable(name: "iap-sandbox", targets: ["iap-sandbox"]),
        .executable(name: "iap-server", targets: ["iap-server"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.5.0"),
        .package(url: "https://github.com/apple/swift-crypto.git", "3.12.3"..<"5.0.0"),
        .package(url: "https://github.com/apple/swift-system.git", from: "1.4.0"),
        .package(url: "https://github.com/apple/swift-certificates.git", from: "1.10.0"),
        .package(url: "https://github.com/apple/swift-asn1.git", from: "1.3.0"),
    ],
    targets: [
        // libdeflate (Debian: libdeflate-dev) compresses about twice as fast as zlib at the same ratio.
        .systemLibrary(name: "CLibDeflate", pkgConfig: "libdeflate", providers: [.apt(["libdeflate-dev"])]),
        // zlib (Debian: zlib1g-dev) for streaming inflate, which libdeflate (whole-buffer only) cannot do.
        .systemLibrary(name: "CZlib", pkgConfig: "zlib", providers: [.apt(["zlib1g-dev"])]),
        .target(
            name: "ContentArchive",
            dependencies: [
                "CLibDeflate", "CZlib",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "SystemPackage", package: "swift-system"),
            ]
        ),
        .executableTarget(
            name: "iap-pack",
            dependencies: [
                "ContentArchive",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]
        ),
        .target(
            name: "PurchaseVerification",
            dependencies: [
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
            ],
            resources: [.copy("Resources/AppleRootCA-G3.cer")]
        ),
        .target(
            name: "TransactionQueue",
            dependencies: [.product(name: "SystemPackage", package: "swift-system")]
        ),
        .target(
            name: "SandboxStore",
            dependencies: [
                "PurchaseVerification", "TransactionQueue",
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "SwiftASN1", package: "swift-asn1"),
            ]
        ),
        .executableTarget(
            name: "iap-sandbox",
            dependencies: [
                "SandboxStore", "TransactionQueue", "PurchaseVerification",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]
        ),
        .executableTarget(
            name: "iap-server",
            dependencies: [
                "PurchaseVerification",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]
        ),
        .executableTarget(
            name: "verify-bench",
            dependencies: ["PurchaseVerification", "SandboxStore"],
            path: "tools/verify-bench"
        ),
        .testTarget(
            name: "ContentArchiveTests",
            dependencies: ["ContentArchive"]
        ),
        .testTarget(
            name: "PurchaseVerificationTests",
            dependencies: ["PurchaseVerification", "SandboxStore", "TransactionQueue"]
        ),
    ]
)

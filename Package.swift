// swift-tools-version:6.0
import PackageDescription

let package = Package(
    name: "iap-content",
    platforms: [.macOS(.v14)],
    products: [
        .library(name: "ContentArchive", targets: ["ContentArchive"]),
        .executable(name: "iap-pack", targets: ["iap-pack"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.5.0"),
        .package(url: "https://github.com/apple/swift-crypto.git", "3.12.3"..<"5.0.0"),
        .package(url: "https://github.com/apple/swift-system.git", from: "1.4.0"),
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
        .testTarget(
            name: "ContentArchiveTests",
            dependencies: ["ContentArchive"]
        ),
    ]
)

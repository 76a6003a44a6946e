// swift-tools-version:6.0
// Coverage-guided fuzzing of the parsers that read hostile bytes, with libFuzzer.
// Kept out of the main package so that nothing the project ships or tests links libFuzzer;
// `tools/fuzz.sh` builds it in debug (testing enabled, so the targets reach the parsers behind the
// public API with `@testable import`) with AddressSanitizer, libFuzzer's coverage instrumentation
// and libFuzzer linked without its own main.
import Foundation
import PackageDescription

// A path dependency's identity is its folder's name, which is the clone's name: read it here
// rather than assume the repository is checked out as `iap-content`.
let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../..").standardizedFileURL
let project = root.lastPathComponent.lowercased()

let package = Package(
    name: "iap-fuzz",
    platforms: [.macOS(.v15)],
    dependencies: [
        .package(path: "../.."),
        .package(url: "https://github.com/apple/swift-certificates.git", from: "1.10.0"),
    ],
    targets: [
        .executableTarget(
            name: "iap-fuzz",
            dependencies: [
                "CFuzzerDriver",
                .product(name: "ContentArchive", package: project),
                .product(name: "ContentDelivery", package: project),
                .product(name: "ContentFetch", package: project),
                .product(name: "IAPProtocol", package: project),
                .product(name: "PurchaseVerification", package: project),
                .product(name: "ReceiptVerification", package: project),
                .product(name: "X509", package: "swift-certificates"),
            ]
        ),
        .target(name: "CFuzzerDriver"),
    ],
    swiftLanguageModes: [.v6]
)

import DurableFiles
import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// The names a build writes its archive and manifest under before renaming them into place, and
/// the sweep of those that stopped builds left (``UnfinishedFiles``).
enum UnfinishedOutputs {
    private static let marker = ".partial-"

    /// The temporary name `name` is written under by this process.
    static func temporaryName(for name: String) -> String {
        "." + name + marker + String(getpid())
    }

    /// Whether `name` is a build's temporary archive or manifest: `.<id>-<version>.zip.partial-<pid>`
    /// or `.<id>-<version>.manifest.json.partial-<pid>`.
    static func isTemporaryName(_ name: String) -> Bool {
        guard name.hasPrefix("."), let range = name.range(of: marker, options: .backwards) else { return false }
        let pid = name[range.upperBound...]
        let base = name[..<range.lowerBound]
        return !pid.isEmpty && pid.allSatisfy { $0.isASCII && $0.isNumber }
            && (base.hasSuffix(".zip") || base.hasSuffix(".manifest.json"))
    }

    /// Removes the temporary archives and manifests in `directory` that stopped builds left.
    static func removeLeftovers(in directory: String) -> [String] {
        UnfinishedFiles.removeLeftovers(in: directory, matching: isTemporaryName)
    }
}

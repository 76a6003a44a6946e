import Foundation

/// A certificate authority of the test's own, made with the `openssl` command (a real peer), and
/// server certificates it signs: for HTTPS servers on 127.0.0.1 that a client trusts only when
/// given the authority's certificate.
public struct TestCertificates: Sendable {
    /// The authority's certificate (PEM): what a client is given to trust.
    public let authority: String
    private let authorityKey: String
    private let folder: String

    /// A new authority (EC P-256, valid for a day) in `folder`.
    public init(folder: String) throws {
        self.folder = folder
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        authority = folder + "/ca.pem"
        authorityKey = folder + "/ca.key"
        try Self.openssl([
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", authorityKey,
            "-out", authority, "-days", "1", "-subj", "/CN=iap-content test CA",
        ])
    }

    /// A server certificate and its key (PEM files) for `names`, each `IP:…` or `DNS:…`, signed
    /// by this authority.
    public func server(_ name: String, names: [String]) throws -> (certificate: String, key: String) {
        try issue(name, extensions: "subjectAltName=\(names.joined(separator: ","))\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
    }

    /// A client certificate and its key (PEM files) whose common name is `name` (PostgreSQL's
    /// `cert` authentication takes it as the user), signed by this authority.
    public func client(_ name: String) throws -> (certificate: String, key: String) {
        try issue(name, extensions: "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    }

    private func issue(_ name: String, extensions text: String) throws -> (certificate: String, key: String) {
        let key = folder + "/\(name).key", request = folder + "/\(name).csr", certificate = folder + "/\(name).pem"
        let extensions = folder + "/\(name).ext"
        try text.write(toFile: extensions, atomically: true, encoding: .utf8)
        try Self.openssl(["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", request, "-subj", "/CN=\(name)"])
        try Self.openssl([
            "x509", "-req", "-in", request, "-CA", authority, "-CAkey", authorityKey, "-CAcreateserial", "-out", certificate, "-days", "1",
            "-extfile", extensions,
        ])
        // nginx's workers read the key as an unprivileged user when the tests run as root.
        for file in [key, certificate] { try FileManager.default.setAttributes([.posixPermissions: 0o644], ofItemAtPath: file) }
        return (certificate, key)
    }

    private static func openssl(_ arguments: [String]) throws {
        let result = try run("/usr/bin/openssl", arguments)
        guard result.status == 0 else {
            throw ServerError(description: "openssl \(arguments.first ?? "") failed: \(result.stderr) (install it: apt-get install openssl)")
        }
    }
}

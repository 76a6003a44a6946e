import Foundation
import IAPTestSupport
import SandboxStore
import Testing
import X509

@Suite("The sandbox certificate authority", .onTestThreads)
struct CertificateAuthorityTests {
    func pem(_ certificate: Certificate) throws -> String {
        try certificate.serializeAsPEM().pemString + "\n"
    }

    @Test("OpenSSL's strict RFC 5280 mode accepts the chain: key identifiers, critical constraints, key usage")
    func strictOpenSSL() throws {
        let tmp = try TemporaryFolder()
        let authority = try SandboxCertificateAuthority.generate()
        try tmp.write("root.pem", try pem(authority.root))
        try tmp.write("intermediate.pem", try pem(authority.intermediate))
        try tmp.write("leaf.pem", try pem(authority.leaf))
        let strict = try run("openssl", ["verify", "-x509_strict", "-CAfile", tmp.sub("root.pem"), "-untrusted", tmp.sub("intermediate.pem"), tmp.sub("leaf.pem")])
        #expect(strict.status == 0, "\(strict.stdout) \(strict.stderr)")
        // Each certificate names its key, and below the root its issuer's, as Apple's chain does.
        for (certificate, issuer) in [(authority.intermediate, authority.root), (authority.leaf, authority.intermediate)] {
            let own = try #require(try certificate.extensions.subjectKeyIdentifier)
            let issuers = try #require(try certificate.extensions.authorityKeyIdentifier)
            #expect(issuers.keyIdentifier == (try issuer.extensions.subjectKeyIdentifier)?.keyIdentifier)
            #expect(!own.keyIdentifier.isEmpty)
        }
        // The same chain against another root is refused: the check has teeth.
        let foreign = try SandboxCertificateAuthority.generate()
        try tmp.write("other-root.pem", try pem(foreign.root))
        let wrongRoot = try run("openssl", ["verify", "-x509_strict", "-CAfile", tmp.sub("other-root.pem"), "-untrusted", tmp.sub("intermediate.pem"), tmp.sub("leaf.pem")])
        #expect(wrongRoot.status != 0)
    }
}

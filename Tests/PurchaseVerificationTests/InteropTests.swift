import Foundation
import IAPTestSupport
import PurchaseVerification
import SandboxStore
import Testing
import X509

/// An independent implementation of the same checks, and an independent signer, with Python's
/// `cryptography` package.
let pythonJWS = #"""
    import base64, datetime, json, sys, time
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, utils
    from cryptography.x509.oid import NameOID

    LEAF_OID = x509.ObjectIdentifier('1.2.840.113635.100.6.11.1')
    WWDR_OID = x509.ObjectIdentifier('1.2.840.113635.100.6.2.1')

    def b64url(data): return base64.urlsafe_b64encode(data).rstrip(b'=').decode()
    def unb64url(text): return base64.urlsafe_b64decode(text + '=' * (-len(text) % 4))

    def verify(token, root_path):
        header_b64, payload_b64, sig_b64 = token.strip().split('.')
        header = json.loads(unb64url(header_b64))
        assert header['alg'] == 'ES256', 'alg'
        assert len(header['x5c']) == 3, 'x5c'
        leaf, inter = [x509.load_der_x509_certificate(base64.b64decode(c)) for c in header['x5c'][:2]]
        root = x509.load_der_x509_certificate(open(root_path, 'rb').read())
        leaf.verify_directly_issued_by(inter)
        inter.verify_directly_issued_by(root)
        assert any(e.oid == LEAF_OID for e in leaf.extensions), 'leaf oid'
        assert any(e.oid == WWDR_OID for e in inter.extensions), 'intermediate oid'
        sig = unb64url(sig_b64)
        assert len(sig) == 64, 'raw signature'
        der = utils.encode_dss_signature(int.from_bytes(sig[:32], 'big'), int.from_bytes(sig[32:], 'big'))
        leaf.public_key().verify(der, f'{header_b64}.{payload_b64}'.encode(), ec.ECDSA(hashes.SHA256()))
        print(json.dumps(json.loads(unb64url(payload_b64))))

    def cert(subject, issuer, key, issuer_key, ca, oid):
        now = datetime.datetime.now(datetime.timezone.utc)
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=365))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False), critical=True))
        if oid is not None:
            b = b.add_extension(x509.UnrecognizedExtension(oid, b'\x05\x00'), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def sign(out_dir, bundle_id):
        rk, ik, lk = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
        root = cert('Python Test Root', 'Python Test Root', rk, rk, True, None)
        inter = cert('Python Test WWDR', 'Python Test Root', ik, rk, True, WWDR_OID)
        leaf = cert('Python Test Signer', 'Python Test WWDR', lk, ik, False, LEAF_OID)
        now = int(time.time() * 1000)
        payload = {'transactionId': '1000000999999999', 'originalTransactionId': '1000000999999999', 'bundleId': bundle_id,
                   'productId': 'com.example.python', 'purchaseDate': now, 'originalPurchaseDate': now, 'quantity': 1,
                   'type': 'Non-Consumable', 'inAppOwnershipType': 'PURCHASED', 'signedDate': now, 'environment': 'Sandbox',
                   'storefront': 'GBR', 'transactionReason': 'PURCHASE', 'someFutureField': {'x': 1}}
        header = {'alg': 'ES256', 'x5c': [base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode() for c in (leaf, inter, root)]}
        signing_input = f'{b64url(json.dumps(header).encode())}.{b64url(json.dumps(payload).encode())}'
        r, s = utils.decode_dss_signature(lk.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        open(out_dir + '/python.jws', 'w').write(signing_input + '.' + b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big')))
        open(out_dir + '/python-root.cer', 'wb').write(root.public_bytes(serialization.Encoding.DER))

    if sys.argv[1] == 'verify':
        verify(open(sys.argv[2]).read(), sys.argv[3])
    else:
        sign(sys.argv[2], sys.argv[3])
    """#

@Suite("Interoperability with Python's cryptography", .onTestThreads)
struct InteropTests {
    @Test("Python verifies sandbox-signed transactions (chain, marker OIDs, raw ES256) and rejects a tampered one")
    func pythonVerifiesOurs() throws {
        let tmp = try TemporaryFolder()
        try pythonJWS.write(toFile: tmp.sub("jws.py"), atomically: true, encoding: .utf8)
        let store = try SandboxStore.initialize(folder: tmp.sub("store"), bundleId: "com.example.app")
        let purchase = try store.purchase(productId: "com.example.levels1")
        try purchase.signedTransaction.write(toFile: tmp.sub("ours.jws"), atomically: true, encoding: .utf8)
        let result = try run("python3", [tmp.sub("jws.py"), "verify", tmp.sub("ours.jws"), store.rootCertificatePath])
        #expect(result.status == 0, "\(result.stderr)")
        let payload = try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any]
        #expect(payload?["transactionId"] as? String == purchase.transaction.transactionId)

        let refund = try store.refund(transactionId: purchase.transaction.transactionId!)
        try refund.signedPayload.write(toFile: tmp.sub("notification.jws"), atomically: true, encoding: .utf8)
        #expect(try run("python3", [tmp.sub("jws.py"), "verify", tmp.sub("notification.jws"), store.rootCertificatePath]).status == 0)

        var parts = purchase.signedTransaction.split(separator: ".").map(String.init)
        parts[1] = base64URLEncode(Data(#"{"transactionId":"1","productId":"everything"}"#.utf8))
        try parts.joined(separator: ".").write(toFile: tmp.sub("tampered.jws"), atomically: true, encoding: .utf8)
        #expect(try run("python3", [tmp.sub("jws.py"), "verify", tmp.sub("tampered.jws"), store.rootCertificatePath]).status != 0)
    }

    @Test("we verify a transaction Python signed with its own chain carrying the marker OIDs")
    func weVerifyPythons() async throws {
        let tmp = try TemporaryFolder()
        try pythonJWS.write(toFile: tmp.sub("jws.py"), atomically: true, encoding: .utf8)
        let made = try run("python3", [tmp.sub("jws.py"), "sign", tmp.path, "com.example.app"])
        #expect(made.status == 0, "\(made.stderr)")
        let token = try String(contentsOfFile: tmp.sub("python.jws"), encoding: .utf8)
        let root = try AppleRoots.load(path: tmp.sub("python-root.cer"))
        let verifier = SignedDataVerifier(configuration: .init(bundleId: "com.example.app", trustRoots: [AppleRoots.rootCAG3, root], environments: .sandbox))
        let transaction = try await verifier.verifyTransaction(token)
        #expect(transaction.productId == "com.example.python")
        #expect(transaction.storefront == "GBR")
        let untrusting = SignedDataVerifier(configuration: .init(bundleId: "com.example.app", environments: .sandbox))
        #expect(await VerificationErrorCode.of { _ = try await untrusting.verifyTransaction(token) } == .untrustedChain)
    }
}

#ifndef IAP_COPENSSL_SHIM_H
#define IAP_COPENSSL_SHIM_H
/* The few PKCS#7 operations app receipts need, over the system's libcrypto (Debian: libssl-dev).
   Written as C helpers because the PKCS#7 API is macros and struct fields Swift cannot reach. */
#include <string.h>
#include <time.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/objects.h>
#include <openssl/pem.h>
#include <openssl/pkcs7.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

/* Outcomes of iap_pkcs7_open and iap_pkcs7_verify. */
enum {
    IAP_PKCS7_OK = 0,
    IAP_PKCS7_NOT_PKCS7 = 1,         /* not BER/DER PKCS#7, or trailing bytes */
    IAP_PKCS7_NOT_SIGNED_DATA = 2,   /* another content type, or no attached data */
    IAP_PKCS7_SIGNERS = 3,           /* not exactly one signer, or its certificate is absent */
    IAP_PKCS7_CHAIN = 4,             /* the signer's chain does not reach a trusted root at the time */
    IAP_PKCS7_MARKER = 5,            /* the leaf or intermediate lacks Apple's marker extension */
    IAP_PKCS7_SIGNATURE = 6,         /* the signature does not match the content */
    IAP_PKCS7_INTERNAL = 7,          /* out of memory or the like */
    IAP_PKCS7_CERTIFICATES = 8       /* too many certificates, or a chain of the wrong length */
};

/* Parses BER or DER PKCS#7 SignedData with attached `data` content; *content points into the
   returned object (valid until iap_pkcs7_free). NULL with *status set on failure. */
static inline PKCS7 *iap_pkcs7_open(const unsigned char *bytes, long length, const unsigned char **content, long *contentLength, int *status) {
    const unsigned char *cursor = bytes;
    PKCS7 *p7 = d2i_PKCS7(NULL, &cursor, length);
    ERR_clear_error();
    if (p7 == NULL || cursor != bytes + length) { PKCS7_free(p7); *status = IAP_PKCS7_NOT_PKCS7; return NULL; }
    if (!PKCS7_type_is_signed(p7) || p7->d.sign == NULL || p7->d.sign->contents == NULL
        || !PKCS7_type_is_data(p7->d.sign->contents) || p7->d.sign->contents->d.data == NULL) {
        PKCS7_free(p7); *status = IAP_PKCS7_NOT_SIGNED_DATA; return NULL;
    }
    *content = p7->d.sign->contents->d.data->data;
    *contentLength = p7->d.sign->contents->d.data->length;
    *status = IAP_PKCS7_OK;
    return p7;
}

static inline void iap_pkcs7_free(PKCS7 *p7) { PKCS7_free(p7); }

static inline int iap_has_extension(X509 *cert, const char *oid) {
    ASN1_OBJECT *object = OBJ_txt2obj(oid, 1);
    if (object == NULL) return 0;
    int found = X509_get_ext_by_OBJ(cert, object, -1) >= 0;
    ASN1_OBJECT_free(object);
    return found;
}

/* The signer's certificate in DER (for a cache key); 0 when there is not exactly one signer. */
static inline int iap_pkcs7_signer_der(PKCS7 *p7, unsigned char **der) {
    STACK_OF(PKCS7_SIGNER_INFO) *infos = PKCS7_get_signer_info(p7);
    if (infos == NULL || sk_PKCS7_SIGNER_INFO_num(infos) != 1) return 0;
    STACK_OF(X509) *signers = PKCS7_get0_signers(p7, NULL, 0);
    ERR_clear_error();
    if (signers == NULL || sk_X509_num(signers) != 1) { sk_X509_free(signers); return 0; }
    int length = i2d_X509(sk_X509_value(signers, 0), der);
    sk_X509_free(signers);
    return length > 0 ? length : 0;
}

/* Verifies the one signer's chain through the receipt's certificates to a root in `store`, at
   `at` (the receipt's creation date, not now: Apple's intermediates expire and rotate), requires
   exactly leaf → intermediate → root with `leafMarker` on the leaf and `intermediateMarker` on
   the intermediate (either may be NULL), unless `skipChain` (the caller cached this signer's
   verdict); then the signature over the content. */
static inline int iap_pkcs7_verify(PKCS7 *p7, X509_STORE *store, time_t at, const char *leafMarker, const char *intermediateMarker,
                                   int maxCertificates, int skipChain, time_t *validFrom, time_t *validUntil) {
    STACK_OF(PKCS7_SIGNER_INFO) *infos = PKCS7_get_signer_info(p7);
    if (infos == NULL || sk_PKCS7_SIGNER_INFO_num(infos) != 1) return IAP_PKCS7_SIGNERS;
    STACK_OF(X509) *certs = p7->d.sign->cert;
    if (certs != NULL && sk_X509_num(certs) > maxCertificates) return IAP_PKCS7_CERTIFICATES;
    STACK_OF(X509) *signers = PKCS7_get0_signers(p7, NULL, 0);
    ERR_clear_error();
    if (signers == NULL || sk_X509_num(signers) != 1) { sk_X509_free(signers); return IAP_PKCS7_SIGNERS; }
    X509 *leaf = sk_X509_value(signers, 0);
    int result = IAP_PKCS7_OK;
    if (!skipChain) {
        X509_STORE_CTX *ctx = X509_STORE_CTX_new();
        if (ctx == NULL || !X509_STORE_CTX_init(ctx, store, leaf, certs)) { X509_STORE_CTX_free(ctx); sk_X509_free(signers); return IAP_PKCS7_INTERNAL; }
        X509_STORE_CTX_set_time(ctx, 0, at);
        X509_STORE_CTX_set_purpose(ctx, X509_PURPOSE_ANY);
        if (X509_verify_cert(ctx) != 1) {
            result = IAP_PKCS7_CHAIN;
        } else {
            STACK_OF(X509) *chain = X509_STORE_CTX_get0_chain(ctx);
            if (chain == NULL || sk_X509_num(chain) != 3) result = IAP_PKCS7_CERTIFICATES;
            else if ((leafMarker && !iap_has_extension(sk_X509_value(chain, 0), leafMarker))
                     || (intermediateMarker && !iap_has_extension(sk_X509_value(chain, 1), intermediateMarker))) result = IAP_PKCS7_MARKER;
            else {
                /* The window in which every certificate of this chain is valid: a cache of the
                   verdict holds for any date inside it. */
                time_t from = 0, until = (time_t)0x7fffffffffffffffLL;
                for (int i = 0; i < 3; i++) {
                    struct tm t;
                    X509 *c = sk_X509_value(chain, i);
                    if (ASN1_TIME_to_tm(X509_get0_notBefore(c), &t) != 1) { result = IAP_PKCS7_CHAIN; break; }
                    time_t nb = timegm(&t);
                    if (ASN1_TIME_to_tm(X509_get0_notAfter(c), &t) != 1) { result = IAP_PKCS7_CHAIN; break; }
                    time_t na = timegm(&t);
                    if (nb > from) from = nb;
                    if (na < until) until = na;
                }
                *validFrom = from;
                *validUntil = until;
            }
        }
        X509_STORE_CTX_free(ctx);
        ERR_clear_error();
    }
    if (result == IAP_PKCS7_OK) {
        BIO *sink = BIO_new(BIO_s_null());
        if (sink == NULL) result = IAP_PKCS7_INTERNAL;
        else if (PKCS7_verify(p7, NULL, NULL, NULL, sink, PKCS7_NOVERIFY | PKCS7_BINARY) != 1) result = IAP_PKCS7_SIGNATURE;
        BIO_free(sink);
        ERR_clear_error();
    }
    sk_X509_free(signers);
    return result;
}

static inline X509_STORE *iap_store_new(void) { return X509_STORE_new(); }
static inline void iap_store_free(X509_STORE *store) { X509_STORE_free(store); }

/* Adds a DER certificate as a trusted root; 0 when it does not parse. */
static inline int iap_store_add_der(X509_STORE *store, const unsigned char *der, long length) {
    const unsigned char *cursor = der;
    X509 *cert = d2i_X509(NULL, &cursor, length);
    if (cert == NULL) { ERR_clear_error(); return 0; }
    int ok = X509_STORE_add_cert(store, cert);
    X509_free(cert);
    ERR_clear_error();
    return ok;
}

/* Signs `content` as Apple signs receipts: PKCS#7 SignedData, attached data, no signed
   attributes, the given certificates included, written as BER with indefinite lengths (what
   real receipts look like). `sha1` picks SHA-1 instead of SHA-256. *out is OPENSSL_malloc'ed;
   free it with iap_free. */
static inline int iap_pkcs7_sign(const unsigned char *content, long contentLength, const char *keyPEM, const unsigned char *leafDER, long leafLength,
                                 const unsigned char *extraDER, const long *extraLengths, int extraCount, int sha1, unsigned char **out, long *outLength) {
    int ok = 0;
    BIO *keyBIO = BIO_new_mem_buf(keyPEM, -1);
    EVP_PKEY *key = keyBIO ? PEM_read_bio_PrivateKey(keyBIO, NULL, NULL, NULL) : NULL;
    const unsigned char *cursor = leafDER;
    X509 *leaf = d2i_X509(NULL, &cursor, leafLength);
    PKCS7 *p7 = NULL;
    BIO *in = NULL, *sink = NULL;
    if (key == NULL || leaf == NULL) goto done;
    int flags = PKCS7_BINARY | PKCS7_NOATTR | PKCS7_NOSMIMECAP | PKCS7_PARTIAL | PKCS7_STREAM;
    p7 = PKCS7_sign(NULL, NULL, NULL, NULL, flags);
    if (p7 == NULL || PKCS7_sign_add_signer(p7, leaf, key, sha1 ? EVP_sha1() : EVP_sha256(), flags) == NULL) goto done;
    if (!PKCS7_add_certificate(p7, leaf)) goto done;
    const unsigned char *extra = extraDER;
    for (int i = 0; i < extraCount; i++) {
        const unsigned char *c = extra;
        X509 *cert = d2i_X509(NULL, &c, extraLengths[i]);
        if (cert == NULL) goto done;
        int added = PKCS7_add_certificate(p7, cert);
        X509_free(cert);
        if (!added) goto done;
        extra += extraLengths[i];
    }
    in = BIO_new_mem_buf(content, (int)contentLength);
    sink = BIO_new(BIO_s_mem());
    if (in == NULL || sink == NULL || !i2d_PKCS7_bio_stream(sink, p7, in, flags)) goto done;
    char *data = NULL;
    long length = BIO_get_mem_data(sink, &data);
    if (length <= 0) goto done;
    *out = OPENSSL_malloc((size_t)length);
    if (*out == NULL) goto done;
    memcpy(*out, data, (size_t)length);
    *outLength = length;
    ok = 1;
done:
    BIO_free(keyBIO); EVP_PKEY_free(key); X509_free(leaf); PKCS7_free(p7); BIO_free(in); BIO_free(sink);
    ERR_clear_error();
    return ok;
}

static inline void iap_free(void *pointer) { OPENSSL_free(pointer); }

/* The one signer's issuerAndSerialNumber in DER (what the fast path matches a cached signer by). */
static inline int iap_pkcs7_signer_issuer_serial(PKCS7 *p7, unsigned char **der) {
    STACK_OF(PKCS7_SIGNER_INFO) *infos = PKCS7_get_signer_info(p7);
    if (infos == NULL || sk_PKCS7_SIGNER_INFO_num(infos) != 1) return 0;
    PKCS7_SIGNER_INFO *info = sk_PKCS7_SIGNER_INFO_value(infos, 0);
    int length = i2d_PKCS7_ISSUER_AND_SERIAL(info->issuer_and_serial, der);
    ERR_clear_error();
    return length > 0 ? length : 0;
}

/* The one signer's public key (a new reference), after iap_pkcs7_verify succeeded. */
static inline EVP_PKEY *iap_pkcs7_signer_key(PKCS7 *p7) {
    STACK_OF(X509) *signers = PKCS7_get0_signers(p7, NULL, 0);
    ERR_clear_error();
    if (signers == NULL || sk_X509_num(signers) != 1) { sk_X509_free(signers); return NULL; }
    EVP_PKEY *key = X509_get_pubkey(sk_X509_value(signers, 0));
    sk_X509_free(signers);
    return key;
}

static inline void iap_pkey_free(EVP_PKEY *key) { EVP_PKEY_free(key); }

/* RSA PKCS#1 v1.5 over SHA-1 or SHA-256 of `content`: the signature of a SignerInfo without
   signed attributes, checked with a key taken from a signer verified before. 1 when valid. */
static inline int iap_rsa_verify(EVP_PKEY *key, int sha1, const unsigned char *content, size_t length, const unsigned char *signature, size_t signatureLength) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (ctx == NULL) return 0;
    int ok = EVP_DigestVerifyInit(ctx, NULL, sha1 ? EVP_sha1() : EVP_sha256(), NULL, key) == 1
        && EVP_DigestVerify(ctx, signature, signatureLength, content, length) == 1;
    EVP_MD_CTX_free(ctx);
    ERR_clear_error();
    return ok;
}

#endif

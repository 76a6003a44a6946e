/// The `WWW-Authenticate` challenge each kind of 401 carries. RFC 9110 §15.5.2: a 401 without one
/// is malformed, and some clients fail on it before reading the body (Android's
/// `HttpURLConnection`: "No authentication challenges found").
public enum Challenge {
    /// A grant token in a content path that is forged, expired or signed by a retired key
    /// (RFC 6750 §3.1 `invalid_token`): ask `POST /v1/downloads` for a new grant. The token is a
    /// bearer capability, carried in the path rather than in `Authorization`.
    public static let grant = "Bearer realm=\"iap-content\", error=\"invalid_token\""
    /// A proof of purchase or a notification whose App Store signature does not verify (a forged
    /// or altered JWS, an app receipt's PKCS#7, a chain to no configured root). The proof travels
    /// in the request body, so the scheme only names what is missing.
    public static let appStoreSignature = "AppStoreSignature realm=\"iap-server\""
    /// The admin API without its token, or with another one (RFC 6750 §3.1: `invalid_token` only
    /// when one was sent).
    public static func admin(tokenSent: Bool) -> String {
        "Bearer realm=\"iap-server admin\"" + (tokenSent ? ", error=\"invalid_token\"" : "")
    }
}

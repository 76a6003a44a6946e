/// The version of these tools and libraries: every tool's `--version`, and iap-fetch's
/// `User-Agent`, so that a server's logs tell which clients ask. Raised with each release; the
/// HTTP API has its own version in its paths (`/v1`).
public enum IAPContentVersion {
    public static let current = "0.14.0"
}

/// The server's paths, shared by the server that routes them and the clients that call them.
public enum Route {
    /// `POST`: a proof of purchase in, download grants out (``DownloadRequest`` → ``DownloadGrants``).
    public static let downloads = "/v1/downloads"
    /// `POST`: App Store Server Notifications V2 (``NotificationRequest`` → ``NotificationReceipt``).
    public static let notifications = "/v1/notifications"
    /// `GET /v1/products/{productId}` (→ ``ProductInfo``).
    public static let productPattern = "/v1/products/{productId}"
    /// `PUT` with the admin token: publishes an archive (→ ``PublishReceipt``).
    public static let adminArchives = "/v1/admin/archives"
    /// `POST` with the admin token: stages, promotes or rolls back a version (``RolloutRequest`` →
    /// ``ProductInfo/Version``).
    public static let adminRollouts = "/v1/admin/rollouts"
    /// `DELETE` with the admin token: removes a rolled-back version and deletes its archive
    /// (→ ``VersionRemoval``).
    public static let adminVersionPattern = "/v1/admin/archives/{productId}/{contentVersion}"
    /// `GET`, `HEAD`: `<contentPrefix><grant token>/<productId>-<contentVersion>.zip`, the archive bytes;
    /// `...-<contentVersion>.manifest.json`, its manifest.
    public static let contentPrefix = "/v1/content/"
    /// `GET` with ``grantCheckURIHeader`` holding a content path: 200 (empty) when its grant is valid and
    /// not revoked, with the archive's SHA-256 in ``grantCheckArchiveHeader`` (an edge cache's key),
    /// 401 or 403 otherwise; every answer may be cached for one second. For nginx's `auth_request`.
    public static let grantCheck = "/v1/grant-check"
    /// The content path a grant check is about (nginx: `proxy_set_header X-Original-URI $request_uri`).
    public static let grantCheckURIHeader = "X-Original-URI"
    /// The checked grant's archive, so an edge caches bytes by content, not by token.
    public static let grantCheckArchiveHeader = "IAP-Archive-SHA256"
    /// `GET`: Prometheus text.
    public static let metrics = "/metrics"
    /// `GET`: 200 while the process runs.
    public static let health = "/healthz"
    /// `GET`: 200 when the catalog database answers and every published archive is on disk; 503
    /// naming what is wrong otherwise (for a load balancer's readiness check).
    public static let ready = "/readyz"
    /// `/readyz?for=downloads`: ready to serve download URLs, whether or not the database answers.
    public static let readyScopeParameter = "for"
    public static let readyScopeDownloads = "downloads"

    /// The path that removes a version (``adminVersionPattern``).
    public static func adminVersion(productId: String, contentVersion: String) -> String {
        adminArchives + "/" + productId + "/" + contentVersion
    }

    /// The path of a product's information.
    public static func product(_ productId: String) -> String { "/v1/products/" + productId }

    /// The path of an archive's manifest under a grant.
    public static func manifest(token: String, productId: String, contentVersion: String) -> String {
        contentPrefix + token + "/" + productId + "-" + contentVersion + manifestSuffix
    }

    /// What ends a content path that asks for the manifest instead of the archive.
    public static let manifestSuffix = ".manifest.json"

    /// The path of an archive's bytes under a grant; the file name is for people and caches only.
    public static func content(token: String, productId: String, contentVersion: String) -> String {
        contentPrefix + token + "/" + productId + "-" + contentVersion + ".zip"
    }
}

import ContentCatalog

extension ContentStore {
    /// The store in `dataDirectory`, with its state in PostgreSQL when `databaseURL` is given
    /// (`postgres://…`) and in `<dataDirectory>/catalog.sqlite` otherwise.
    /// Archives live in `archivesDirectory` (default `<dataDirectory>/archives`).
    public static func open(dataDirectory: String, archivesDirectory: String? = nil, databaseURL: String?) async throws(CatalogError) -> ContentStore {
        guard let databaseURL, !databaseURL.isEmpty else { return try ContentStore(dataDirectory: dataDirectory, archivesDirectory: archivesDirectory) }
        return try ContentStore(dataDirectory: dataDirectory, archivesDirectory: archivesDirectory, database: try await PostgresCatalog(url: databaseURL))
    }
}

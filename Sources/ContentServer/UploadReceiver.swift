import ContentArchive
import Foundation
import HTTPTypes
import Hummingbird
import IAPProtocol
import MultipartKit
import NIOCore
import SystemPackage

/// Why an upload body could not be taken: the status and error to answer with.
struct UploadError: Error {
    let status: HTTPResponse.Status
    let error: APIError

    init(_ status: HTTPResponse.Status, _ code: APIErrorCode, _ message: String) {
        self.status = status
        error = APIError(code, message)
    }
}

/// Streams an admin upload into a file, never holding the archive in memory. The body is either
/// the archive itself, or `multipart/form-data` with a part named `archive` (streamed to the
/// file) and optionally one named `manifest` (the manifest JSON, kept in memory up to 16 MiB).
enum UploadReceiver {
    static let maxManifest = 16 << 20
    /// Part headers (and a preamble) larger than this are refused: the parser would buffer them.
    static let maxPartHeaders = 64 << 10

    /// Writes the archive bytes to `fd`; returns the manifest part's bytes, if one was sent.
    /// A declared `length` that cannot fit is refused before anything is read.
    static func receive(
        _ body: RequestBody, contentType: String?, length: UInt64?, into fd: SystemPackage.FileDescriptor,
        folder: String, beforeReading: () async -> Void = {}
    ) async throws(UploadError) -> [UInt8]? {
        if let contentType, contentType.lowercased().hasPrefix("multipart/") {
            guard contentType.lowercased().hasPrefix("multipart/form-data"), let boundary = boundary(contentType) else {
                throw UploadError(.badRequest, .invalidMultipart, "a multipart upload must be multipart/form-data with a boundary parameter")
            }
            // Room for the archive, the manifest and their part headers.
            let most = ArchiveLimits.maxArchiveSize + UInt64(maxManifest + 2 * maxPartHeaders)
            if let length, length > most {
                throw UploadError(.contentTooLarge, .tooLarge, "the upload is \(length) bytes; an archive is at most \(ArchiveLimits.maxArchiveSize) bytes (2 GiB) and its manifest 16 MiB")
            }
            await beforeReading()
            return try await receiveMultipart(body, boundary: boundary, into: fd, folder: folder)
        }
        if let length, length > ArchiveLimits.maxArchiveSize {
            throw UploadError(.contentTooLarge, .tooLarge, "the upload is \(length) bytes; archives are at most \(ArchiveLimits.maxArchiveSize) bytes (2 GiB)")
        }
        await beforeReading()
        var written: UInt64 = 0
        let writes = gatheredWrites(to: fd, folder: folder)
        do {
            for try await chunk in body {
                written += UInt64(chunk.readableBytes)
                guard written <= ArchiveLimits.maxArchiveSize else { throw tooLarge }
                try writes.append(chunk)
            }
            try writes.flush()
        } catch let error as UploadError {
            throw error
        } catch {
            throw UploadError(.badRequest, .uploadInterrupted, "the upload ended early: \(error)")
        }
        return nil
    }

    private static let tooLarge = UploadError(.contentTooLarge, .tooLarge, "the upload passed \(ArchiveLimits.maxArchiveSize) bytes (2 GiB), the most an archive may weigh")

    /// Upload bytes gathered into large writes: the stored archive is what sendfile serves next.
    private static func gatheredWrites(to fd: SystemPackage.FileDescriptor, folder: String) -> GatheredWrites<UploadError> {
        GatheredWrites { chunk throws(UploadError) in try write(chunk, to: fd, folder: folder) }
    }

    private static func write(_ chunk: ByteBuffer, to fd: SystemPackage.FileDescriptor, folder: String) throws(UploadError) {
        do {
            _ = try chunk.withUnsafeReadableBytes { try fd.writeAll($0) }
        } catch let error as Errno where error == .noSpace || error == .fileTooLarge {
            throw UploadError(
                HTTPResponse.Status(code: 507, reasonPhrase: "Insufficient Storage"), .insufficientStorage,
                "the data folder \(folder) is full (\(error)): free space there and upload again; nothing was published")
        } catch {
            throw UploadError(.serviceUnavailable, .storage, "could not store the upload in \(folder): \(error)")
        }
    }

    static func boundary(_ contentType: String) -> String? {
        guard let value = parameter("boundary", in: contentType), (1...70).contains(value.utf8.count) else { return nil }
        return value
    }

    /// A `name=value` or `name="value"` parameter of a header such as Content-Type or
    /// Content-Disposition (names compared case-insensitively).
    static func parameter(_ name: String, in header: String) -> String? {
        for parameter in header.split(separator: ";").dropFirst() {
            let pair = parameter.split(separator: "=", maxSplits: 1).map { $0.trimmingCharacters(in: .whitespaces) }
            guard pair.count == 2, pair[0].lowercased() == name else { continue }
            return pair[1].hasPrefix("\"") && pair[1].hasSuffix("\"") && pair[1].count >= 2 ? String(pair[1].dropFirst().dropLast()) : pair[1]
        }
        return nil
    }

    /// The state of one multipart upload, fed by the parser's callbacks.
    private final class Parts {
        enum Part: Equatable { case none, archive, manifest }
        var current = Part.none
        var sawArchive = false
        var sawManifest = false
        var manifest: [UInt8] = []
        var archiveBytes: UInt64 = 0
        var failure: UploadError?
        var bodyCalls = 0
        var inBody = false
    }

    private static func receiveMultipart(_ body: RequestBody, boundary: String, into fd: SystemPackage.FileDescriptor, folder: String) async throws(UploadError) -> [UInt8]? {
        let parser = MultipartParser(boundary: boundary)
        let parts = Parts()
        let writes = gatheredWrites(to: fd, folder: folder)
        parser.onHeader = { name, value in
            guard parts.failure == nil, name.lowercased() == "content-disposition" else { return }
            switch parameter("name", in: value) {
            case "archive" where !parts.sawArchive: parts.current = .archive
            case "manifest" where !parts.sawManifest: parts.current = .manifest
            case let other:
                parts.failure = UploadError(
                    .badRequest, .invalidMultipart, "unexpected part '\(other ?? "")': send the archive in one part named 'archive' and, optionally, the manifest JSON in one named 'manifest'")
            }
        }
        parser.onBody = { buffer in
            parts.bodyCalls += 1
            parts.inBody = true
            guard parts.failure == nil else { return }
            switch parts.current {
            case .archive:
                parts.archiveBytes += UInt64(buffer.readableBytes)
                guard parts.archiveBytes <= ArchiveLimits.maxArchiveSize else {
                    parts.failure = tooLarge
                    return
                }
                do throws(UploadError) { try writes.append(buffer) } catch { parts.failure = error }
            case .manifest:
                guard parts.manifest.count + buffer.readableBytes <= maxManifest else {
                    parts.failure = UploadError(.contentTooLarge, .tooLarge, "the manifest part passed 16 MiB")
                    return
                }
                parts.manifest += buffer.readableBytesView
            case .none:
                parts.failure = UploadError(.badRequest, .invalidMultipart, "a part has no Content-Disposition name: name the parts 'archive' and 'manifest'")
            }
        }
        parser.onPartComplete = {
            switch parts.current {
            case .archive: parts.sawArchive = true
            case .manifest: parts.sawManifest = true
            case .none: break
            }
            parts.current = .none
            parts.inBody = false
        }
        var headerBytes = 0
        do {
            for try await chunk in body {
                // Fed in slices so that bytes spent outside any part body (headers, preamble) are
                // counted as they come: the parser keeps headers in memory.
                var rest = chunk
                while rest.readableBytes > 0, let slice = rest.readSlice(length: min(rest.readableBytes, 16 << 10)) {
                    let before = parts.bodyCalls
                    try parser.execute(slice)
                    if let failure = parts.failure { throw failure }
                    if parts.bodyCalls == before && !parts.inBody {
                        headerBytes += slice.readableBytes
                        guard headerBytes <= maxPartHeaders else {
                            throw UploadError(.badRequest, .invalidMultipart, "multipart headers passed 64 KiB")
                        }
                    } else {
                        headerBytes = 0
                    }
                }
            }
            try writes.flush()
        } catch let error as UploadError {
            throw error
        } catch {
            throw UploadError(.badRequest, .invalidMultipart, "the multipart body is malformed or ended early: \(error)")
        }
        guard parts.sawArchive else {
            throw UploadError(.badRequest, .invalidMultipart, "the multipart body has no complete part named 'archive': send the archive there")
        }
        return parts.sawManifest ? parts.manifest : nil
    }
}

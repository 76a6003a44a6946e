import Foundation
import X509

@testable import ContentArchive
@testable import ContentDelivery
@testable import ContentFetch
import IAPProtocol
@testable import PurchaseVerification
@testable import ReceiptVerification

/// The parsers that read bytes from the network or from an archive, each as a libFuzzer target.
/// A target may throw any error it likes (refusing input is their job); it fails only by crashing,
/// by breaking one of the invariants it checks with `fatalError`, or under the address sanitizer.
enum FuzzTarget: String, CaseIterable {
    /// A content archive as `iap-pack verify` and `iap-fetch` open it: central directory, local
    /// headers, every entry inflated and checked, the plist, and extraction into a folder.
    case archive
    /// A manifest, by the hand-written reader and by `JSONDecoder`, which must agree.
    case manifest
    /// `ContentInfo.plist`.
    case plist
    /// An app receipt: the PKCS#7 container, the payload's ASN.1 set, and the whole verifier.
    case receipt
    /// A StoreKit 2 compact JWS: splitting, base64url, the duplicate-member scan, the header.
    case jws
    /// The content server's fast-path request head parser and its byte-range evaluation.
    case http
    /// The client's response head parser (`iap-fetch`'s plain-HTTP reader) and its
    /// `Content-Length` rule: what a hostile server or proxy sends first.
    case response
    /// The tools' own state files, as a crash or a full disk may leave them: iap-pack's hash
    /// cache beside an archive and iap-fetch's record of an installed version.
    case state

    func run(_ bytes: UnsafeRawBufferPointer) {
        switch self {
        case .archive: Self.archive(bytes)
        case .manifest: Self.manifest(bytes)
        case .plist: _ = try? ContentInfo(plist: Data(bytes), source: "fuzz")
        case .receipt: Self.receipt(bytes)
        case .jws: Self.jws(bytes)
        case .http: Self.http(bytes)
        case .response: Self.response(bytes)
        case .state: Self.state(bytes)
        }
    }

    /// Makes what the target keeps for the whole run before libFuzzer starts counting: it checks
    /// for leaks around each input, and a value made once on the first input is no leak.
    func prepare() {
        _ = Self.scratch
        switch self {
        case .receipt: _ = Self.receiptVerifier
        case .jws: _ = Self.jwsVerifier
        case .http: _ = Self.headParser
        default: break
        }
    }

    /// Per process, so that several fuzzing jobs (`-jobs`) do not share files.
    static let scratch: String = {
        let base = FileManager.default.fileExists(atPath: "/dev/shm") ? "/dev/shm" : NSTemporaryDirectory()
        let folder = "\(base)/iap-fuzz-\(getpid())"
        try? FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        return folder
    }()

    /// Small limits, so that a claimed size cannot make one input take seconds.
    static let limits = ExtractionLimits(maxEntries: 256, maxTotalUncompressedSize: 4 << 20, maxCompressionRatio: 200, ratioExemptSize: 64 << 10)

    static func archive(_ bytes: UnsafeRawBufferPointer) {
        let path = "\(scratch)/input.zip"
        let destination = "\(scratch)/out"
        guard FileManager.default.createFile(atPath: path, contents: Data(bytes)) else { fatalError("cannot write \(path)") }
        if let reader = try? ArchiveReader(path: path, limits: limits) {
            for entry in reader.entries {
                guard entry.dataOffset + entry.compressedSize <= reader.size else {
                    fatalError("reader accepted '\(entry.path)' ending past the archive's \(reader.size) bytes")
                }
                var count: UInt64 = 0
                if (try? reader.read(entry, into: { count += UInt64($0.count) })) != nil, count != entry.uncompressedSize {
                    fatalError("read '\(entry.path)' gave \(count) bytes, not its declared \(entry.uncompressedSize)")
                }
            }
            _ = try? reader.contentInfo()
        }
        try? FileManager.default.removeItem(atPath: destination)
        let extracted = (try? SafeExtractor.extract(archive: path, to: destination, limits: limits, durable: false)) != nil
        if extracted { checkConfined(destination) }
        streamed(bytes, archive: path, extracted: extracted ? destination : nil)
        try? FileManager.default.removeItem(atPath: destination)
    }

    /// The same bytes extracted as they arrive, in pieces whose sizes the input sets, following the
    /// layout the archive's own directory gives (as a manifest honest about it would): the folder
    /// must be put in place exactly when `SafeExtractor` installed one (`extracted`), and the same.
    static func streamed(_ bytes: UnsafeRawBufferPointer, archive path: String, extracted: String?) {
        let destination = "\(scratch)/streamed"
        try? FileManager.default.removeItem(atPath: destination)
        defer { try? FileManager.default.removeItem(atPath: destination) }
        guard let reader = try? ArchiveReader(path: path, limits: limits), let info = try? reader.contentInfo() else {
            if extracted != nil { fatalError("SafeExtractor installed an archive whose directory or plist the reader refuses") }
            return
        }
        let entries = reader.entries.map {
            ArchiveManifest.Entry(
                path: $0.path, kind: $0.isDirectory ? .directory : .file, method: $0.method, uncompressedSize: $0.uncompressedSize,
                compressedSize: $0.compressedSize, crc32: $0.crc32, sha256: "", localHeaderOffset: $0.localHeaderOffset, dataOffset: $0.dataOffset)
        }
        let manifest = ArchiveManifest(
            productId: info.productIdentifier, contentVersion: info.contentVersion, archiveName: path, archiveSize: reader.size,
            archiveSHA256: "", contentLength: 0, createdAt: "", entries: entries)
        // Every file as it arrives, or only those of 64 bytes and more (the rest placed at the end).
        let threshold: UInt64 = bytes.count % 2 == 0 ? 0 : 64
        guard let extractor = try? StreamingExtractor(manifest: manifest, destination: destination, streamingAtLeast: threshold, limits: limits, durable: false)
        else {
            if extracted != nil { fatalError("the layout of an archive SafeExtractor installed was refused") }
            return
        }
        // A partial archive that left out the stored files' bytes, as iap-fetch's does: an
        // extraction that gives up must put back exactly the bytes it took.
        let partial = "\(scratch)/left-out.zip"
        var leftOut = [UInt8](bytes)
        for range in extractor.storedRanges where range.upperBound <= UInt64(leftOut.count) {
            leftOut.replaceSubrange(Int(range.lowerBound)..<Int(range.upperBound), with: repeatElement(0, count: range.count))
        }
        guard FileManager.default.createFile(atPath: partial, contents: Data(leftOut)) else { fatalError("cannot write \(partial)") }
        extractor.copyBack(into: partial)
        var offset = 0
        var step = 1 + Int(bytes.first ?? 0) * 37
        while offset < bytes.count {
            let count = min(step, bytes.count - offset)
            try? extractor.consume(UnsafeRawBufferPointer(rebasing: bytes[offset..<offset + count]), at: UInt64(offset))
            offset += count
            step = 1 + (step * 7 + 13) % 4099
        }
        let finished = (try? extractor.finish(archive: path, expecting: info)) != nil
        if !finished {
            if let lost = extractor.notCopiedBack { fatalError("an abandoned extraction could not put back its bytes from \(lost)") }
            let taken = Int(min(extractor.position, UInt64(bytes.count)))
            guard let back = FileManager.default.contents(atPath: partial), back.count >= taken,
                back.prefix(taken).elementsEqual(bytes[0..<taken])
            else { fatalError("an abandoned extraction put back other bytes than it took (\(taken))") }
        }
        switch (extracted, finished) {
        case (nil, true): fatalError("streamed extraction installed an archive SafeExtractor refused: \(destination)")
        case (.some, false): fatalError("streamed extraction refused an archive SafeExtractor installed: \(String(describing: extractor.failure))")
        case (.some(let folder), true):
            // Compared here: Foundation's `Process` leaks under LeakSanitizer.
            func listing(_ root: String) -> [String: Data?] {
                var all: [String: Data?] = [:]
                for case let name as String in FileManager.default.enumerator(atPath: root) ?? FileManager.DirectoryEnumerator() {
                    var isFolder: ObjCBool = false
                    _ = FileManager.default.fileExists(atPath: root + "/" + name, isDirectory: &isFolder)
                    // A folder is there with no contents (`updateValue`: assigning nil would drop the key).
                    all.updateValue(isFolder.boolValue ? nil : FileManager.default.contents(atPath: root + "/" + name), forKey: name)
                }
                return all
            }
            if listing(folder) != listing(destination) { fatalError("streamed and extracted folders differ") }
        case (nil, false):
            if FileManager.default.fileExists(atPath: destination) { fatalError("a refused streamed extraction left its destination") }
        }
        if let leftover = (try? FileManager.default.contentsOfDirectory(atPath: scratch))?.first(where: { $0.contains(StreamingExtractor.marker) }) {
            fatalError("a streamed extraction left \(leftover)")
        }
    }

    /// Everything an accepted archive extracted must be a plain file or folder inside `folder`.
    static func checkConfined(_ folder: String) {
        guard let walker = FileManager.default.enumerator(atPath: folder) else { return }
        for case let name as String in walker {
            let path = "\(folder)/\(name)"
            var info = stat()
            guard lstat(path, &info) == 0 else { continue }
            let kind = info.st_mode & S_IFMT
            guard kind == S_IFREG || kind == S_IFDIR else { fatalError("extraction made '\(name)', neither a file nor a folder") }
            guard !name.split(separator: "/").contains("..") else { fatalError("extraction made '\(name)'") }
        }
    }

    static func manifest(_ bytes: UnsafeRawBufferPointer) {
        let data = Data(bytes)
        let fast = ManifestReader.read(bytes)
        if let fast {
            // The hand-written reader may refuse what JSONDecoder takes, never the reverse, and
            // never read it differently.
            guard let slow = try? JSONDecoder().decode(ArchiveManifest.self, from: data) else {
                fatalError("ManifestReader accepted a manifest JSONDecoder refuses")
            }
            guard slow == fast else { fatalError("ManifestReader and JSONDecoder read the manifest differently:\n\(fast)\n\(slow)") }
        }
        if let manifest = try? ArchiveManifest.decode(data, source: "fuzz") {
            // What decodes must also pass as a partial archive's layout or be refused cleanly.
            let path = "\(scratch)/partial.zip"
            guard FileManager.default.createFile(atPath: path, contents: Data()) else { fatalError("cannot write \(path)") }
            _ = try? ArchiveReader(path: path, manifest: manifest, limits: limits)
            _ = manifest.jsonData()
        }
    }

    /// The sandbox's roots (`IAP_FUZZ_ROOTS`, a store folder `iap-sandbox init` made), so that
    /// inputs near the seeds get past the chain into what follows it.
    static func sandboxRoot(_ name: String) -> [Certificate] {
        guard let folder = ProcessInfo.processInfo.environment["IAP_FUZZ_ROOTS"] else { return [] }
        guard let root = try? AppleRoots.load(path: "\(folder)/\(name)") else { fatalError("cannot read \(folder)/\(name)") }
        return [root]
    }

    static let receiptVerifier: ReceiptVerifier = {
        do {
            return try ReceiptVerifier(bundleId: "com.example.fuzz", trustRoots: sandboxRoot("receipt-root.cer"), environments: .productionAndSandbox)
        } catch {
            fatalError("cannot make a receipt verifier: \(error)")
        }
    }()

    static let jwsVerifier = SignedDataVerifier(
        configuration: VerifierConfiguration(
            bundleId: "com.example.fuzz", trustRoots: [AppleRoots.rootCAG3] + sandboxRoot("root.cer"), environments: .productionAndSandbox))

    static func receipt(_ bytes: UnsafeRawBufferPointer) {
        let array = [UInt8](bytes)
        // A mutated container rarely still verifies, so its payload is decoded here as well.
        if let container = try? SignedDataContainer(array) { _ = try? ReceiptPayload.decode(container.content[...]) }
        _ = try? ReceiptPayload.decode(array[...])
        _ = try? receiptVerifier.verify(array)
    }

    static func jws(_ bytes: UnsafeRawBufferPointer) {
        let text = String(decoding: bytes, as: UTF8.self)
        _ = try? CompactJWS(text, maxSize: SignedDataVerifier.maxTokenSize)
        _ = try? DuplicateMembers.check(bytes)
        // The whole verifier, on the thread libFuzzer runs inputs on.
        let done = DispatchSemaphore(value: 0)
        Task {
            _ = try? await jwsVerifier.verifyAny(text)
            done.signal()
        }
        done.wait()
    }

    static let headParser = RequestHeadParser(prefix: "/v1/content/")

    static func http(_ bytes: UnsafeRawBufferPointer) {
        let typed = bytes.bindMemory(to: UInt8.self)
        let parsed = headParser.parse(typed)
        if case .request(let head, let length) = parsed {
            guard length > 0, length <= bytes.count else { fatalError("head length \(length) outside the \(bytes.count) bytes read") }
            // The same bytes with the target already known must give the same head.
            guard headParser.parse(typed, knownURI: head.content.uri) == parsed else { fatalError("knownURI changed the parse") }
            let size = UInt64(bytes.count) * 977
            let decision = RangeEvaluator.evaluate(
                size: size, etag: "\"e\"", lastModified: "Thu, 01 Jan 1970 00:00:00 GMT", modifiedAt: 0,
                range: head.content.range, ifRange: head.content.ifRange, ifNoneMatch: head.content.ifNoneMatch,
                ifModifiedSince: head.content.ifModifiedSince, ifMatch: head.content.ifMatch, ifUnmodifiedSince: head.content.ifUnmodifiedSince)
            checkRanges(decision, size: size)
        }
        // Range values need not pass the head parser to be worth reading on their own.
        if let text = String(validating: typed, as: UTF8.self) {
            // Dates too: any text is a date or nil, never a crash.
            _ = HTTPDate.parse(text)
            for size in [0, 1, 4096, UInt64.max] as [UInt64] {
                checkRanges(RangeEvaluator.evaluate(size: size, etag: "\"e\"", lastModified: nil, range: text, ifRange: nil, ifNoneMatch: nil), size: size)
            }
        }
    }

    static func response(_ bytes: UnsafeRawBufferPointer) {
        // As the reader does: the head up to its blank line (or everything, if it has none).
        let end = DirectBodyReader.endOfHead(bytes)
        if let end {
            guard end >= 4, end <= bytes.count, bytes[end - 1] == 10, bytes[end - 2] == 13 else { fatalError("head end \(end) is not after a CRLF") }
        }
        guard let head = try? DirectBodyReader.parseHead(UnsafeRawBufferPointer(rebasing: bytes[0..<(end ?? bytes.count)])) else { return }
        guard (100..<600).contains(head.status.code) else { fatalError("accepted status \(head.status.code)") }
        let token = Set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ".utf8)
        for (name, value) in head.headers {
            guard !name.isEmpty, name.utf8.allSatisfy(token.contains) else { fatalError("accepted field name \(name.debugDescription)") }
            guard !value.utf8.contains(where: { $0 == 13 || $0 == 10 || $0 == 0 }) else { fatalError("accepted value \(value.debugDescription)") }
        }
        if let length = try? DirectBodyReader.contentLength(head.headers) {
            // Every Content-Length value must spell that same number.
            for value in head.headers["content-length"] {
                for part in value.split(separator: ",", omittingEmptySubsequences: false) {
                    guard Int64(part.trimmingCharacters(in: .whitespaces)) == length else { fatalError("length \(length) from \(value.debugDescription)") }
                }
            }
        }
    }

    /// Read, written and read again, each file must come back as it was written: what a reader
    /// takes from a damaged file is something the writer can write.
    static func state(_ bytes: UnsafeRawBufferPointer) {
        let archive = "\(scratch)/x.zip"
        let later = Date(timeIntervalSince1970: 9e9)
        func cycle(_ data: Data) -> [UInt8] {
            guard FileManager.default.createFile(atPath: HashCache.path(besideArchive: archive), contents: data) else { fatalError("cannot write the cache") }
            return HashCache.load(besideArchive: archive).encoded(now: later)
        }
        let once = cycle(Data(bytes))
        guard cycle(Data(once)) == once else { fatalError("the hash cache changed when read back") }

        if let installed = InstalledVersion.decode(Data(bytes)) {
            let written = installed.encoded()
            guard let again = InstalledVersion.decode(written), again.encoded() == written else {
                fatalError("the installed record changed when read back")
            }
        }
    }

    /// Ranges answered must lie inside the representation, sorted, apart, and at most the limit.
    static func checkRanges(_ decision: RangeDecision, size: UInt64) {
        guard case .partial(let ranges) = decision else { return }
        guard !ranges.isEmpty, ranges.count <= RangeEvaluator.defaultMaxRanges else { fatalError("\(ranges.count) ranges answered") }
        for (index, range) in ranges.enumerated() {
            guard range.last < size else { fatalError("range \(range) past a size of \(size)") }
            if index > 0, ranges[index - 1].last >= range.first { fatalError("ranges \(ranges) overlap or are out of order") }
        }
    }
}

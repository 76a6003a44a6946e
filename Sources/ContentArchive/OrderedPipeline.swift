import Crypto
import DurableFiles
import Foundation
import SystemPackage

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// The output of one chunk: its raw bytes unless they are no longer needed, and, when deflated,
/// the compressed bytes.
struct UnitResult: Sendable {
    /// Kept when stored, and for chunks of multi-chunk entries, whose CRC and SHA-256 run across
    /// chunks on the writer's thread.
    var raw: [UInt8]
    var compressed: [UInt8]?
    /// CRC-32 and SHA-256 of a whole single-chunk entry, computed by the worker: the writer then
    /// has little to do per small file, and the raw bytes of compressed ones need not wait in
    /// the window.
    var digest: (crc32: UInt32, sha256: String)?

    init(raw: [UInt8], compressed: [UInt8]?) {
        self.raw = raw
        self.compressed = compressed
    }

    var heldBytes: Int { raw.count + (compressed?.count ?? 0) }

    static func digest(of raw: [UInt8]) -> (crc32: UInt32, sha256: String) {
        raw.withUnsafeBytes { (crc32(0, $0), Hex.encode(SHA256.hash(data: $0))) }
    }
}

/// Compresses chunks on worker threads and hands the results back strictly in order, with at most
/// `windowBytes` of input in flight so memory stays flat whatever the content size.
///
/// Chunks of stored multi-chunk files are not the workers' business: the consumer reads them when
/// their turn comes. Holding them would fill the window with bytes nobody compresses, and the
/// workers could not get ahead to the compressible files behind them; this way they compress
/// those while the consumer copies and hashes the stored ones.
///
/// Threads rather than tasks: the work is blocking file reads and long CPU-bound C calls, which
/// would starve Swift's cooperative thread pool. The shared state is guarded by one condition lock.
final class OrderedPipeline: @unchecked Sendable {
    private let units: [Plan.Unit]
    private let entries: [Plan.Entry]
    private let level: Int
    private let threads: Int
    private let windowBytes: Int
    /// Input bytes claimed by workers and not yet consumed.
    private var inFlight = 0
    private let condition = NSCondition()
    private var next = 0
    private var consumed = 0
    private var results: [Int: Result<UnitResult, ArchiveError>] = [:]
    private var stopped = false
    private let group = DispatchGroup()

    init(units: [Plan.Unit], entries: [Plan.Entry], level: Int, threads: Int, windowBytes: Int) {
        self.units = units
        self.entries = entries
        self.level = level
        self.threads = threads
        self.windowBytes = windowBytes
    }

    func start() {
        for _ in 0..<threads {
            group.enter()
            let thread = Thread { [self] in
                work()
                group.leave()
            }
            thread.stackSize = 1 << 20
            thread.start()
        }
    }

    /// Stops the workers and waits for them to exit.
    func stop() {
        condition.lock()
        stopped = true
        condition.broadcast()
        condition.unlock()
        group.wait()
    }

    /// Whether the consumer reads this unit itself (a chunk of a stored multi-chunk file).
    private func readByConsumer(_ unit: Plan.Unit) -> Bool {
        let entry = entries[unit.entry]
        // Bytes copied from a previous archive need no worker either.
        if entry.isReused { return true }
        guard level > 0, entry.method == .stored, case .file = entry.source, unit.chunk > 0 || !unit.isLast else { return false }
        return true
    }

    /// Waits for the result of unit `index`; must be called for 0, 1, 2, ... in turn.
    func result(at index: Int) throws(ArchiveError) -> UnitResult {
        let unit = units[index]
        if readByConsumer(unit) {
            condition.lock()
            consumed = index + 1
            condition.broadcast()
            condition.unlock()
            switch entries[unit.entry].source {
            case .file(let path):
                return UnitResult(raw: try readChunk(path, unit: unit, entrySize: entries[unit.entry].size), compressed: nil)
            default:
                // Directories, and entries copied from a previous archive: the writer copies those
                // from file to file without reading them here.
                return UnitResult(raw: [], compressed: nil)
            }
        }
        condition.lock()
        while results[index] == nil { condition.wait() }
        let result = results.removeValue(forKey: index)!
        consumed = index + 1
        inFlight -= (try? result.get())?.heldBytes ?? 0
        condition.broadcast()
        condition.unlock()
        return try result.get()
    }

    /// At most this many units ahead of the consumer, whatever their size (thousands of tiny files).
    private let maxUnitsAhead = 4096

    private func work() {
        // One compressor per level this thread meets; entries may use different levels.
        var compressors: [Int: DeflateCompressor] = [:]
        while true {
            condition.lock()
            while !stopped && next < units.count && readByConsumer(units[next]) { next += 1 }
            while !stopped && next < units.count
                && (next - consumed >= maxUnitsAhead || (inFlight > 0 && inFlight + units[next].length > windowBytes))
            {
                condition.wait()
                while !stopped && next < units.count && readByConsumer(units[next]) { next += 1 }
            }
            if stopped || next >= units.count {
                condition.unlock()
                return
            }
            let index = next
            next += 1
            inFlight += units[index].length
            condition.unlock()

            let unit = units[index]
            let outcome: Result<UnitResult, ArchiveError>
            do {
                var result = try process(unit, compressors: &compressors)
                if unit.chunk == 0 && unit.isLast {
                    result.digest = UnitResult.digest(of: result.raw)
                    if result.compressed != nil { result.raw = [] }
                }
                outcome = .success(result)
            } catch {
                outcome = .failure(error)
            }
            let held = (try? outcome.get())?.heldBytes ?? 0
            condition.lock()
            inFlight += held - unit.length
            results[index] = outcome
            condition.broadcast()
            condition.unlock()
        }
    }

    private func process(_ unit: Plan.Unit, compressors: inout [Int: DeflateCompressor]) throws(ArchiveError) -> UnitResult {
        let entry = entries[unit.entry]
        let raw: [UInt8]
        switch entry.source {
        case .directory, .previous:
            return UnitResult(raw: [], compressed: nil)
        case .bytes(let bytes):
            raw = bytes
        case .file(let path):
            raw = try readChunk(path, unit: unit, entrySize: entry.size)
        }
        guard level > 0, entry.method != .stored, !raw.isEmpty else { return UnitResult(raw: raw, compressed: nil) }
        let compressor: DeflateCompressor
        if let existing = compressors[entry.level] {
            compressor = existing
        } else {
            compressor = DeflateCompressor(level: entry.level)
            compressors[entry.level] = compressor
        }
        switch entry.method {
        case .stored:
            return UnitResult(raw: raw, compressed: nil)
        case .deflate:
            // Every chunk of a deflated multi-chunk entry must be deflated, compressible or not.
            guard var compressed = raw.withUnsafeBytes({ compressor.compress($0, limit: .max) }) else {
                throw .io("internal error: libdeflate failed to compress a chunk of \(entry.path); please report this")
            }
            if !unit.isLast { try DeflateJoin.makeContinuable(&compressed) }
            return UnitResult(raw: raw, compressed: compressed)
        case .smaller:
            // Files of `Plan.sampledSize` or more were judged by the plan already.
            if raw.count > 2 * ArchivePacker.sampleSize, UInt64(raw.count) < Plan.sampledSize {
                let worthIt = raw.withUnsafeBytes { compressor.looksCompressible(UnsafeRawBufferPointer(rebasing: $0[0..<ArchivePacker.sampleSize])) }
                if !worthIt { return UnitResult(raw: raw, compressed: nil) }
            }
            let compressed = raw.withUnsafeBytes { compressor.compress($0, limit: raw.count) }
            return UnitResult(raw: raw, compressed: compressed)
        }
    }

    private func readChunk(_ path: String, unit: Plan.Unit, entrySize: UInt64) throws(ArchiveError) -> [UInt8] {
        let fd = try openFile(path)
        defer { try? fd.close() }
        let raw = try readFully(fd, at: unit.offset, count: unit.length, path: path)
        let grew = unit.isLast ? try !readFully(fd, at: entrySize, count: 1, path: path).isEmpty : false
        guard raw.count == unit.length, !grew else {
            throw .io("\(path) changed size while it was being packed: pack again when nothing is writing to the content folder")
        }
        return raw
    }
}

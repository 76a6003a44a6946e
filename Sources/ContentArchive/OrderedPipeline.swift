import Foundation
import SystemPackage
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The output of one chunk: its raw bytes (the writer hashes them) and, when deflated, the
/// compressed bytes.
struct UnitResult: Sendable {
    var raw: [UInt8]
    var compressed: [UInt8]?
}

/// Compresses chunks on worker threads and hands the results back strictly in order, with at most
/// `window` chunks in flight so memory stays flat (about `window` × 8 MiB) whatever the content size.
///
/// Threads rather than tasks: the work is blocking file reads and long CPU-bound C calls, which
/// would starve Swift's cooperative thread pool. The shared state is guarded by one condition lock.
final class OrderedPipeline: @unchecked Sendable {
    private let units: [Plan.Unit]
    private let entries: [Plan.Entry]
    private let level: Int
    private let threads: Int
    private let window: Int
    private let condition = NSCondition()
    private var next = 0
    private var consumed = 0
    private var results: [Int: Result<UnitResult, ArchiveError>] = [:]
    private var stopped = false
    private let group = DispatchGroup()

    init(units: [Plan.Unit], entries: [Plan.Entry], level: Int, threads: Int, window: Int) {
        self.units = units
        self.entries = entries
        self.level = level
        self.threads = threads
        self.window = window
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

    /// Waits for the result of unit `index`; must be called for 0, 1, 2, ... in turn.
    func result(at index: Int) throws(ArchiveError) -> UnitResult {
        condition.lock()
        while results[index] == nil { condition.wait() }
        let result = results.removeValue(forKey: index)!
        consumed = index + 1
        condition.broadcast()
        condition.unlock()
        return try result.get()
    }

    private func work() {
        let compressor = level > 0 ? DeflateCompressor(level: level) : nil
        while true {
            condition.lock()
            while !stopped && next < units.count && next - consumed >= window { condition.wait() }
            if stopped || next >= units.count {
                condition.unlock()
                return
            }
            let index = next
            next += 1
            condition.unlock()

            let outcome: Result<UnitResult, ArchiveError>
            do {
                outcome = .success(try process(units[index], compressor: compressor))
            } catch {
                outcome = .failure(error)
            }
            condition.lock()
            results[index] = outcome
            condition.broadcast()
            condition.unlock()
        }
    }

    private func process(_ unit: Plan.Unit, compressor: DeflateCompressor?) throws(ArchiveError) -> UnitResult {
        let entry = entries[unit.entry]
        let raw: [UInt8]
        switch entry.source {
        case .directory:
            return UnitResult(raw: [], compressed: nil)
        case .bytes(let bytes):
            raw = bytes
        case .file(let path):
            raw = try readChunk(path, unit: unit, entrySize: entry.size)
        }
        guard let compressor, !raw.isEmpty else { return UnitResult(raw: raw, compressed: nil) }
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
            if raw.count > 2 * ArchivePacker.sampleSize {
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

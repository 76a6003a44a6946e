import Foundation

/// The buffers every ``UnbufferedWriter`` of a process fills, within one budget: downloads that
/// run side by side (`iap-fetch run` starts three at once) share ``limit`` buffers, where each
/// writer holding four of its own took a restore of three 256 MiB archives from a 40 MiB peak to
/// 83 MiB. One download alone still gets all of them, as fast as before.
///
/// At most ``limit`` members (writers): a download beyond them writes through the page cache with
/// write-behind, which needs no buffers of its own, so the buffers stay ``limit`` however many
/// downloads run (`--parallel` goes up to 8). Each member is sure of one: a member holding some
/// gets another only while that leaves a buffer for every member holding none, and a member that
/// joins while the others hold every buffer gets the next one given back (within a piece's write
/// and hash: a member's reader holds at most the one it fills, the rest are on their way back).
/// A buffer goes back to the pool once its piece is hashed, and is filled again by whichever
/// member asks next: buffers are reused, not allocated per piece, since the first touch of fresh
/// memory is slow on some virtual machines (2.7 µs a page on this project's). Once no member is
/// left, the pool frees them, so a process that embeds the fetcher does not keep them between
/// downloads.
final class PieceBufferPool: @unchecked Sendable {
    /// The pool of the process's downloads.
    static let shared = PieceBufferPool(limit: 4)

    /// A member's registration, from ``join(whenFreed:)``.
    struct Member: Hashable, Sendable {
        fileprivate let id: Int
    }

    /// The most buffers held at once, and the most members.
    let limit: Int
    private let lock = NSLock()
    private var free: [UnsafeMutableRawBufferPointer] = []
    /// Buffers allocated: the free ones and those members hold.
    private var allocated = 0
    private var nextID = 0
    private var members: [Int: (held: Int, whenFreed: @Sendable () -> Void)] = [:]
    /// The most buffers members held at once (``highWater``).
    private var peak = 0

    init(limit: Int) {
        self.limit = limit
    }

    /// Registers a member; nil when ``limit`` members are in already. `whenFreed` runs (on the
    /// thread that gave a buffer back, with no lock held) each time a buffer comes back, so a
    /// member waiting for one asks again.
    func join(whenFreed: @escaping @Sendable () -> Void) -> Member? {
        lock.lock()
        defer { lock.unlock() }
        guard members.count < limit else { return nil }
        nextID += 1
        members[nextID] = (0, whenFreed)
        return Member(id: nextID)
    }

    /// Ends a membership, taking back what the member still holds; the others are told, since a
    /// member that held none no longer keeps a buffer from them either.
    func leave(_ member: Member, returning buffers: [UnsafeMutableRawBufferPointer]) {
        lock.lock()
        members[member.id] = nil
        free.append(contentsOf: buffers)
        trim()
        let listeners = members.values.map(\.whenFreed)
        lock.unlock()
        for listener in listeners { listener() }
    }

    /// A buffer of ``UnbufferedWriter/pieceSize`` bytes, aligned for unbuffered writes; nil when
    /// the budget is held, or the member holds one already and another would take the one a
    /// member holding none is sure of.
    func take(for member: Member) -> UnsafeMutableRawBufferPointer? {
        lock.lock()
        defer { lock.unlock() }
        guard let entry = members[member.id], allows(entry.held) else { return nil }
        members[member.id]?.held += 1
        peak = max(peak, allocated - free.count + 1)
        if let buffer = free.popLast() { return buffer }
        allocated += 1
        return UnsafeMutableRawBufferPointer.allocate(byteCount: UnbufferedWriter.pieceSize, alignment: UnbufferedWriter.alignment)
    }

    /// Whether ``take(for:)`` would give the member a buffer now.
    func wouldTake(for member: Member) -> Bool {
        lock.lock()
        defer { lock.unlock() }
        guard let entry = members[member.id] else { return false }
        return allows(entry.held)
    }

    /// Gives a buffer back; members waiting for one are told.
    func give(_ buffer: UnsafeMutableRawBufferPointer, from member: Member) {
        lock.lock()
        members[member.id]?.held -= 1
        free.append(buffer)
        trim()
        let listeners = members.values.map(\.whenFreed)
        lock.unlock()
        for listener in listeners { listener() }
    }

    /// The most buffers members held at once, for tests of the budget.
    var highWater: Int {
        lock.lock()
        defer { lock.unlock() }
        return peak
    }

    /// Buffers allocated now, free or held.
    var allocatedCount: Int {
        lock.lock()
        defer { lock.unlock() }
        return allocated
    }

    private func allows(_ held: Int) -> Bool {
        let inUse = allocated - free.count
        guard held > 0 else { return inUse < limit }
        let waitingForFirst = members.values.filter { $0.held == 0 }.count
        return inUse + waitingForFirst < limit
    }

    /// Frees every free buffer once no member is left, so none is kept between downloads.
    private func trim() {
        while !free.isEmpty && members.isEmpty {
            free.removeLast().deallocate()
            allocated -= 1
        }
    }
}

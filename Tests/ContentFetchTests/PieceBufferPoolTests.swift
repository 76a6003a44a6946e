import Foundation
import IAPTestSupport
import Synchronization
import SystemPackage
import Testing

@testable import ContentFetch

@Suite("PieceBufferPool: one budget of buffers for the downloads running side by side")
struct PieceBufferPoolTests {
    @Test("a member alone gets every buffer of the budget and no more; buffers are reused; all are freed when the last member leaves")
    func alone() throws {
        let pool = PieceBufferPool(limit: 4)
        let member = try #require(pool.join {})
        let taken = (0..<4).compactMap { _ in pool.take(for: member) }
        #expect(taken.count == 4)
        #expect(pool.take(for: member) == nil && !pool.wouldTake(for: member), "the budget is spent")
        #expect(taken.allSatisfy { Int(bitPattern: $0.baseAddress) % UnbufferedWriter.alignment == 0 && $0.count == UnbufferedWriter.pieceSize })
        pool.give(taken[0], from: member)
        let again = pool.take(for: member)
        #expect(again?.baseAddress == taken[0].baseAddress, "the buffer given back is the one taken next, not a new one")
        #expect(pool.allocatedCount == 4)
        pool.leave(member, returning: Array(taken[1...]) + [again].compactMap { $0 })
        #expect(pool.allocatedCount == 0)
    }

    @Test("each member is sure of one buffer: a member holding some takes another only while one is left for every member holding none")
    func shared() throws {
        let pool = PieceBufferPool(limit: 4)
        let freed = Mutex(0)
        let (a, b, c) = (try #require(pool.join { freed.withLock { $0 += 1 } }), try #require(pool.join {}), try #require(pool.join {}))
        let a1 = pool.take(for: a), a2 = pool.take(for: a)
        #expect(a1 != nil && a2 != nil)
        #expect(pool.take(for: a) == nil, "two buffers are left for b and c, which hold none")
        let b1 = pool.take(for: b), c1 = pool.take(for: c)
        #expect(b1 != nil && c1 != nil)
        #expect(pool.take(for: b) == nil && pool.take(for: c) == nil && pool.highWater == 4)
        pool.give(a2!, from: a)
        #expect(freed.withLock { $0 } == 1, "members are told a buffer came back")
        #expect(pool.take(for: c) != nil, "the buffer a gave back goes to whoever asks")
        #expect(pool.take(for: a) == nil)
        #expect(pool.highWater == 4)
    }

    @Test("a member that joins while another holds the whole budget gets the next buffer given back, before the other gets it again")
    func lateJoiner() throws {
        let pool = PieceBufferPool(limit: 4)
        let a = try #require(pool.join {})
        let taken = (0..<4).compactMap { _ in pool.take(for: a) }
        let b = try #require(pool.join {})
        #expect(pool.take(for: b) == nil && !pool.wouldTake(for: b), "the budget is held")
        pool.give(taken[0], from: a)
        #expect(pool.take(for: a) == nil, "kept for b, which holds none")
        #expect(pool.take(for: b) != nil && pool.highWater == 4)
    }

    @Test("a member that leaves holding none frees the buffer it was sure of for the others, and they are told")
    func leavingFreesItsShare() throws {
        let pool = PieceBufferPool(limit: 2)
        let told = Mutex(0)
        let a = try #require(pool.join { told.withLock { $0 += 1 } })
        let b = try #require(pool.join {})
        #expect(pool.take(for: a) != nil)
        #expect(pool.take(for: a) == nil, "the second is b's")
        pool.leave(b, returning: [])
        #expect(told.withLock { $0 } == 1)
        #expect(pool.take(for: a) != nil)
    }

    @Test("no more members than buffers: the one beyond them is refused (its download goes through the page cache), and taken again once one leaves")
    func full() throws {
        let pool = PieceBufferPool(limit: 2)
        let (a, b) = (try #require(pool.join {}), try #require(pool.join {}))
        #expect(pool.join {} == nil)
        let taken = try #require(pool.take(for: a))
        pool.leave(a, returning: [taken])
        #expect(pool.allocatedCount == 1, "kept while a member is left")
        #expect(pool.join {} != nil)
        _ = b
    }

    @Test("three writers filling at once on one pool of four: every piece written where it belongs, never more than four buffers held, none kept after")
    func writersShare() async throws {
        let tmp = try TemporaryFolder(onDisk: ())
        let pool = PieceBufferPool(limit: UnbufferedWriter.pieces)
        let size = 10 * UnbufferedWriter.pieceSize + 12_345
        let fills: [UInt8] = [0x11, 0x22, 0x33]
        try await withThrowingTaskGroup(of: Int.self) { group in
            for fill in fills {
                let path = tmp.sub("file-\(fill)")
                let fd = try FileDescriptor.open(path, .readWrite, options: [.create], permissions: .ownerReadWrite)
                group.addTask {
                    defer { try? fd.close() }
                    let handedOver = Mutex(0)
                    // Hashing stands in for the fetcher: each piece checked and given back as it comes.
                    guard
                        let writer = UnbufferedWriter(
                            path: path, plain: fd, pool: pool,
                            written: { piece in
                                if piece.bytes.allSatisfy({ $0 == fill }) { handedOver.withLock { $0 += piece.count } }
                                piece.release()
                            })
                    else { return -1 }
                    var position: Int64 = 0
                    while position < Int64(size), let (slot, buffer) = writer.acquire() {
                        let count = UnbufferedWriter.capacity(at: position, end: Int64(size))
                        UnsafeMutableRawBufferPointer(rebasing: buffer[0..<count]).initializeMemory(as: UInt8.self, repeating: fill)
                        writer.submit(slot: slot, offset: position, count: count)
                        position += Int64(count)
                    }
                    #expect(writer.finish() == nil)
                    return handedOver.withLock { $0 }
                }
            }
            for try await handedOver in group {
                try #require(handedOver != -1, "the file system here opens for direct I/O")
                #expect(handedOver == size, "every piece handed over with its own bytes")
            }
        }
        for fill in fills {
            let written = try Data(contentsOf: URL(fileURLWithPath: tmp.sub("file-\(fill)")))
            #expect(written.count == size && written.allSatisfy { $0 == fill })
        }
        #expect(pool.highWater <= UnbufferedWriter.pieces)
        // A writer leaves once its thread has let go of it, just after `finish` returned.
        await waitUntil(.seconds(20)) { pool.allocatedCount == 0 }
        #expect(pool.allocatedCount == 0, "the writers left, and with them the buffers")
    }

    @Test("a download closed part-way, its pieces dropped without being given back, returns every buffer to the pool")
    func closedPartWay() async throws {
        let tmp = try TemporaryFolder(onDisk: ())
        let pool = PieceBufferPool(limit: UnbufferedWriter.pieces)
        // Ten of twenty MiB, then silence: the reader waits on the socket with a buffer it fills.
        let body = [UInt8](repeating: 0x5a, count: 10 << 20)
        let server = try ScriptedServer(answer: Array("HTTP/1.1 200 OK\r\nContent-Length: \(20 << 20)\r\n\r\n".utf8) + body, stall: true)
        let file = tmp.sub("partial")
        do {
            let fd = try FileDescriptor.open(file, .readWrite, options: [.create], permissions: .ownerReadWrite)
            defer { try? fd.close() }
            let reader = DirectBodyReader(fd: fd, window: 1 << 20, limiter: nil, stallTimeout: .seconds(60), unbuffered: file, pool: pool)
            reader.start(url: server.url, headers: [])
            var kept: UnbufferedWriter.Piece?
            for try await event in reader.events {
                if case .head = event { reader.proceed(.write(from: 0, to: 20 << 20)) }
                if case .piece(let piece) = event {
                    // Held, never released: as when the fetcher gives up with pieces still queued.
                    kept = piece
                    break
                }
            }
            #expect(kept?.count == UnbufferedWriter.pieceSize)
            #expect(pool.allocatedCount >= 2, "the piece held and the one being filled")
            reader.close()
        }
        await waitUntil(.seconds(20)) { pool.allocatedCount == 0 }
        #expect(pool.allocatedCount == 0, "the writer left the pool with what it held")
    }
}

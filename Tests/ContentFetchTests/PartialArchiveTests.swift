import Foundation
import IAPProtocol
import IAPTestSupport
import SystemPackage
import Testing
import TransactionQueue

@testable import ContentFetch

/// The partial file's bookkeeping, on a real file and journal, without a network.
@Suite struct PartialArchiveTests {
    static let length: Int64 = 4 << 20

    /// A partial archive of `length` bytes with the first `written` already in its file.
    func partial(in tmp: TemporaryFolder, written: Int, recordGap: Duration) throws -> (PartialArchive, DownloadJournal) {
        let journal = try DownloadJournal(contentDirectory: tmp.sub("content"))
        var machine = DownloadStateMachine(transactionId: "1000", productId: "com.example.levels")
        let grant = GrantedDownload(
            productId: "com.example.levels", contentVersion: "1.0", contentLength: Self.length, sha256: String(repeating: "a", count: 64),
            url: "http://127.0.0.1:1/v1/content/t/x.zip", expiresAt: Date(timeIntervalSinceNow: 3600))
        _ = try machine.handle(.granted(grant))
        _ = try machine.handle(.accepted)
        let path = journal.partialPath(machine.id)
        try Data(repeating: 7, count: written).write(to: URL(fileURLWithPath: path))
        let fd = try FileDescriptor.open(path, .readWrite)
        let partial = try PartialArchive(
            fd: fd, path: path, journal: journal, download: machine, segments: [Segment(start: 0, end: Self.length, done: 0)],
            syncInterval: 1 << 20, recordGap: recordGap, durableInterval: .seconds(3600))
        return (partial, journal)
    }

    @Test("progress is recorded every journal interval of bytes, but not sooner than the least gap since the last record")
    func recordsAreSpacedInTime() throws {
        let tmp = try TemporaryFolder()
        let (spaced, journal) = try partial(in: tmp, written: 3 << 20, recordGap: .seconds(3600))
        defer { try? spaced.fd.close() }
        try spaced.wrote(2 << 20, segment: 0)
        #expect(try spaced.recordIfDue().recorded == false, "2 MiB arrived, but the gap since the last record has not passed")
        #expect((journal.load(spaced.record.id)?.recordedLength ?? 0) == 0)
        // A pause or stop records at once, whatever the gap.
        try spaced.recordProgress(durability: .processKill)
        #expect(journal.load(spaced.record.id)?.recordedLength == 2 << 20)

        let other = try TemporaryFolder()
        let (every, everyJournal) = try partial(in: other, written: 3 << 20, recordGap: .zero)
        defer { try? every.fd.close() }
        try every.wrote(512 << 10, segment: 0)
        #expect(try every.recordIfDue().recorded == false, "less than the journal interval arrived")
        try every.wrote(1 << 20, segment: 0)
        #expect(try every.recordIfDue().recorded == true)
        #expect(everyJournal.load(every.record.id)?.recordedLength == 3 << 19)
    }

    #if os(Linux)
        @Test("reserving space: the blocks are held and the size kept; a disk too small fails with the bytes and the fix, and keeps nothing reserved")
        func reservesSpace() throws {
            let tmp = try TemporaryFolder()
            let path = tmp.sub("partial")
            let fd = try FileDescriptor.open(path, .readWrite, options: [.create], permissions: .ownerReadWrite)
            defer { try? fd.close() }
            _ = try fd.writeAll(toAbsoluteOffset: 0, [UInt8](repeating: 7, count: 4096))
            try PartialArchive.reserve(fd, path: path, from: 4096, to: 8 << 20)
            var status = stat()
            #expect(fstat(fd.rawValue, &status) == 0)
            #expect(status.st_size == 4096, "the size is what was written: the journal's checks read it")
            #expect(Int64(status.st_blocks) * 512 >= 8 << 20)

            // tmpfs refuses a reservation past its size at once (a disk would first fill up).
            let shm = "/dev/shm/iap-tests-" + UUID().uuidString
            let small = try FileDescriptor.open(shm, .readWrite, options: [.create, .exclusiveCreate], permissions: .ownerReadWrite)
            defer {
                try? small.close()
                unlink(shm)
            }
            #expect {
                try PartialArchive.reserve(small, path: shm, from: 0, to: 1 << 50)
            } throws: { error in
                let message = "\(error)"
                return message.contains("cannot reserve \(Int64(1) << 50) bytes for \(shm)") && message.contains("free disk space and run again")
            }
            #expect(fstat(small.rawValue, &status) == 0)
            #expect(status.st_size == 0 && status.st_blocks == 0)
        }
    #endif
}

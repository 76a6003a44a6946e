import DurableFiles
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

@Suite final class DurableFilesTests {
    /// A folder of each test's own (Swift Testing makes an instance per test), removed after it.
    let folder: String = {
        let path = NSTemporaryDirectory() + "durable-\(UUID().uuidString)"
        try! FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
        return path
    }()

    deinit { try? FileManager.default.removeItem(atPath: folder) }

    func contents(_ path: String) -> String? {
        FileManager.default.contents(atPath: path).map { String(decoding: $0, as: UTF8.self) }
    }

    func leftovers() -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: folder)) ?? []).filter { $0.contains(".tmp-") }
    }

    @Test(arguments: [Durability.powerLoss, .processKill])
    func writeReplacesWholeWithTheAskedPermissions(durability: Durability) throws {
        let path = folder + "/state.json"
        try AtomicFile.write(Data("old".utf8), to: path, permissions: 0o640, durability: durability)
        try AtomicFile.write(Data("new contents".utf8), to: path, permissions: 0o640, durability: durability)
        #expect(contents(path) == "new contents")
        var info = stat()
        #expect(stat(path, &info) == 0 && info.st_mode & 0o777 == 0o640)
        #expect(leftovers().isEmpty)
    }

    @Test func largeWriteCopyCopiesEveryByteAndNeverOverwrites() throws {
        let source = folder + "/archive.zip", copy = folder + "/copy.zip"
        var generator = SystemRandomNumberGenerator()
        // Two whole chunks and a tail: every read but the last fills the buffer.
        let words = (0..<(2 * LargeWriteCopy.chunkSize + 4_099) / 8).map { _ in generator.next() as UInt64 }
        try words.withUnsafeBytes { try Data($0).write(to: URL(fileURLWithPath: source)) }
        try LargeWriteCopy.copy(from: source, to: copy, permissions: 0o640)
        #expect(FileManager.default.contentsEqual(atPath: source, andPath: copy))
        var info = stat()
        #expect(stat(copy, &info) == 0 && info.st_mode & 0o777 == 0o640)

        try Data("keep".utf8).write(to: URL(fileURLWithPath: folder + "/taken.zip"))
        let exists = #expect(throws: DurableFileError.self) { try LargeWriteCopy.copy(from: source, to: folder + "/taken.zip") }
        #expect(exists?.message.contains("taken.zip") == true)
        #expect(contents(folder + "/taken.zip") == "keep")
        let missing = #expect(throws: DurableFileError.self) { try LargeWriteCopy.copy(from: folder + "/none.zip", to: folder + "/other.zip") }
        #expect(missing?.message.contains("none.zip: it does not exist; check the path") == true)
        #expect(!FileManager.default.fileExists(atPath: folder + "/other.zip"))
    }

    @Test func aFailedWriteNamesTheFileAndLeavesTheOldOne() throws {
        let path = folder + "/missing-folder/state.json"
        let error = #expect(throws: DurableFileError.self) { try AtomicFile.write(Data("x".utf8), to: path) }
        #expect(error?.code == .io)
        #expect(error?.message.contains(path) == true && error?.message.contains("it does not exist; check the path") == true)
    }

    @Test func createRefusesAnExistingFileAndKeepsIt() throws {
        let path = folder + "/key.json"
        try AtomicFile.create(Data("first".utf8), at: path)
        let error = #expect(throws: DurableFileError.self) { try AtomicFile.create(Data("second".utf8), at: path) }
        #expect(error?.code == .exists)
        #expect(contents(path) == "first")
        #expect(leftovers().isEmpty)
    }

    #if os(Linux)
        /// What inotify reports for names in `folder` while `body` runs: (event mask, name).
        func folderEvents(_ body: () throws -> Void) throws -> [(mask: UInt32, name: String)] {
            let fd = inotify_init1(Int32(IN_NONBLOCK))
            try #require(fd >= 0)
            defer { close(fd) }
            try #require(inotify_add_watch(fd, folder, UInt32(IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO)) >= 0)
            try body()
            var events: [(mask: UInt32, name: String)] = []
            var buffer = [UInt8](repeating: 0, count: 1 << 16)
            while case let count = read(fd, &buffer, buffer.count), count > 0 {
                var at = 0
                while at + 16 <= count {
                    // struct inotify_event: wd, mask, cookie, len, then len bytes of NUL-padded name.
                    let mask = buffer.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: at + 4, as: UInt32.self) }
                    let length = Int(buffer.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: at + 12, as: UInt32.self) })
                    let name = buffer[(at + 16)..<(at + 16 + length)].prefix { $0 != 0 }
                    events.append((mask, String(decoding: name, as: UTF8.self)))
                    at += 16 + length
                }
            }
            return events
        }

        /// A process killed while writing must leave no partly written file under any name: the
        /// bytes go to a file with no name (`O_TMPFILE`), named only once complete. So no name
        /// that appears in the folder is ever written to after it appears.
        @Test func noNameInTheFolderEverHoldsAPartlyWrittenFile() throws {
            let bytes = Data(repeating: 0x5A, count: 4 << 20)
            let events = try folderEvents {
                try AtomicFile.create(bytes, at: folder + "/created.bin")
                try AtomicFile.write(bytes, to: folder + "/replaced.bin", durability: .processKill)
                try AtomicFile.write(bytes, to: folder + "/replaced.bin")
            }
            let appeared = Set(events.filter { $0.mask & UInt32(IN_CREATE | IN_MOVED_TO) != 0 }.map(\.name))
            #expect(appeared.contains("created.bin") && appeared.contains("replaced.bin"))
            let written = events.filter { $0.mask & UInt32(IN_MODIFY | IN_CLOSE_WRITE) != 0 && appeared.contains($0.name) }
            #expect(written.isEmpty, "written to under a name: \(written.map(\.name))")
            #expect(contents(folder + "/created.bin")?.utf8.count == bytes.count)
            #expect(FileManager.default.contents(atPath: folder + "/replaced.bin") == bytes)
            #expect(leftovers().isEmpty)
        }
    #endif

    @Test func secretFilesOthersMayReadAreNamed() throws {
        let path = folder + "/secret"
        #expect(FileManager.default.createFile(atPath: path, contents: Data("s".utf8)))
        for (mode, readers): (mode_t, String?) in [(0o600, nil), (0o400, nil), (0o640, "its group"), (0o604, "every user"), (0o644, "its group and every user")] {
            chmod(path, mode)
            let warning = SecretFile.exposure(path, holding: "a key")
            #expect(warning == readers.map { "\(path) holds a key and may be read by \($0) (mode \(String(mode, radix: 8))): chmod 600 \(path)" }, "\(mode)")
        }
        #expect(SecretFile.exposure(folder + "/missing", holding: "a key") == nil)
    }

    @Test func aHeldLockIsRefusedLoudlyAndFreedOnRelease() throws {
        let path = folder + "/.lock"
        let held = try FileLock(exclusive: path)
        // flock locks belong to open file descriptions: a second open in this process conflicts
        // as another process would.
        let error = #expect(throws: DurableFileError.self) { try FileLock(exclusive: path, wait: false) }
        #expect(error?.code == .locked && error?.message.contains(path) == true)
        held.release()
        // A child another test spawns at that moment holds a copy of the descriptor until its
        // exec closes it: the lock is free again within moments, not necessarily at once.
        var again: FileLock?
        let deadline = ContinuousClock.now + .seconds(10)
        while again == nil && ContinuousClock.now < deadline {
            again = try? FileLock(exclusive: path, wait: false)
            if again == nil { usleep(10_000) }
        }
        #expect(again != nil, "the lock was not freed on release")
        again?.release()
    }

    @Test("a claim whose file an interrupt handler removed before it was locked is not made again (iap-pack left an empty archive so)")
    func aRemovedClaimIsNotRecreatedByItsLock() throws {
        let path = folder + "/.x-1.0.zip.partial-1"
        let claim = UnfinishedFiles.Claim(path)
        defer { claim.release() }
        #expect(FileManager.default.createFile(atPath: path, contents: Data("bytes".utf8)))
        // The handler of Ctrl-C or SIGTERM (`UnfinishedFiles.removeAll`, not called here: it would
        // remove the claims of tests running beside this one) runs on another thread, and can
        // remove the file between its creation and its lock.
        #expect(unlink(path) == 0)
        claim.lock()
        #expect(!FileManager.default.fileExists(atPath: path))
        // A file that is there is locked: a sweep leaves it alone.
        let live = folder + "/.y-1.0.zip.partial-1"
        let other = UnfinishedFiles.Claim(live)
        defer { other.release() }
        #expect(FileManager.default.createFile(atPath: live, contents: nil))
        other.lock()
        #expect(throws: DurableFileError.self) { try FileLock(existing: live, wait: false) }
        #expect(throws: DurableFileError.self) { try FileLock(existing: folder + "/missing", wait: false) }
    }

    @Test("a sweep removes a folder a dead writer left, with all it holds, and leaves a live writer's locked folder")
    func sweepsLeftoverFolders() throws {
        let dead = folder + "/.1.0.streaming-1-1"
        try FileManager.default.createDirectory(atPath: dead + "/Contents/levels", withIntermediateDirectories: true)
        #expect(FileManager.default.createFile(atPath: dead + "/Contents/levels/a.bin", contents: Data(count: 1 << 16)))
        let live = folder + "/.1.0.streaming-2-2"
        let claim = UnfinishedFiles.Claim(live)
        defer { claim.release() }
        try FileManager.default.createDirectory(atPath: live + "/Contents", withIntermediateDirectories: true)
        claim.lock()
        #expect(FileManager.default.createFile(atPath: folder + "/.1.0.other", contents: nil))
        let removed = UnfinishedFiles.removeLeftovers(in: folder, minimumAge: 0) { $0.contains(".streaming-") }
        #expect(removed == [dead])
        #expect(!FileManager.default.fileExists(atPath: dead))
        #expect(FileManager.default.fileExists(atPath: live + "/Contents"))
        #expect(FileManager.default.fileExists(atPath: folder + "/.1.0.other"), "a name the sweep does not match stays")
    }

    @Test func aLockInAFolderThatCannotHoldItIsAnError() {
        let error = #expect(throws: DurableFileError.self) { try FileLock(exclusive: folder + "/no/such/folder/.lock") }
        #expect(error?.code == .io)
    }

    @Test func directoriesAreMadeWithTheirParentsAndAFileInTheWayIsNamed() throws {
        try Directory.create(folder + "/a/b/c")
        try Directory.create(folder + "/a/b/c")
        try Directory.sync(folder + "/a/b")
        #expect(FileManager.default.createFile(atPath: folder + "/file", contents: Data()))
        let error = #expect(throws: DurableFileError.self) { try Directory.create(folder + "/file") }
        #expect(error?.message.contains("is not a folder") == true)
    }

    @Test func hexIsLowercaseTwoDigitsPerByte() {
        #expect(Hex.encode([0x00, 0x0f, 0xa0, 0xff]) == "000fa0ff")
        #expect(Hex.encode([UInt8]()) == "")
    }
}

import Foundation
import IAPTestSupport
import Testing
import TransactionQueue

@testable import ContentFetch

@Suite("Download queue: pause, resume, cancel and parallel ranges", .serialized, .onTestThreads)
struct QueueControlTests {
    func fetcher(_ shop: Shop, connections: Int = 1, rate: Int?) throws -> ContentFetcher {
        var configuration = FetchConfiguration(server: shop.server.base, contentDirectory: shop.content)
        configuration.connections = connections
        configuration.minimumSegment = 4 << 20
        configuration.rateLimit = rate
        return try ContentFetcher(configuration: configuration, source: try FileTransactionQueue(folder: shop.queue))
    }

    /// Collects every update; calls `act` once for the first update that matches `when`.
    func observe(
        _ fetcher: ContentFetcher, when: @escaping @Sendable (DownloadUpdate) -> Bool,
        act: @escaping @Sendable (DownloadUpdate) async -> Void
    ) -> Task<[DownloadUpdate], Never> {
        Task {
            var seen: [DownloadUpdate] = []
            var acted = false
            for await update in fetcher.updates {
                seen.append(update)
                if !acted, when(update) {
                    acted = true
                    await act(update)
                }
            }
            return seen
        }
    }

    @Test(
        "pause(id) over 4 connections saves every segment while the queue goes on; resume(id) continues from disk to identical bytes, reported by the next start()"
    )
    func pauseAndResume() async throws {
        let shop = try Shop(products: ["com.example.big": .random(32 << 20), "com.example.small": .random(64 << 10)])
        let big = try shop.store.purchase(productId: "com.example.big").transaction.transactionId!
        let small = try shop.store.purchase(productId: "com.example.small").transaction.transactionId!
        let bigId = "\(big)-com.example.big"
        let fetcher = try fetcher(shop, connections: 4, rate: 8 << 20)
        // Paused as soon as it is active: the rate limit (applied to the socket) keeps it from
        // finishing first even when the test process is busy with other suites.
        let observer = observe(
            fetcher, when: { $0.id == bigId && $0.state == .active },
            act: {
                #expect(await fetcher.pause($0.id))
            })
        let first = await fetcher.start()
        #expect(first.paused == [bigId])
        #expect(first.finished == [small], "the queue goes on past a paused download")
        let queue = try FileTransactionQueue(folder: shop.queue)
        #expect(try queue.transaction(big)?.finishedAt == nil)
        let journal = try DownloadJournal(contentDirectory: shop.content)
        let paused = try #require(journal.load(bigId))
        #expect(paused.state == .paused)
        let segments = try #require(paused.segments)
        #expect(segments.count == 4, "four ranges planned and recorded: \(segments)")
        #expect(paused.recordedLength < paused.expectedLength)

        #expect(await fetcher.resume(bigId))
        #expect(!(await fetcher.resume(bigId)), "resuming twice does nothing")
        // The resumed download goes on by itself; the next start() comes after it ended and
        // still reports it.
        await fetcher.idle()
        let second = await fetcher.start()
        #expect(second.finished == [big], "a download that ended between two runs is in the next run's summary")
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        let finished = try #require(try queue.transaction(big)?.finishedAt)
        let installedAt = try #require(journal.load(bigId)?.installedAt)
        #expect(finished >= installedAt.addingTimeInterval(-0.001))
        await fetcher.shutdown()
        let updates = await observer.value.filter { $0.id == bigId }
        let pausedAt = try #require(updates.firstIndex { $0.state == .paused })
        let resumed = try #require(updates[pausedAt...].first { $0.state == .active })
        #expect(resumed.bytesReceived >= paused.recordedLength, "resumed from the bytes on disk, not from zero")
        #expect(updates.last?.state == .finished)
        #expect(!FileManager.default.fileExists(atPath: journal.partialPath(bigId)))
    }

    @Test(
        "downloads run side by side up to parallelDownloads, never two of one product; every one installed, then finished",
        arguments: [1, 3])
    func parallelDownloads(parallel: Int) async throws {
        let products = ["com.example.a", "com.example.b", "com.example.c"]
        var (shop, transactions) = try Shop.everyOneBought(products, size: 2 << 20)
        // A second purchase of the first product: the queue must not run it beside the first.
        transactions.append(try shop.store.purchase(productId: "com.example.a").transaction.transactionId!)
        var configuration = FetchConfiguration(server: shop.server.base, contentDirectory: shop.content)
        configuration.parallelDownloads = parallel
        // The cap, shared by every download, keeps each one active long after the others start.
        configuration.rateLimit = 4 << 20
        let fetcher = try ContentFetcher(configuration: configuration, source: try FileTransactionQueue(folder: shop.queue))
        let observer = Task {
            var active: [String: String] = [:]
            var most = 0
            var sameProduct = false
            for await update in fetcher.updates {
                if update.state == .active { active[update.id] = update.productId } else { active[update.id] = nil }
                most = max(most, active.count)
                sameProduct = sameProduct || Set(active.values).count < active.count
            }
            return (most, sameProduct)
        }
        let summary = await fetcher.start()
        await fetcher.shutdown()
        let (most, sameProduct) = await observer.value
        #expect(Set(summary.finished) == Set(transactions), "\(summary.failed.map(\.error.message))")
        if parallel == 1 { #expect(most == 1) } else { #expect(most >= 2, "downloads at once: \(most)") }
        #expect(!sameProduct, "two downloads of one product were active at once")
        for product in products { #expect(shop.installed(product) == shop.payloads[product]) }
        let queue = try FileTransactionQueue(folder: shop.queue)
        for transaction in transactions { #expect(try queue.transaction(transaction)?.finishedAt != nil) }
    }

    /// Mounts a tmpfs of `megabytes` MiB at `folder`, made if missing (as root: unmount it with `/bin/umount`).
    func mountTmpfs(_ folder: String, megabytes: Int) throws {
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        let mounted = try run("/bin/mount", ["-t", "tmpfs", "-o", "size=\(megabytes)m", "tmpfs", folder])
        try #require(mounted.status == 0, "this test mounts a \(megabytes) MiB tmpfs (as root): \(mounted.stderr)")
    }

    /// A tmpfs of `megabytes` MiB in the shop's folder (mounted as root: unmount it with
    /// `/bin/umount`), and a fetcher that runs three downloads at once into it at `rate` bytes a
    /// second in all.
    func smallDiskFetcher(_ shop: Shop, megabytes: Int, rate: Int) throws -> (fetcher: ContentFetcher, disk: String) {
        let disk = shop.tmp.sub("small-disk")
        try mountTmpfs(disk, megabytes: megabytes)
        var configuration = FetchConfiguration(server: shop.server.base, contentDirectory: disk)
        configuration.parallelDownloads = 3
        configuration.rateLimit = rate
        do {
            return (try ContentFetcher(configuration: configuration, source: try FileTransactionQueue(folder: shop.queue)), disk)
        } catch {
            _ = try? run("/bin/umount", [disk])
            throw error
        }
    }

    @Test(
        "on a small disk, a download that would fit alone but not beside those running waits for them, then runs; one that cannot fit is refused with what it needs"
    )
    func diskSpaceSharedByParallelDownloads() async throws {
        let (shop, _) = try Shop.everyOneBought(["com.example.a", "com.example.b", "com.example.c"], size: 5 << 20)
        // 16 MiB: each download needs about 10 (the archive, then its files beside it).
        let (fetcher, disk) = try smallDiskFetcher(shop, megabytes: 16, rate: 8 << 20)
        defer { _ = try? run("/bin/umount", [disk]) }
        let observer = Task {
            var active = Set<String>()
            var most = 0
            for await update in fetcher.updates {
                if update.state == .active { active.insert(update.id) } else { active.remove(update.id) }
                most = max(most, active.count)
            }
            return most
        }
        let summary = await fetcher.start()
        await fetcher.shutdown()
        #expect(await observer.value == 1, "two downloads that do not fit beside each other ran at once")
        #expect(summary.finished.count == 2, "\(summary.failed.map(\.error.message))")
        let refusals = summary.failed.map(\.error)
        #expect(refusals.count == 1)
        #expect(refusals.first?.code == .install)
        #expect(refusals.first?.message.contains("bytes free in \(disk)") == true, "\(refusals.map(\.message))")
        #expect(InstalledContent.all(in: disk).count == 2)
    }

    @Test("a paused download resumes on a disk that holds its archive and the installed copy: the archive's reserved blocks are not counted twice")
    func resumeOnSmallDisk() async throws {
        let (shop, transactions) = try Shop.everyOneBought(["com.example.a"], size: 12 << 20)
        let id = "\(transactions[0])-com.example.a"
        // 28 MiB: the 12 MiB archive, then its files beside it. Paused at 4 MiB, the archive's
        // blocks are all taken already: what is left needs the installed copy's 12, not 8 more.
        let (fetcher, disk) = try smallDiskFetcher(shop, megabytes: 28, rate: 4 << 20)
        defer { _ = try? run("/bin/umount", [disk]) }
        let observer = observe(
            fetcher, when: { $0.id == id && $0.state == .active && $0.bytesReceived >= 4 << 20 },
            act: {
                #expect(await fetcher.pause($0.id))
            })
        let first = await fetcher.start()
        #expect(first.paused == [id])
        #expect(await fetcher.resume(id))
        await fetcher.idle()
        let second = await fetcher.start()
        await fetcher.shutdown()
        let seen = await observer.value.filter { $0.id == id }
        #expect(second.finished == [transactions[0]], "\(second.failed.map(\.error.message)) \(seen.compactMap(\.error?.message))")
        #expect(InstalledContent.all(in: disk).count == 1)
    }

    @Test(
        "on a disk that holds a large stored file once but not twice, one connection installs it (the archive reserves no blocks for the bytes the extraction writes); given up half-way, it fails for space keeping what it fetched, and a larger disk then installs it without fetching it again"
    )
    func leanDownloadOnSmallDisk() throws {
        let (shop, transactions) = try Shop.everyOneBought(["com.example.big"], size: 24 << 20)
        let disk = shop.content
        // 36 MiB: the archive (24 MiB, one stored file) and its installed copy do not fit together.
        try mountTmpfs(disk, megabytes: 36)
        defer { _ = try? run("/bin/umount", [disk]) }
        // Under a rate limit every byte goes to the archive: refused before anything is fetched,
        // with what it needs.
        let limited = try shop.fetch(["--limit-rate", "64M"])
        #expect(limited.status == 1)
        #expect(limited.stdout.contains("bytes free in \(disk)"), "\(limited.stdout.suffix(800)) \(limited.stderr)")
        #expect(!limited.stdout.contains("written once"), "\(limited.stdout.suffix(800))")

        // One connection: the stored file's bytes are written once, into the install.
        let (bigger, _) = try Shop.everyOneBought(["com.example.big"], size: 24 << 20)
        let lean = bigger.content
        try mountTmpfs(lean, megabytes: 36)
        defer { _ = try? run("/bin/umount", [lean]) }
        let installed = try bigger.fetch()
        #expect(installed.status == 0, "\(installed.stdout.suffix(800)) \(installed.stderr)")
        #expect(bigger.installed("com.example.big") == bigger.payloads["com.example.big"])

        // Given up half-way, the archive needs the blocks it did not reserve: the extraction's
        // bytes go back into it, the rest arrives there, and the install after the download finds
        // no room for the copy. Nothing is installed, and nothing fetched is lost.
        let givenUp = try shop.fetch([], prefix: ["export IAP_FETCH_REFUSE=extraction"])
        #expect(givenUp.status == 1)
        #expect(givenUp.stdout.contains("free disk space"), "\(givenUp.stdout.suffix(800)) \(givenUp.stderr)")
        #expect(shop.installed("com.example.big") == nil)
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(transactions[0])?.finishedAt == nil)
        let remounted = try run("/bin/mount", ["-o", "remount,size=64m", disk])
        try #require(remounted.status == 0, "\(remounted.stderr)")
        let resumed = try shop.fetch()
        #expect(resumed.status == 0, "\(resumed.stdout.suffix(800)) \(resumed.stderr)")
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(transactions[0])?.finishedAt != nil)
        // The verified archive was kept: nothing is fetched again.
        let received = resumed.stdout.split(separator: "\n").compactMap {
            (try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any])?["bytesReceived"] as? Int
        }
        #expect(received.allSatisfy { $0 == 0 || $0 >= 24 << 20 }, "\(received)")
    }

    @Test("a download waiting for space beside the running ones is paused at once when asked, not once space frees up")
    func pauseWhileWaitingForSpace() async throws {
        let products = ["com.example.a", "com.example.b", "com.example.c"]
        let (shop, transactions) = try Shop.everyOneBought(products, size: 5 << 20)
        // 24 MiB: each download needs about 10 (the archive, then its files beside it), so two run
        // and the third waits for one of them to end. 10 MiB to fetch at 1 MiB/s in all: the two
        // running take seconds to end.
        let (fetcher, disk) = try smallDiskFetcher(shop, megabytes: 24, rate: 1 << 20)
        defer { _ = try? run("/bin/umount", [disk]) }
        let ids = zip(transactions, products).map { "\($0)-\($1)" }
        // Paused once it has said it waits for space (a pause that came sooner would stop it
        // before it looked at the disk).
        let observer = observe(
            fetcher, when: { $0.state == .waiting && $0.error != nil },
            act: {
                #expect(await fetcher.pause($0.id))
            })
        let summary = await fetcher.start()
        await fetcher.shutdown()
        let seen = await observer.value
        let active = Set(seen.filter { $0.state == .active }.map(\.id))
        #expect(active.count == 2)
        let waiting = try #require(Set(ids).subtracting(active).first)
        #expect(summary.paused == [waiting])
        #expect(summary.finished.count == 2)
        let paused = try #require(seen.firstIndex { $0.id == waiting && $0.state == .paused }, "no paused update for \(waiting)")
        let firstEnd = try #require(seen.firstIndex { $0.state == .finished })
        #expect(paused < firstEnd, "the waiting download was paused only once another one ended")
        #expect(!seen.contains { $0.id == waiting && $0.state == .active })
        let told = seen.first { $0.id == waiting && $0.state == .waiting && $0.error != nil }
        #expect(told?.error?.message.contains("the running downloads still need") == true, "the waiting download did not say why: \(told.map(String.init(describing:)) ?? "no update")")
    }

    @Test("after a reboot (another boot id in the journal) a transfer continues from the last fsynced bytes, not the 1 MiB mark")
    func resumeAfterPowerCut() async throws {
        let shop = try Shop(products: ["com.example.big": .random(24 << 20)])
        let big = try shop.store.purchase(productId: "com.example.big").transaction.transactionId!
        let id = "\(big)-com.example.big"
        // Slow enough that the pause at 3 MiB lands with 20 s to spare even when the other
        // suites running beside this one (servers, PostgreSQL, nginx) keep the shared threads
        // busy; the rebooted device then resumes at full speed.
        let first = try fetcher(shop, rate: 1 << 20)
        let observer = observe(
            first, when: { $0.id == id && $0.state == .active && $0.bytesReceived >= 3 << 20 },
            act: {
                #expect(await first.pause($0.id))
            })
        #expect(await first.start().paused == [id])
        await first.shutdown()
        _ = await observer.value
        let journal = try DownloadJournal(contentDirectory: shop.content)
        var record = try #require(journal.load(id))
        #expect(record.recordedLength >= 3 << 20)
        #expect(
            record.durable == [Segment(start: 0, end: record.expectedLength, done: record.recordedLength)],
            "a pause fsyncs what it keeps")

        // A power cut after only 2 MiB had been fsynced: the pages past them are lost (zeros
        // here), and the journal names the boot that wrote them.
        let synced: Int64 = 2 << 20
        record.durable = [Segment(start: 0, end: record.expectedLength, done: synced)]
        record.bootId = "an-earlier-boot"
        try journal.save(record)
        let handle = try #require(FileHandle(forWritingAtPath: journal.partialPath(id)))
        try handle.seek(toOffset: UInt64(synced))
        try handle.write(contentsOf: Data(count: Int(record.recordedLength - synced)))
        try handle.close()

        let rebooted = try fetcher(shop, rate: nil)
        let afterReboot = observe(rebooted, when: { _ in false }, act: { _ in })
        // A new process resumes what an earlier one left paused.
        #expect(await rebooted.start().finished == [big])
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        await rebooted.shutdown()
        let updates = await afterReboot.value.filter { $0.id == id }
        let resumed = try #require(updates.first { $0.state == .active })
        #expect(resumed.bytesReceived == synced, "continued from the fsynced mark, not from \(record.recordedLength)")
        #expect(!updates.contains { $0.state == .failed }, "no hash mismatch: the lost bytes were fetched again, not trusted")
    }

    @Test("cancel(id) deletes the partial file and leaves the transaction unfinished; the next start downloads it again")
    func cancelRunning() async throws {
        let shop = try Shop(products: ["com.example.big": .random(12 << 20)])
        let big = try shop.store.purchase(productId: "com.example.big").transaction.transactionId!
        let id = "\(big)-com.example.big"
        let fetcher = try fetcher(shop, rate: 4 << 20)
        let observer = observe(
            fetcher, when: { $0.state == .active },
            act: {
                #expect(await fetcher.cancel($0.id))
            })
        let first = await fetcher.start()
        #expect(first.cancelled == [id])
        #expect(first.finished.isEmpty)
        let journal = try DownloadJournal(contentDirectory: shop.content)
        #expect(journal.load(id)?.state == .cancelled)
        #expect(journal.load(id)?.recordedLength == 0)
        #expect(!FileManager.default.fileExists(atPath: journal.partialPath(id)))
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(big)?.finishedAt == nil)
        #expect(!(await fetcher.cancel("no-such-download")))

        let second = await fetcher.start()
        #expect(second.finished == [big])
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        await fetcher.shutdown()
        let updates = await observer.value
        let cancelledAt = try #require(updates.firstIndex { $0.state == .cancelled })
        #expect(updates[cancelledAt...].first { $0.state == .active }?.bytesReceived == 0, "a cancelled download starts over")
    }

    /// A 48 MiB product bought and downloaded by `iap-fetch --connections 3` until 12 MiB were
    /// recorded, then killed with SIGKILL.
    func killedParallelDownload() throws -> (shop: Shop, transactionId: String, id: String, journal: DownloadJournal) {
        try killedDownload(size: 48 << 20, arguments: ["--connections", "3", "--limit-rate", "12M"], recorded: 12 << 20)
    }

    /// A product of `size` bytes bought and its download killed once the journal records `recorded` bytes.
    func killedDownload(size: Int, arguments: [String], recorded: Int64) throws -> (shop: Shop, transactionId: String, id: String, journal: DownloadJournal) {
        let shop = try Shop(products: ["com.example.big": .random(size)])
        let big = try shop.store.purchase(productId: "com.example.big").transaction.transactionId!
        let id = "\(big)-com.example.big"
        let journal = try DownloadJournal(contentDirectory: shop.content)
        let (client, _) = try shop.startClient(arguments)
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline, (journal.load(id)?.recordedLength ?? 0) < recorded { usleep(2_000) }
        kill(client.processIdentifier, SIGKILL)
        client.waitUntilExit()
        return (shop, big, id, journal)
    }

    @Test("iap-fetch --connections 3 killed mid-way resumes every range from its journal, even on one connection")
    func parallelRangesSurviveKill() throws {
        let (shop, big, id, journal) = try killedParallelDownload()
        let killed = try #require(journal.load(id))
        let segments = try #require(killed.segments)
        #expect(segments.count == 3)
        #expect(segments.allSatisfy { $0.done > 0 }, "all three ranges were in flight: \(segments)")
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(big)?.finishedAt == nil)

        let again = try run(
            productsDirectory() + "/iap-fetch",
            [
                "run", "--server", shop.server.base, "--queue", shop.queue,
                "--content-dir", shop.content, "--json",
            ])
        #expect(again.status == 0, "\(again.stderr)")
        let firstActive = again.stdout.split(separator: "\n").compactMap { try? JSONDecoder().decode(DownloadUpdate.self, from: Data($0.utf8)) }
            .first { $0.state == .active }
        #expect((firstActive?.bytesReceived ?? 0) >= killed.recordedLength)
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(big)?.finishedAt != nil)
    }

    @Test("a partial file shorter than its journal's ranges (truncated while no iap-fetch ran) is fetched again, not read past its end")
    func truncatedPartialFile() throws {
        let (shop, big, id, journal) = try killedParallelDownload()
        let segments = try #require(journal.load(id)?.segments)
        #expect(segments.count == 3 && segments[1].done > 0)
        // Shorter than the first range's bytes, and far short of the later ranges.
        #expect(truncate(journal.partialPath(id), 1 << 20) == 0)

        let again = try run(
            productsDirectory() + "/iap-fetch",
            ["run", "--server", shop.server.base, "--queue", shop.queue, "--content-dir", shop.content, "--connections", "3"])
        #expect(again.status == 0, "\(again.stderr)")
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(big)?.finishedAt != nil)
    }

    @Test("a one-connection partial file shorter than its journal's mark is fetched again from the start, not filled with zeros up to the mark and found wrong at the end")
    func truncatedSingleRangePartialFile() throws {
        let (shop, big, id, journal) = try killedDownload(size: 16 << 20, arguments: ["--limit-rate", "8M"], recorded: 4 << 20)
        let killed = try #require(journal.load(id))
        #expect(killed.segments == nil && killed.recordedLength >= 4 << 20)
        #expect(truncate(journal.partialPath(id), 1 << 20) == 0)

        let again = try run(
            productsDirectory() + "/iap-fetch",
            ["run", "--server", shop.server.base, "--queue", shop.queue, "--content-dir", shop.content, "--json"])
        #expect(again.status == 0, "\(again.stderr)")
        let updates = again.stdout.split(separator: "\n").compactMap { try? JSONDecoder().decode(DownloadUpdate.self, from: Data($0.utf8)) }
        #expect(!updates.contains { $0.error?.code == .integrity }, "the short file was taken for the journal's bytes: \(updates.compactMap(\.error))")
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(big)?.finishedAt != nil)
    }

    @Test("iap-fetch cancel while another process downloads: that process stops, deletes the partial file, exits 1")
    func cancelAcrossProcesses() throws {
        let shop = try Shop(products: ["com.example.big": .random(12 << 20)])
        let big = try shop.store.purchase(productId: "com.example.big").transaction.transactionId!
        let id = "\(big)-com.example.big"
        let journal = try DownloadJournal(contentDirectory: shop.content)
        let (client, errors) = try shop.startClient(["--limit-rate", "4M"])
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline, (journal.load(id)?.recordedLength ?? 0) < 2 << 20 { usleep(2_000) }
        let cancel = try run(productsDirectory() + "/iap-fetch", ["cancel", id, "--content-dir", shop.content])
        #expect(cancel.status == 0, "\(cancel.stderr)")
        #expect(cancel.stdout.contains("asked the running iap-fetch"))
        client.waitUntilExit()
        #expect(client.terminationStatus == 1)
        let stderr = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        #expect(stderr.contains("cancelled"), "\(stderr)")
        #expect(journal.load(id)?.state == .cancelled)
        #expect(!FileManager.default.fileExists(atPath: journal.partialPath(id)))
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(big)?.finishedAt == nil)
        // With no process running it, cancel applies at once.
        let idle = try run(productsDirectory() + "/iap-fetch", ["cancel", id, "--content-dir", shop.content])
        #expect(idle.stdout.contains("cancelled \(id)"))
    }

    @Test("a second iap-fetch on the same content folder is refused and leaves the running download alone")
    func secondProcessRefused() throws {
        let shop = try Shop(products: ["com.example.big": .random(12 << 20)])
        let big = try shop.store.purchase(productId: "com.example.big").transaction.transactionId!
        let journal = try DownloadJournal(contentDirectory: shop.content)
        let (client, _) = try shop.startClient(["--limit-rate", "4M"])
        let deadline = Date().addingTimeInterval(60)
        while client.isRunning, Date() < deadline, (journal.load("\(big)-com.example.big")?.recordedLength ?? 0) < 1 << 20 { usleep(2_000) }
        let second = try run(productsDirectory() + "/iap-fetch", ["run", "--server", shop.server.base, "--queue", shop.queue, "--content-dir", shop.content])
        #expect(second.status == 1)
        #expect(second.stderr.contains("another iap-fetch is downloading"), "\(second.stderr)")
        client.waitUntilExit()
        #expect(client.terminationStatus == 0)
        #expect(shop.installed("com.example.big") == shop.payloads["com.example.big"])
        #expect(try FileTransactionQueue(folder: shop.queue).transaction(big)?.finishedAt != nil)
    }
}

import Foundation
import IAPTestSupport
import Testing

@testable import ContentArchive

@Suite("Bad input to iap-pack", .onTestThreads)
struct BadInputTests {
    /// Runs `iap-pack build` and checks it failed with `status`, said `message`, and wrote nothing.
    func expectRefusal(
        _ arguments: [String], status: Int32, message: String, output: String,
        sourceLocation: SourceLocation = #_sourceLocation
    ) throws {
        let result = try iapPack(["build"] + arguments + ["-o", output])
        #expect(result.status == status, "exit \(result.status): \(result.stderr)", sourceLocation: sourceLocation)
        #expect(result.stderr.contains(message), "stderr: \(result.stderr)", sourceLocation: sourceLocation)
        #expect(!result.stderr.contains("Fatal error"), sourceLocation: sourceLocation)
        let left = ((try? FileManager.default.contentsOfDirectory(atPath: output)) ?? [])
        #expect(left.isEmpty, "left behind: \(left)", sourceLocation: sourceLocation)
    }

    @Test("invalid flags and folders are refused with a message naming the problem and the fix")
    func invalidInput() throws {
        let tmp = try TemporaryFolder()
        try tmp.write("plain/a.txt", "a")
        let out = tmp.sub("out")
        try expectRefusal(
            [tmp.sub("plain"), "--product-id", "com.example/x", "--content-version", "1.0"], status: 1,
            message: "product identifier 'com.example/x' has a character that is not allowed", output: out)
        try expectRefusal(
            [tmp.sub("plain"), "--product-id", "com.example.x", "--content-version", "1.0-beta"], status: 1,
            message: "content version '1.0-beta' is not valid", output: out)
        try expectRefusal([tmp.sub("plain"), "--content-version", "1.0"], status: 1, message: "--product-id is required", output: out)
        try expectRefusal(
            [tmp.sub("missing"), "--product-id", "com.example.x", "--content-version", "1.0"], status: 1,
            message: "does not exist", output: out)

        try FileManager.default.createDirectory(atPath: tmp.sub("empty/sub/deeper"), withIntermediateDirectories: true)
        try expectRefusal(
            [tmp.sub("empty"), "--product-id", "com.example.x", "--content-version", "1.0"], status: 1,
            message: "holds no files", output: out)

        // An output folder in the content folder (or the content folder itself, or reached through
        // a link to it) would have the next build pack this one's archive as content.
        try FileManager.default.createSymbolicLink(atPath: tmp.sub("current"), withDestinationPath: tmp.sub("plain"))
        for output in [tmp.sub("plain/build"), tmp.sub("plain"), tmp.sub("current/deeper/build")] {
            let result = try iapPack(["build", tmp.sub("plain"), "--product-id", "com.example.x", "--content-version", "1.0", "-o", output])
            #expect(result.status == 1, "\(output): \(result.stderr)")
            #expect(result.stderr.contains("is inside the content folder") && result.stderr.contains("-o"), "\(result.stderr)")
        }
        #expect(tmp.files(in: "plain") == ["a.txt"], "an output folder was made in the content")

        try tmp.write("bad-plist/ContentInfo.plist", "not a plist")
        try tmp.write("bad-plist/Contents/a.txt", "a")
        try expectRefusal([tmp.sub("bad-plist")], status: 1, message: "is not a readable property list", output: out)
    }

    @Test("links, special files and colliding names are refused")
    func unsafeFolders() throws {
        let tmp = try TemporaryFolder()
        let out = tmp.sub("out")
        let args = ["--product-id", "com.example.x", "--content-version", "1.0"]

        try tmp.write("link/a.txt", "a")
        try FileManager.default.createSymbolicLink(atPath: tmp.sub("link/b.txt"), withDestinationPath: "a.txt")
        try expectRefusal([tmp.sub("link")] + args, status: 1, message: "is a symbolic link", output: out)

        // Inside an Xcode-style folder, a linked Contents or plist is refused as well.
        try tmp.write("real-contents/a.txt", "a")
        try tmp.write("xcode-link/ContentInfo.plist", ContentInfo(productIdentifier: try ProductIdentifier("com.example.x"), contentVersion: try ContentVersion("1.0")).plistData)
        try FileManager.default.createSymbolicLink(atPath: tmp.sub("xcode-link/Contents"), withDestinationPath: tmp.sub("real-contents"))
        try expectRefusal([tmp.sub("xcode-link")], status: 1, message: "Contents is a symbolic link", output: out)
        try tmp.write("plist-link/Contents/a.txt", "a")
        try FileManager.default.createSymbolicLink(atPath: tmp.sub("plist-link/ContentInfo.plist"), withDestinationPath: tmp.sub("xcode-link/ContentInfo.plist"))
        try expectRefusal([tmp.sub("plist-link")], status: 1, message: "ContentInfo.plist is a symbolic link", output: out)

        try tmp.write("fifo/a.txt", "a")
        #expect(mkfifo(tmp.sub("fifo/pipe"), 0o644) == 0)
        try expectRefusal([tmp.sub("fifo")] + args, status: 1, message: "is a special file", output: out)

        try tmp.write("case/Readme.txt", "a")
        try tmp.write("case/README.txt", "b")
        try expectRefusal([tmp.sub("case")] + args, status: 1, message: "differ only by case or Unicode normalisation", output: out)

        try tmp.write("unicode/caf\u{E9}.txt", "nfc")
        try tmp.write("unicode/cafe\u{301}.txt", "nfd")
        #expect(tmp.files(in: "unicode").count == 2)
        try expectRefusal([tmp.sub("unicode")] + args, status: 1, message: "differ only by case or Unicode normalisation", output: out)
    }

    @Test("an unreadable file, an unwritable output folder and a full disk fail with exit 3 and leave nothing")
    func ioFailures() throws {
        let tmp = try TemporaryFolder()
        let args = ["--product-id", "com.example.x", "--content-version", "1.0"]
        try tmp.write("src/data.bin", pseudoRandomBytes(2 << 20, seed: 9))

        // The output "folder" is below a regular file.
        try tmp.write("file", "x")
        let notFolder = try iapPack(["build", tmp.sub("src")] + args + ["-o", tmp.sub("file/out")])
        #expect(notFolder.status == 3)
        #expect(notFolder.stderr.contains("not a folder"))

        // A file-size limit makes the kernel refuse the write part-way, as a full disk would.
        let out = tmp.sub("out")
        try FileManager.default.createDirectory(atPath: out, withIntermediateDirectories: true)
        let full = try run("sh", ["-c", "ulimit -f 256; exec \"$0\" \"$@\"", productsDirectory() + "/iap-pack", "build", tmp.sub("src")] + args + ["-o", out])
        #expect(full.status == 3, "\(full.stderr)")
        #expect(full.stderr.contains("free disk space"))
        #expect(tmp.files(in: "out").isEmpty, "a partial archive was left behind")

        // Permission bits do not stop root, so the unreadable file is read by an unprivileged user.
        if getuid() == 0 {
            try tmp.write("locked/secret.bin", "s")
            chmod(tmp.sub("locked/secret.bin"), 0o000)
            chmod(tmp.path, 0o755)
            let shared = tmp.sub("shared-out")
            try FileManager.default.createDirectory(atPath: shared, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o777])
            let result = try run(
                "setpriv",
                [
                    "--reuid=65534", "--regid=65534", "--clear-groups", productsDirectory() + "/iap-pack",
                    "build", tmp.sub("locked"),
                ] + args + ["-o", shared])
            #expect(result.status == 3, "\(result.stderr)")
            #expect(result.stderr.contains("secret.bin") && result.stderr.contains("permission"))
            #expect(tmp.files(in: "shared-out").isEmpty)
        } else {
            try tmp.write("locked/secret.bin", "s")
            chmod(tmp.sub("locked/secret.bin"), 0o000)
            let result = try iapPack(["build", tmp.sub("locked")] + args + ["-o", tmp.sub("o2")])
            #expect(result.status == 3)
        }
    }

    @Test("a build into a folder holding the last one replaces its files and leaves nothing else; one that cannot place its manifest keeps the last archive")
    func rebuildInPlace() throws {
        let tmp = try TemporaryFolder()
        let out = tmp.sub("out")
        let args = ["--product-id", "com.example.x", "--content-version", "1.0", "-o", out, "--no-sync"]
        try tmp.write("src/data.bin", pseudoRandomBytes(3 << 20, seed: 21))
        let first = try iapPack(["build", tmp.sub("src")] + args)
        #expect(first.status == 0, "\(first.stderr)")
        let archive = out + "/com.example.x-1.0.zip"
        let manifest = out + "/com.example.x-1.0.manifest.json"
        let firstArchive = try Data(contentsOf: URL(fileURLWithPath: archive))
        let names = tmp.files(in: "out")

        // Rebuilt with other bytes (with and without --previous): both files replaced, and the
        // replaced ones (kept under temporary names until the end) are gone.
        try tmp.write("src/data.bin", pseudoRandomBytes(3 << 20, seed: 22))
        for extra in [[], ["--previous", archive]] {
            let again = try iapPack(["build", tmp.sub("src")] + args + extra)
            #expect(again.status == 0, "\(again.stderr)")
            #expect(tmp.files(in: "out") == names)
            #expect(try Data(contentsOf: URL(fileURLWithPath: archive)) != firstArchive)
            // The manifest in place describes the archive in place.
            #expect(try ArchiveVerifier.verify(archive: archive, manifest: manifest).manifest == manifest)
        }
        let secondArchive = try Data(contentsOf: URL(fileURLWithPath: archive))

        // The manifest's name taken by a folder: the build fails naming it, and the last build's
        // archive is back in place, untouched.
        try FileManager.default.removeItem(atPath: manifest)
        try FileManager.default.createDirectory(atPath: manifest, withIntermediateDirectories: false)
        try tmp.write("src/data.bin", pseudoRandomBytes(3 << 20, seed: 23))
        let blocked = try iapPack(["build", tmp.sub("src")] + args)
        #expect(blocked.status == 3, "\(blocked.stderr)")
        #expect(blocked.stderr.contains(manifest))
        #expect(try Data(contentsOf: URL(fileURLWithPath: archive)) == secondArchive)
        #expect(tmp.files(in: "out") == names)
    }

    @Test("the real 2 GiB cap: a sparse input that cannot fit is refused before anything is written")
    func realCap() throws {
        let tmp = try TemporaryFolder()
        try tmp.write("huge/small.txt", "hello")
        let fd = open(tmp.sub("huge/sparse.bin"), O_CREAT | O_WRONLY, 0o644)
        #expect(ftruncate(fd, 2_147_483_648) == 0)
        close(fd)
        let out = tmp.sub("out")
        let result = try iapPack(["build", tmp.sub("huge"), "--product-id", "com.example.huge", "--content-version", "1.0", "--level", "0", "-o", out])
        #expect(result.status == 2, "\(result.stderr)")
        // 2 GiB of payload plus headers and the plist: the error says exactly how much too much.
        #expect(result.stderr.contains("over the cap of 2147483648 bytes (2.00 GiB)"))
        #expect(result.stderr.contains("nothing was written"))
        #expect(tmp.files(in: "out").isEmpty)
        #expect(ArchiveLimits.maxArchiveSize == 2_147_483_648)
    }

    @Test("an injected cap that compression still ends over stops with the exact size and no partial output")
    func injectedCap() throws {
        let tmp = try TemporaryFolder()
        try tmp.write("src/noise.bin", pseudoRandomBytes(300_000, seed: 1))
        try tmp.write("src/text.txt", logText(lines: 1000, seed: 1))
        var options = PackOptions(
            productId: try ProductIdentifier("com.example.capped"), contentVersion: try ContentVersion("1.0"),
            outputDirectory: tmp.sub("out"))
        options.sizeCap = 200_000
        let error = try #require(throws: ArchiveError.self) { try ArchivePacker.pack(folder: tmp.sub("src"), options: options) }
        #expect(error.code == .capExceeded)
        // The uncapped archive's real size must be what the error reported.
        options.sizeCap = ArchiveLimits.maxArchiveSize
        options.outputDirectory = tmp.sub("uncapped")
        let real = try ArchivePacker.pack(folder: tmp.sub("src"), options: options)
        #expect(error.message.contains("would be \(real.manifest.archiveSize) bytes, \(real.manifest.archiveSize - 200_000) bytes over"))
        #expect(tmp.files(in: "out").isEmpty)
    }
}

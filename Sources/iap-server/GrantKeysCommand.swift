import ArgumentParser
import DownloadGrants
import Foundation

/// `iap-server grant-keys`: rotate the keys grant URLs are signed with, while servers run.
struct GrantKeysCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "grant-keys",
        abstract: "List, add, activate or retire the keys grant URLs are signed with; running servers read the file again within --revocation-refresh.",
        discussion: """
            Rotating without refusing a single URL: `add` a key (every replica learns to accept it), \
            wait until every replica has read it (their log says so, within --revocation-refresh), \
            `activate` it (new grants are signed with it), and once the old key's grants have \
            expired (--token-ttl), `retire` the old key. Replicas must share the file (a shared \
            data folder or --grant-keys path), or be given the same file at each step.
            """,
        subcommands: [List.self, Add.self, Activate.self, Retire.self])

    struct Location: ParsableArguments {
        @Option(help: "The server's data folder, for <data>/grant-keys.json (env IAP_DATA).") var data: String?
        @Option(name: .customLong("grant-keys"), help: "The grant key file, when not <data>/grant-keys.json (env IAP_GRANT_KEYS).") var grantKeys: String?

        var path: String {
            get throws {
                if let file = grantKeys ?? env("IAP_GRANT_KEYS") { return file }
                guard let data = data ?? env("IAP_DATA") else {
                    throw ValidationError("--data or --grant-keys (or IAP_DATA, IAP_GRANT_KEYS) is required: where the grant key file is")
                }
                return data + "/grant-keys.json"
            }
        }

        /// `change` applied to the file under its lock; a refusal is reported with its message.
        func edit<T>(_ change: (GrantKeyFile) throws(GrantKeyFileError) -> (GrantKeyFile, T)) throws -> T {
            let path = try path
            do throws(GrantKeyFileError) {
                return try GrantKeyFile.edit(path: path, change)
            } catch {
                throw reporter.failure(error, exitCode: error.code == .io ? 3 : 1)
            }
        }
    }

    struct List: ParsableCommand {
        static let configuration = CommandConfiguration(abstract: "List the keys, marking the active one (secrets are never printed).")
        @OptionGroup var location: Location
        @Flag(help: "Print JSON: {active, keys}.") var json = false

        func run() throws {
            let file: GrantKeyFile
            do { file = try GrantKeyFile.load(path: try location.path) } catch let error as GrantKeyFileError {
                throw reporter.failure(error, exitCode: error.code == .io ? 3 : 1)
            }
            if json {
                struct Listing: Encodable { let active: String; let keys: [String] }
                let encoder = JSONEncoder()
                encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
                print(String(decoding: try encoder.encode(Listing(active: file.active, keys: file.ids)), as: UTF8.self))
                return
            }
            for id in file.ids { print(id == file.active ? "\(id)  active: signs new grants" : "\(id)  accepted") }
        }
    }

    struct Add: ParsableCommand {
        static let configuration = CommandConfiguration(abstract: "Add a fresh 256-bit key, accepted but not yet signing: activate it once every replica has read it.")
        @OptionGroup var location: Location
        @Option(help: "The new key's id: lowercase letters, digits and '-' (default: the next k<n>).") var id: String?

        func run() throws {
            let added = try location.edit { file throws(GrantKeyFileError) in try file.adding(id) }
            print("added \(added): accepted by each server once it has read the file; then: iap-server grant-keys activate \(added)")
        }
    }

    struct Activate: ParsableCommand {
        static let configuration = CommandConfiguration(abstract: "Sign new grants with a key that every replica already accepts.")
        @OptionGroup var location: Location
        @Argument(help: "The key's id.") var id: String

        func run() throws {
            let previous = try location.edit { file throws(GrantKeyFileError) in (try file.activating(id), file.active) }
            print(
                previous == id
                    ? "\(id) was active already"
                    : "\(id) is active: new grants are signed with it; retire \(previous) once its grants have expired (--token-ttl): iap-server grant-keys retire \(previous)")
        }
    }

    struct Retire: ParsableCommand {
        static let configuration = CommandConfiguration(abstract: "Remove a key that no longer signs: grant URLs signed with it are refused from then on.")
        @OptionGroup var location: Location
        @Argument(help: "The key's id.") var id: String

        func run() throws {
            try location.edit { file throws(GrantKeyFileError) in (try file.retiring(id), ()) }
            print("retired \(id): grant URLs signed with it are refused once each server has read the file")
        }
    }
}

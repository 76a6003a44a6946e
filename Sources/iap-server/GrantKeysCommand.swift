import ArgumentParser
import ContentServer
import DownloadGrants
import Foundation

/// `iap-server grant-keys`: rotate the keys grant URLs are signed with, while servers run.
struct GrantKeysCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "grant-keys",
        abstract: "List, add, activate or retire the keys grant URLs are signed with; running servers read the file again within --revocation-refresh.",
        discussion: """
            Rotating without refusing a single URL: `add` a key (every replica learns to accept it \
            within --revocation-refresh, and logs it), `activate` it (new grants are signed with it; \
            refused until --settle seconds after the add), and once the old key's grants have expired, \
            `retire` the old key (refused until --token-ttl after it stopped signing). --now skips \
            the wait: after a leak, retire the leaked key at once. Replicas must share the file (a \
            shared data folder or --grant-keys path), or be given the same file at each step.
            """,
        subcommands: [List.self, Add.self, Activate.self, Retire.self])

    /// A refusal of the key file, reported with its exit code: 3 the file cannot be read or
    /// written, 2 a step asked for too soon, 1 anything else.
    static func failure(_ error: GrantKeyFileError) -> ExitCode {
        reporter.failure(error, exitCode: error.code == .io ? 3 : error.code == .tooSoon ? 2 : 1)
    }

    struct Location: ParsableArguments {
        @Option(help: "The server's data folder, for <data>/grant-keys.json (env IAP_DATA).") var data: String?
        @Option(name: .customLong("grant-keys"), help: "The grant key file, when not <data>/grant-keys.json (env IAP_GRANT_KEYS).") var grantKeys: String?

        var path: String {
            get throws {
                if let file = grantKeys ?? env("IAP_GRANT_KEYS") { return file }
                guard let data = data ?? env("IAP_DATA") else {
                    throw ValidationError("--data or --grant-keys (or IAP_DATA, IAP_GRANT_KEYS) is required: where the grant key file is")
                }
                return ServerConfiguration.grantKeysPath(inDataDirectory: data)
            }
        }

        /// `change` applied to the file under its lock; a refusal is reported with its message.
        func edit<T>(_ change: (GrantKeyFile) throws(GrantKeyFileError) -> (GrantKeyFile, T)) throws -> T {
            let path = try path
            do throws(GrantKeyFileError) {
                return try GrantKeyFile.edit(path: path, change)
            } catch {
                throw GrantKeysCommand.failure(error)
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
                throw GrantKeysCommand.failure(error)
            }
            if json {
                struct Key: Encodable {
                    let id: String
                    let active: Bool
                    let added: Date?
                    let signedUntil: Date?
                }
                struct Listing: Encodable { let active: String; let keys: [Key] }
                let encoder = JSONEncoder()
                encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
                encoder.dateEncodingStrategy = .iso8601
                let keys = file.ids.map { Key(id: $0, active: $0 == file.active, added: file.added[$0], signedUntil: file.signedUntil[$0]) }
                print(String(decoding: try encoder.encode(Listing(active: file.active, keys: keys)), as: UTF8.self))
                return
            }
            for id in file.ids {
                let added = file.added[id].map { " (added \($0.formatted(.iso8601)))" } ?? ""
                if id == file.active {
                    print("\(id)  active: signs new grants\(added)")
                } else if let until = file.signedUntil[id] {
                    print("\(id)  accepted: signed grants until \(until.formatted(.iso8601))")
                } else {
                    print("\(id)  accepted, not signing yet\(added)")
                }
            }
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
        @Option(help: "Seconds after its add before a key may be activated: at least the servers' --revocation-refresh.") var settle = 10
        @Flag(help: "Activate now, however recently the key was added (every replica has logged that it accepts it).") var now = false

        func validate() throws {
            guard (0...3600).contains(settle) else { throw ValidationError("--settle must be between 0 and 3600 seconds") }
        }

        func run() throws {
            let settle = now ? nil : TimeInterval(settle)
            let previous = try location.edit { file throws(GrantKeyFileError) in (try file.activating(id, settle: settle), file.active) }
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
        @Option(name: .customLong("token-ttl"), help: "The servers' --token-ttl in seconds (env IAP_TOKEN_TTL; default 900): how long grants the key signed stay valid.")
        var tokenTTL: Int?
        @Flag(help: "Retire now, refusing grants the key signed that are still valid (a leaked key).") var now = false

        func run() throws {
            let ttl = tokenTTL ?? env("IAP_TOKEN_TTL").flatMap(Int.init) ?? 900
            guard ttl > 0 else { throw ValidationError("--token-ttl must be a positive number of seconds") }
            let wait = now ? nil : TimeInterval(ttl)
            try location.edit { file throws(GrantKeyFileError) in (try file.retiring(id, tokenTTL: wait), ()) }
            print("retired \(id): grant URLs signed with it are refused once each server has read the file")
        }
    }
}

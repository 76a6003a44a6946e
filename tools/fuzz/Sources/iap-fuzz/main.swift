import CFuzzerDriver
import Foundation

// The target is chosen by the environment rather than an argument: libFuzzer owns the arguments,
// and passes them on to the jobs it forks (-jobs, -fork), which inherit the environment too.
let name = ProcessInfo.processInfo.environment["IAP_FUZZ_TARGET"] ?? ""
guard let target = FuzzTarget(rawValue: name) else {
    let names = FuzzTarget.allCases.map(\.rawValue).joined(separator: ", ")
    FileHandle.standardError.write(Data("iap-fuzz: set IAP_FUZZ_TARGET to one of: \(names)\n".utf8))
    exit(2)
}
target.prepare()
nonisolated(unsafe) var selected = target

var argc = CommandLine.argc
var argv: UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>? = CommandLine.unsafeArgv
exit(
    LLVMFuzzerRunDriver(&argc, &argv) { data, size in
        selected.run(UnsafeRawBufferPointer(start: data, count: size))
        return 0
    })

#include <stddef.h>
#include <stdint.h>

// libFuzzer's entry for programs that have a main of their own (a Swift executable does), in
// libFuzzer since LLVM 11; tools/fuzz.sh links libclang_rt.fuzzer_no_main, which has it.
int LLVMFuzzerRunDriver(int *argc, char ***argv, int (*callback)(const uint8_t *data, size_t size));

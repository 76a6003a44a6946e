// The header is the module; libFuzzer provides the function.

#!/usr/bin/env bash
# Coverage-guided fuzzing of the parsers that read hostile bytes: libFuzzer with AddressSanitizer
# over the package in tools/fuzz.
#
#   tools/fuzz.sh [target|all] [seconds per target]     (defaults: all, 60)
#
# Targets: archive, manifest, plist, receipt, jws, http, response, state (tools/fuzz/Sources/iap-fuzz/Targets.swift
# says what each reads and which invariants it checks). Seeds are made from real artifacts: the
# demo content packed by iap-pack, a sandbox StoreKit 2 transaction and StoreKit 1 receipt, and
# request heads. Corpora grow in .build-fuzz/corpus between runs; a crash, a broken invariant or a
# leak leaves its input in .build-fuzz/crashes/<target>-... and the script exits non-zero.
# Replay one: IAP_FUZZ_TARGET=<target> IAP_FUZZ_ROOTS=.build-fuzz/seeds/sandbox .build-fuzz/debug/iap-fuzz <file>
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(archive manifest plist receipt jws http response state)
which=${1:-all}
seconds=${2:-60}
if [ "$which" != all ]; then
  printf '%s\n' "${targets[@]}" | grep -qx "$which" || { echo "unknown target '$which': one of ${targets[*]}, or all" >&2; exit 2; }
  targets=("$which")
fi
work=$PWD/.build-fuzz
mkdir -p "$work/seeds" "$work/corpus" "$work/crashes"

# Not -sanitize=fuzzer: it links libFuzzer's main, which clashes with the one SwiftPM gives every
# executable. The same coverage instrumentation, and libFuzzer without its main, which
# tools/fuzz/Sources/iap-fuzz/main.swift starts (LLVMFuzzerRunDriver).
libfuzzer=$(dirname "$(readlink -f "$(command -v swiftc)")")/../lib/clang
libfuzzer=$(ls "$libfuzzer"/*/lib/linux/libclang_rt.fuzzer_no_main-x86_64.a | head -1)
flags=(--package-path tools/fuzz --scratch-path "$work" -Xswiftc -sanitize=address
  -Xswiftc -sanitize-coverage=edge,inline-8bit-counters,pc-table,trace-cmp -Xlinker "$libfuzzer")
echo "building the fuzzer (libFuzzer + AddressSanitizer)..." >&2
# SwiftPM keeps the build plan of the project (a path dependency here) in the scratch folder, and
# did not notice a source file added to one of its modules since the last fuzzing build: "cannot
# find 'ProductIdentifierRule' in scope". A failed build drops the plan and is tried once more.
build_log=$(swift build "${flags[@]}" 2>&1) ||
  { rm -f "$work/build.db" "$work/debug.yaml" "$work/plugin-tools.yaml"; build_log=$(swift build "${flags[@]}" 2>&1); } ||
  { echo "$build_log" | grep -v "Cannot export local symbol" | tail -20 >&2; exit 1; }
fuzzer=$(swift build "${flags[@]}" --show-bin-path)/iap-fuzz

make_seeds() {
  local seeds=$work/seeds scratch
  # Made again when a target was added since.
  [ -f "$seeds/.complete" ] && (cd "$seeds" && ls -d "${targets[@]}" >/dev/null 2>&1) && return
  echo "making seeds..." >&2
  swift build --product iap-pack 2>&1 | tail -1 >&2
  swift build --product iap-sandbox 2>&1 | tail -1 >&2
  local bin
  bin=$(swift build --show-bin-path)
  scratch=$(mktemp -d)
  rm -rf "$seeds"; mkdir -p "$seeds"/{archive,manifest,plist,receipt,jws,http,response,state}
  for folder in content/*/; do
    "$bin/iap-pack" build "$folder" -o "$scratch/packed" >/dev/null
  done
  # A small one as well, so that mutations land on headers rather than on payload.
  mkdir -p "$scratch/small/Contents/sub"
  printf 'hello\n' > "$scratch/small/Contents/a.txt"
  head -c 3000 /dev/zero > "$scratch/small/Contents/sub/zeros.bin"
  "$bin/iap-pack" build "$scratch/small" --product-id com.example.small --content-version 1.0 -o "$scratch/packed" >/dev/null
  cp "$scratch"/packed/*.zip "$seeds/archive/"
  cp "$scratch"/packed/.*.hashes "$seeds/state/"
  printf 'iap-fetch-installed 1\tcom.example.small\t1.0\n%s\t6\t2049\t131\t1764000000000000000\tContents/a.txt\n' \
    "$(printf 'hello\n' | sha256sum | cut -d' ' -f1)" > "$seeds/state/installed.tsv"
  cp "$scratch"/packed/*.manifest.json "$seeds/manifest/"
  find content -name ContentInfo.plist -exec sh -c 'cp "$1" "$2/$(echo "$1" | tr / _)"' _ {} "$seeds/plist" \;
  "$bin/iap-sandbox" init --dir "$seeds/sandbox" --bundle-id com.example.fuzz >/dev/null
  "$bin/iap-sandbox" purchase --dir "$seeds/sandbox" --product-id com.example.small > "$seeds/jws/transaction"
  "$bin/iap-sandbox" purchase --dir "$seeds/sandbox" --product-id com.example.small --storekit 1 >/dev/null
  "$bin/iap-sandbox" receipt --dir "$seeds/sandbox" --output "$seeds/receipt/receipt" >/dev/null
  printf 'GET /v1/content/tok/p-1.0.zip HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9,20-29,-5\r\nIf-Range: "e"\r\n\r\n' > "$seeds/http/range"
  printf 'HEAD /v1/content/t HTTP/1.0\r\nConnection: keep-alive\r\nIf-None-Match: W/"x", "e"\r\n\r\n' > "$seeds/http/head"
  printf 'GET /v1/content/a?b=c HTTP/1.1\r\nrange:\t bytes=100- \r\nContent-Length: 0\r\n\r\nGET /v1/content/b HTTP/1.1\r\n\r\n' > "$seeds/http/pipelined"
  printf 'bytes=0-0,1-1,5-,-3,9999999999999999999-' > "$seeds/http/ranges"
  printf 'HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/100\r\nContent-Length: 10\r\nETag: "e"\r\n\r\n0123456789' > "$seeds/response/partial"
  printf 'HTTP/1.0 200 OK\r\nContent-Length: 3, 3\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n' > "$seeds/response/lengths"
  printf 'HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}' > "$seeds/response/refused"
  rm -rf "$scratch"
  touch "$seeds/.complete"
}
make_seeds

status=0
for target in "${targets[@]}"; do
  mkdir -p "$work/corpus/$target"
  echo "fuzzing $target for ${seconds}s..." >&2
  if ! LSAN_OPTIONS=suppressions=$PWD/tools/fuzz/lsan.supp SWIFT_BACKTRACE=enable=no IAP_FUZZ_TARGET=$target IAP_FUZZ_ROOTS=$work/seeds/sandbox "$fuzzer" "$work/corpus/$target" "$work/seeds/$target" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$work/crashes/$target-" > "$work/$target.log" 2>&1; then
    echo "$target: FAILED; see $work/$target.log and $work/crashes/" >&2
    grep -E "ERROR|Fatal error|SUMMARY" "$work/$target.log" | head -5 >&2
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$work/$target.log" | tail -2 >&2
  fi
done
exit $status

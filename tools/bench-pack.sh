#!/usr/bin/env bash
# Packing benchmark: iap-pack against zip -6, zip -0 and 7z (zip format, -mx1, 2 threads) on the
# same ~1 GiB corpus in one run. Prints times (medians and spread of RUNS alternating rounds, default 7), sizes, peak
# memory and ratios.
# Usage: [RUNS=n] tools/bench-pack.sh [corpus-dir] [scale]   (scale 0.1 for a quick run)
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-/tmp/iap-bench-corpus}
scale=${2:-1}
tools/install-deps.sh
command -v 7z >/dev/null && [ -x /usr/bin/time ] || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq p7zip-full time >/dev/null; }
. tools/lib.sh
bench_corpus "$corpus" "$scale"
build_release iap-pack
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
input_bytes=$(du -sb "$corpus/Contents" | cut -f1)
cat "$corpus"/Contents/*/* "$corpus"/Contents/*/*/* >/dev/null 2>&1 || true   # warm the page cache for everyone

# The tools take turns: each round runs every tool once, RUNS rounds (default 7); each tool's
# median counts, with its spread (min-max): on a shared 2-core machine single runs of the same
# binary vary by 10% or more. Every run is printed on stderr.
runs=${RUNS:-7}
tools=("iap-pack(level6)" "iap-pack(level1)" "zip-r-6" "zip-r-0" "7z-mx1-mmt2")
output() { # tool -> the file it writes
  case $1 in
    "iap-pack(level6)") echo "$out/p/bench.corpus-1.0.zip" ;;
    "iap-pack(level1)") echo "$out/p1/bench.corpus-1.0.zip" ;;
    zip-r-6) echo "$out/z6.zip" ;;
    zip-r-0) echo "$out/z0.zip" ;;
    7z-mx1-mmt2) echo "$out/7z.zip" ;;
  esac
}
run_tool() { # tool
  case $1 in
    "iap-pack(level6)") "$bin/iap-pack" build "$corpus/Contents" --product-id bench.corpus --content-version 1.0 -o "$out/p" ;;
    "iap-pack(level1)") "$bin/iap-pack" build "$corpus/Contents" --product-id bench.corpus --content-version 1.0 --level 1 -o "$out/p1" ;;
    zip-r-6) (cd "$corpus" && zip -q -r -6 "$out/z6.zip" Contents) ;;
    zip-r-0) (cd "$corpus" && zip -q -r -0 "$out/z0.zip" Contents) ;;
    7z-mx1-mmt2) (cd "$corpus" && 7z a -tzip -mx1 -mmt2 "$out/7z.zip" Contents) ;;
  esac
}
export -f run_tool output
export bin corpus out
for round in $(seq "$runs"); do
  for tool in "${tools[@]}"; do
    rm -f "$(output "$tool")"
    /usr/bin/time -f "%e %M" -o "$out/time" bash -c 'run_tool "$1"' _ "$tool" >/dev/null 2>"$out/err" || { cat "$out/err"; exit 1; }
    read -r secs kb < "$out/time"
    echo "$secs $kb" >> "$out/runs-$tool"
    echo "  round $round, $tool: $secs s, peak $((kb / 1024)) MiB" >&2
  done
done
: > "$out/results"
for tool in "${tools[@]}"; do
  secs=$(cut -d' ' -f1 "$out/runs-$tool" | median)
  range=$(cut -d' ' -f1 "$out/runs-$tool" | spread)
  kb=$(cut -d' ' -f2 "$out/runs-$tool" | sort -g | tail -1)
  printf '%s %s %s %s %s\n' "$tool" "$secs" "$(stat -c %s "$(output "$tool")")" "$kb" "$range" >> "$out/results"
done
z6=$(awk '$1=="zip-r-6"{print $2" "$3}' "$out/results")
echo "corpus: $input_bytes bytes in $(find "$corpus/Contents" -type f | wc -l) files; $(nproc) cores; medians of $runs rounds"
printf '%-18s %9s %15s %14s %10s %14s %12s %12s\n' tool seconds "(spread)" "output bytes" "peak MiB" "time/zip-6" "95% interval" "size/zip-6"
# The interval of each time ratio: the rounds resampled as pairs with zip -6's (tools/lib.sh).
cut -d' ' -f1 "$out/runs-zip-r-6" > "$out/zip6.col"
while read -r name secs bytes kb range; do
  read -r zs zb <<< "$z6"
  cut -d' ' -f1 "$out/runs-$name" > "$out/tool.col"
  ci=$(ratio_interval "$out/tool.col" "$out/zip6.col")
  awk -v n="$name" -v s="$secs" -v r="$range" -v b="$bytes" -v k="$kb" -v zs="$zs" -v zb="$zb" -v ci="$ci" \
    'BEGIN { printf "%-18s %9.2f %15s %14d %10.1f %14.3f %12s %12.3f\n", n, s, "(" r ")", b, k / 1024, s / zs, ci, b / zb }'
done < "$out/results"

#!/usr/bin/env bash
# `iap-server check` against `sha256sum` over the same published archives, the peer an operator
# would reach for (and `openssl dgst -sha256`, which like ours uses the CPU's SHA instructions): COUNT random archives of SIZE bytes (default 4 x 256 MiB) published into a
# scratch data folder, each tool run ROUNDS times (default 7), alternated, with the archives'
# pages dropped from the page cache before each run ("cold": read from disk) and with them cached
# ("warm": hashing alone). Prints medians (min-max), the ratio of medians with its 95% interval,
# peak memory, and how much of the archives each tool left in the page cache after a cold run
# (iap-server check drops what it brought in; fincore tells).
# Usage: [COUNT=n] [SIZE=bytes] [ROUNDS=n] tools/bench-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
[ -x /usr/bin/time ] || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq time >/dev/null; }
. tools/lib.sh
build_release iap-pack iap-server
count=${COUNT:-4} size=${SIZE:-$((256 << 20))} rounds=${ROUNDS:-7}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for i in $(seq "$count"); do
  "$bin/iap-server" publish --data "$work/data" "$(random_archive "bench.check$i" "$size" "$work" "$work/out")" >/dev/null
  rm -rf "$work/content-bench.check$i" "$work/out"
done
files=("$work"/data/archives/*)
total=$(cat "${files[@]}" | wc -c)

# Drops (cold) or loads (warm) every archive and manifest in the page cache.
prepare() { # cold|warm
  if [ "$1" = cold ]; then
    sync
    python3 -c 'import os, sys
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "${files[@]}"
  else
    cat "${files[@]}" > /dev/null
  fi
}
cached_mib() { fincore --bytes --noheadings --output RES "${files[@]}" | awk '{ s += $1 } END { printf "%.0f", s / 1048576 }'; }
run_tool() { # tool
  case $1 in
    iap-server-check) "$bin/iap-server" check --data "$work/data" >/dev/null ;;
    sha256sum) sha256sum "$work"/data/archives/* >/dev/null ;;
    openssl-dgst) openssl dgst -sha256 "$work"/data/archives/* >/dev/null ;;
  esac
}
export -f run_tool
export bin work
tools=(iap-server-check sha256sum openssl-dgst)
for round in $(seq "$rounds"); do
  for mode in cold warm; do
    for tool in "${tools[@]}"; do
      prepare "$mode"
      /usr/bin/time -f "%e %M" -o "$work/time" bash -c 'run_tool "$1"' _ "$tool"
      read -r secs kb < "$work/time"
      left=$([ "$mode" = cold ] && cached_mib || echo -)
      echo "$secs $kb $left" >> "$work/runs-$mode-$tool"
      echo "  round $round, $mode, $tool: $secs s, peak $((kb / 1024)) MiB, cached after: $left MiB" >&2
    done
  done
done
echo "$count archives, $total bytes; $(nproc) cores; medians of $rounds alternated rounds"
printf '%-6s %-18s %8s %15s %8s %10s %14s %18s\n' cache tool seconds "(spread)" "MB/s" "peak MiB" "time/sha256sum" "cached after, MiB"
for mode in cold warm; do
  cut -d' ' -f1 "$work/runs-$mode-sha256sum" > "$work/peer.col"
  peer=$(median < "$work/peer.col")
  for tool in "${tools[@]}"; do
    cut -d' ' -f1 "$work/runs-$mode-$tool" > "$work/tool.col"
    secs=$(median < "$work/tool.col")
    kb=$(cut -d' ' -f2 "$work/runs-$mode-$tool" | sort -g | tail -1)
    left=$(cut -d' ' -f3 "$work/runs-$mode-$tool" | sort -g | tail -1)
    awk -v m="$mode" -v n="$tool" -v s="$secs" -v r="$(spread < "$work/tool.col")" -v b="$total" -v k="$kb" -v p="$peer" \
      -v ci="$(ratio_interval "$work/tool.col" "$work/peer.col")" -v l="$left" \
      'BEGIN { printf "%-6s %-18s %8.2f %15s %8.0f %10.1f %6.3f %-7s %18s\n", m, n, s, "(" r ")", b / s / 1e6, k / 1024, s / p, "(" ci ")", l }'
  done
done

#!/usr/bin/env bash
# Downloads side by side on loopback, as a restore runs them: COUNT purchases of SIZE-byte archives
# (default 3 of 256 MiB) all unfinished in the queue, fetched by `iap-fetch run --parallel COUNT`
# (grant, manifest, archive, SHA-256, safe install, finish for each), against what a user would
# script instead: the archives with `curl -Z --parallel-max COUNT` (granted before the clock
# starts), then `sha256sum` and `unzip` of each; curl's transfer alone is timed too. Alternated
# over RUNS rounds (default 7), who goes first flipped each round; reports each side's seconds and
# peak memory (median, min-max) and the ratios of the medians with their 95% intervals. The memory
# goal: at most 64 MiB.
# Usage: [RUNS=n] [COUNT=n] [SIZE=bytes] tools/bench-parallel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
. tools/lib.sh
build_release iap-server iap-pack iap-sandbox iap-fetch
runs=${RUNS:-7} count=${COUNT:-3} size=${SIZE:-$((256 << 20))}
work=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
archives=()
for i in $(seq "$count"); do archives+=("$(random_archive "com.example.side$i" "$size" "$work" "$work/out")"); done
start_sandbox_server "$work" com.example.bench "${archives[@]}"
for i in $(seq "$count"); do "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id "com.example.side$i" > "$work/tx$i.jws"; done
cp -r "$work/sandbox/queue" "$work/queue.pristine"

fresh() { rm -rf "$work/device" "$work/queue" "$work/curlout"; cp -r "$work/queue.pristine" "$work/queue"; mkdir -p "$work/curlout"; sync; sleep 1; }
timed() { /usr/bin/time -f "%e %M" -o "$work/t" "$@" >/dev/null 2>"$work/err" || { echo "failed: $* $(tail -3 "$work/err")" >&2; exit 1; }; cat "$work/t"; }
fetch_s=(); fetch_kb=(); curl_s=(); curl_only=(); curl_kb=()
measure_fetch() {
  local s kb
  fresh
  read -r s kb <<< "$(timed "$bin/iap-fetch" run --server "$base" --queue "$work/queue" --content-dir "$work/device" --parallel "$count")"
  [ "$(ls "$work/device" | wc -l)" -eq "$count" ] || { echo "iap-fetch installed $(ls "$work/device" | wc -l) of $count" >&2; exit 1; }
  fetch_s+=("$s"); fetch_kb+=("$kb")
  echo "run $run: iap-fetch run --parallel $count: $s s, $((kb / 1024)) MiB" >&2
}
measure_curl() {
  local start mid end kb args=() files=()
  fresh
  for i in $(seq "$count"); do args+=(-o "$work/curlout/$i.zip" "$(grant_transaction "$work/tx$i.jws")"); files+=("$work/curlout/$i.zip"); done
  start=$(date +%s.%N)
  read -r _ kb <<< "$(timed curl -s -Z --parallel-max "$count" "${args[@]}")"
  mid=$(date +%s.%N)
  sha256sum "${files[@]}" >/dev/null
  for f in "${files[@]}"; do unzip -q "$f" -d "${f%.zip}"; done
  end=$(date +%s.%N)
  curl_s+=("$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')"); curl_only+=("$(awk -v a="$start" -v b="$mid" 'BEGIN { printf "%.2f", b - a }')")
  curl_kb+=("$kb")
  echo "run $run: curl -Z + sha256sum + unzip: ${curl_s[-1]} s (curl ${curl_only[-1]} s), $((kb / 1024)) MiB" >&2
}
for run in $(seq "$runs"); do
  if [ $((run % 2)) = 1 ]; then measure_curl; measure_fetch; else measure_fetch; measure_curl; fi
done

col() { printf '%s\n' "${@:2}" > "$work/$1"; }
col fs "${fetch_s[@]}"; col cs "${curl_s[@]}"; col co "${curl_only[@]}"
mib() { printf '%s\n' "$@" | awk '{ printf "%.1f\n", $1 / 1024 }'; }
echo "$count archives of $size bytes at once; $(nproc) cores; $runs rounds, medians (min-max)"
printf '%-52s %7s s (%s)  peak %s MiB (%s)\n' "iap-fetch run --parallel $count (SHA-256, install)" \
  "$(median < "$work/fs")" "$(spread < "$work/fs")" "$(mib "${fetch_kb[@]}" | median)" "$(mib "${fetch_kb[@]}" | spread)"
printf '%-52s %7s s (%s)\n' "curl -Z --parallel-max $count + sha256sum + unzip" "$(median < "$work/cs")" "$(spread < "$work/cs")"
printf '%-52s %7s s (%s)  peak %s MiB (%s)\n' "  of which curl -Z (transfer only)" \
  "$(median < "$work/co")" "$(spread < "$work/co")" "$(mib "${curl_kb[@]}" | median)" "$(mib "${curl_kb[@]}" | spread)"
echo "time, iap-fetch against curl + sha256sum + unzip: $(median_ratio "$work/fs" "$work/cs") (below 1: iap-fetch faster)"
echo "time, iap-fetch (with SHA-256 and install) against curl's transfer alone: $(median_ratio "$work/fs" "$work/co")"

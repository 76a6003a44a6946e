#!/usr/bin/env bash
# Client benchmark on one 1 GiB archive served by iap-server (release), in one run:
# - transfer only: iap-fetch until every byte is on disk and its SHA-256 checked (the update it emits
#   then, before installing) on 1 and 4 connections, against curl -o alone: the goal is >= 0.95x curl;
# - iap-fetch end to end (grant, download, incremental SHA-256, safe install, finish) against what a
#   user would script instead: curl -o, then sha256sum, then unzip; and curl -o alone;
# - peak memory of each;
# - bytes fetched twice after a SIGKILL at about 50% (partial bytes on disk minus what the journal
#   had recorded; the journal records every 1 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
. tools/lib.sh
build_release iap-server iap-pack iap-sandbox iap-fetch
work=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
archive=$(random_archive bench.fetch $((1024 * 1024 * 1024 - 4096)) "$work" "$work/out")
start_sandbox_server "$work" com.example.bench "$archive"
size=$(stat -c %s "$archive")

# Seconds from launch until iap-fetch reports every byte received and verified (NDJSON on stdout).
transfer_time() { # connections
  python3 - "$@" <<'PY'
import json, subprocess, sys, time
bin, server, tx, dev, conns = sys.argv[1:6]
start = time.monotonic()
p = subprocess.Popen([bin + "/iap-fetch", "get", "--server", server, "--transaction", tx, "--content-dir", dev,
                      "--json", "--connections", conns], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
done = None
for line in p.stdout:
    u = json.loads(line)
    if done is None and u.get("state") == "active" and u.get("expectedContentLength", -1) > 0 and u.get("bytesReceived") == u["expectedContentLength"]:
        done = time.monotonic() - start
p.wait()
print(f"{done:.3f}" if done is not None and p.returncode == 0 else "fail")
PY
}
# Each measurement starts with no dirty pages left by the one before (theirs to write back, not its).
settle() { sync; sleep 1; }
timed() { settle; /usr/bin/time -f "%e %M" -o "$work/t" "$@" >/dev/null 2>&1; cat "$work/t"; }
best_fetch=999999; best_curl=999999; best_curl_all=999999; best_t1=999999; best_t4=999999
all_t1=(); all_curl=()
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
for run in 1 2 3 4 5; do
  for c in 1 4; do
    "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > "$work/tx.jws"
    rm -rf "$work/device"; settle
    t=$(transfer_time "$bin" "$base" "$work/tx.jws" "$work/device" $c)
    [ "$t" = fail ] && { echo "iap-fetch --connections $c failed" >&2; exit 1; }
    echo "run $run: iap-fetch transfer only, $c connection(s): $t s" >&2
    cmp -s "$work/device/bench.fetch/1.0/Contents/payload.bin" "$work/content-bench.fetch/payload.bin" || { echo "iap-fetch installed wrong bytes" >&2; exit 1; }
    if [ $c = 1 ]; then all_t1+=("$t"); awk -v s="$t" -v b="$best_t1" 'BEGIN { exit !(s < b) }' && best_t1=$t
    else awk -v s="$t" -v b="$best_t4" 'BEGIN { exit !(s < b) }' && best_t4=$t; fi
  done
  "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > "$work/tx.jws"
  rm -rf "$work/device"
  read -r secs kb <<< "$(timed "$bin/iap-fetch" get --server "$base" --transaction "$work/tx.jws" --content-dir "$work/device")"
  cmp -s "$work/device/bench.fetch/1.0/Contents/payload.bin" "$work/content-bench.fetch/payload.bin" || { echo "iap-fetch installed wrong bytes" >&2; exit 1; }
  awk -v s="$secs" -v b="$best_fetch" 'BEGIN { exit !(s < b) }' && { best_fetch=$secs; fetch_kb=$kb; }
  url=$(curl -s -X POST "$base/v1/downloads" -d "{\"signedTransaction\":\"$(cat "$work/tx.jws")\"}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["downloads"][0]["url"])')
  rm -f "$work/c.zip"
  read -r secs kb <<< "$(timed curl -s -o "$work/c.zip" "$url")"
  all_curl+=("$secs")
  awk -v s="$secs" -v b="$best_curl" 'BEGIN { exit !(s < b) }' && { best_curl=$secs; curl_kb=$kb; }
  echo "run $run: curl -o: $secs s" >&2
  rm -rf "$work/c.zip" "$work/unzipped"; settle
  start=$(date +%s.%N)
  curl -s -o "$work/c.zip" "$url" && sha256sum "$work/c.zip" >/dev/null && unzip -q "$work/c.zip" -d "$work/unzipped"
  secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }')
  awk -v s="$secs" -v b="$best_curl_all" 'BEGIN { exit !(s < b) }' && best_curl_all=$secs
done

# SIGKILL at ~50%: rate-limited so the kill lands mid-transfer.
"$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > /dev/null
rm -rf "$work/device"
"$bin/iap-fetch" run --server "$base" --queue "$work/sandbox/queue" --content-dir "$work/device" --limit-rate 400M >/dev/null 2>&1 &
fetch_pid=$!
journal=$(echo "$work"/device/.iap-fetch)
while kill -0 $fetch_pid 2>/dev/null; do
  partial=$(ls "$work"/device/.iap-fetch/*.partial 2>/dev/null | head -1 || true)
  [ -n "$partial" ] && [ "$(stat -c %s "$partial")" -ge $((size / 2)) ] && break
  sleep 0.01
done
kill -9 $fetch_pid; wait $fetch_pid 2>/dev/null || true
on_disk=$(stat -c %s "$partial")
synced=$(python3 -c 'import json,glob,sys; print(json.load(open(glob.glob(sys.argv[1] + "/*.json")[0]))["recordedLength"])' "$journal")
"$bin/iap-fetch" run --server "$base" --queue "$work/sandbox/queue" --content-dir "$work/device" >/dev/null
cmp -s "$work/device/bench.fetch/1.0/Contents/payload.bin" "$work/content-bench.fetch/payload.bin" && resumed=identical || resumed=DIFFERENT

echo "archive: $size bytes; $(nproc) cores; best of 5"
printf '%-58s %9s %11s\n' "measure" "seconds" "peak MiB"
awk -v s="$best_fetch" -v k="$fetch_kb" 'BEGIN { printf "%-58s %9.2f %11.1f\n", "iap-fetch get (download + SHA-256 + safe install)", s, k / 1024 }'
awk -v s="$best_curl_all" 'BEGIN { printf "%-58s %9.2f %11s\n", "curl -o + sha256sum + unzip -q", s, "-" }'
awk -v s="$best_curl" -v k="$curl_kb" 'BEGIN { printf "%-58s %9.2f %11.1f\n", "curl -o (transfer only)", s, k / 1024 }'
awk -v s="$best_t1" 'BEGIN { printf "%-58s %9.2f %11s\n", "iap-fetch transfer only (bytes on disk + SHA-256), 1 conn", s, "-" }'
awk -v s="$best_t4" 'BEGIN { printf "%-58s %9.2f %11s\n", "iap-fetch transfer only, --connections 4", s, "-" }'
awk -v a="$best_t1" -v b="$best_curl" 'BEGIN { printf "transfer ratio, one connection, curl time / iap-fetch time: %.2f (goal >= 0.95)\n", b / a }'
awk -v a="$(median "${all_t1[@]}")" -v b="$(median "${all_curl[@]}")" \
  'BEGIN { printf "  the same with medians of the runs (%.2f s / %.2f s): %.2f\n", b, a, b / a }'
awk -v a="$best_t4" -v b="$best_curl" 'BEGIN { printf "transfer ratio, 4 connections, curl time / iap-fetch time: %.2f\n", b / a }'
awk -v a="$best_fetch" -v b="$best_curl_all" 'BEGIN { printf "end-to-end ratio, curl pipeline time / iap-fetch time: %.2f (above 1: iap-fetch faster)\n", b / a }'
awk -v d="$on_disk" -v s="$synced" -v z="$size" 'BEGIN { printf "SIGKILL at %.0f%%: %d bytes on disk, %d synced in the journal: %.2f MiB fetched again\n", d * 100 / z, d, s, (d - s) / 1048576 }'
echo "resumed download installed $resumed bytes"

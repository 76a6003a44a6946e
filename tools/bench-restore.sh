#!/usr/bin/env bash
# A restore over a real link: COUNT purchases of SIZE-byte archives (default 24 of 1 MiB), all
# unfinished in the queue at once, as after "Restore Purchases" or a reinstall, fetched by
# `iap-fetch run` (grant, manifest, archive, SHA-256, safe install, finish for each) across a link
# of RATE with RTT round trip (default 100mbit, 40ms: a good home connection): the client in a
# network namespace of its own behind a veth pair, the server behind tools/delay-proxy.py, so
# every connection and every request pays the round trip.
# Measures, alternated every round (who goes first moves one on each round), RUNS rounds (7):
# - iap-fetch with its default --parallel (3 downloads at once);
# - iap-fetch --parallel 1 (one download at a time, as every run was before --parallel);
# - what a user would script with curl: every grant with `curl -Z` (3 at once), then every
#   archive with `curl -Z` (3 at once), neither checked nor installed.
# Reports each one's seconds (median, min-max) and the ratios of medians with 95% intervals.
# Needs root (the namespace). Usage: [RUNS=n] [COUNT=n] [SIZE=bytes] [RATE=100mbit] [RTT=40ms] tools/bench-restore.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
. tools/lib.sh
build_release iap-server iap-pack iap-sandbox iap-fetch
runs=${RUNS:-7} count=${COUNT:-24} size=${SIZE:-$((1 << 20))} rate=${RATE:-100mbit} rtt=${RTT:-40ms}
work=$(mktemp -d)
ns=iapbr$$
server_pid= proxy_pid=
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; [ -n "$proxy_pid" ] && kill "$proxy_pid" 2>/dev/null; ip netns del "$ns" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

# The link: lib.sh's start_link (a veth pair into the client's namespace, tbf at RATE on the
# servers' end); the round trip comes from tools/delay-proxy.py in front of the server (this kernel
# has no netem).
# A queue of 50 ms at the rate, as a home router's: 5 ms (bench-serve's) drops a restore's bursts.
start_link "$rate" "$ns" 50ms

"$bin/iap-sandbox" init --dir "$work/sandbox" --bundle-id com.example.bench >/dev/null
for i in $(seq "$count"); do
  archive=$(random_archive "com.example.restore$i" "$size" "$work" "$work/out")
  "$bin/iap-server" publish --data "$work/data" "$archive" >/dev/null
  "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id "com.example.restore$i" > "$work/tx$i.jws"
done
port=$(free_port) proxy_port=$(free_port)
base="http://10.231.0.1:$proxy_port"
LOG_LEVEL=error "$bin/iap-server" serve --data "$work/data" --bundle-id com.example.bench --trust-root "$work/sandbox/root.cer" \
  --environment sandbox --port "$port" --public-url "$base" --token-ttl 86400 > "$work/server.log" 2>&1 &
server_pid=$!
python3 tools/delay-proxy.py 10.231.0.1 "$proxy_port" 127.0.0.1 "$port" "${rtt%ms}" &
proxy_pid=$!
for _ in $(seq 200); do "${client[@]}" curl -sf "$base/healthz" >/dev/null && break; sleep 0.05; done
cp -r "$work/sandbox/queue" "$work/queue.pristine"
for i in $(seq "$count"); do printf '{"signedTransaction":"%s"}' "$(cat "$work/tx$i.jws")" > "$work/grant$i.json"; done

fresh() { rm -rf "$work/device" "$work/queue" "$work/curlout"; cp -r "$work/queue.pristine" "$work/queue"; mkdir -p "$work/curlout"; sync; }
# Seconds the command took (its output dropped, its errors to <work>/fetch.err); fails with it.
seconds() { python3 -c 'import subprocess, sys, time; t = time.monotonic(); r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); sys.exit(r.returncode) if r.returncode else print("%.3f" % (time.monotonic() - t))' "$@"; }
fetch() { # parallel
  fresh
  seconds "${client[@]}" "$bin/iap-fetch" run --server "$base" --queue "$work/queue" --content-dir "$work/device" --parallel "$1" 2>"$work/fetch.err" ||
    { echo "iap-fetch failed: $(tail -3 "$work/fetch.err")" >&2; exit 1; }
  [ "$(ls "$work/device" | wc -l)" -eq "$count" ] || { echo "iap-fetch installed $(ls "$work/device" | wc -l) of $count" >&2; exit 1; }
}
with_curl() {
  fresh
  python3 - "$work" "$count" "$base" "${client[@]}" <<'PY'
import json, subprocess, sys, time
work, count, base, client = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
start = time.monotonic()
grants = []
for i in range(1, count + 1):
    grants += ["-sSf", "-X", "POST", "-H", "Content-Type: application/json", "--data-binary", f"@{work}/grant{i}.json", "-o", f"{work}/curlout/grant{i}", f"{base}/v1/downloads", "--next"]
subprocess.run(client + ["curl", "-Z", "--parallel-max", "3"] + grants[:-1], check=True, stderr=subprocess.DEVNULL)
downloads = []
for i in range(1, count + 1):
    url = json.load(open(f"{work}/curlout/grant{i}"))["downloads"][0]["url"]
    downloads += ["-o", f"{work}/curlout/archive{i}.zip", url]
subprocess.run(client + ["curl", "-sSf", "-Z", "--parallel-max", "3"] + downloads, check=True, stderr=subprocess.DEVNULL)
print("%.3f" % (time.monotonic() - start))
PY
}

measures=(parallel3 parallel1 curl)
for m in "${measures[@]}"; do : > "$work/$m"; done
run_measure() { case $1 in parallel3) fetch 3 ;; parallel1) fetch 1 ;; curl) with_curl ;; esac; }
for round in $(seq "$runs"); do
  line="round $round:"
  for k in 0 1 2; do
    m=${measures[$(((round + k) % 3))]}
    t=$(run_measure "$m")
    echo "$t" >> "$work/$m"
    line="$line $m $t s"
  done
  echo "$line" >&2
done
echo "restore of $count purchases of $size bytes across $rate with a $rtt round trip, $runs rounds (seconds, median (min-max)):"
for m in "${measures[@]}"; do echo "  $m: $(median < "$work/$m") ($(spread < "$work/$m"))"; done
echo "iap-fetch (3 at once) against --parallel 1, time: $(median_ratio "$work/parallel3" "$work/parallel1")"
echo "iap-fetch (3 at once) against curl -Z (3 at once, no checks, no install), time: $(median_ratio "$work/parallel3" "$work/curl")"

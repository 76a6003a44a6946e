#!/usr/bin/env bash
# Client benchmark on one 1 GiB archive served by iap-server (release), in one run:
# - transfer only: iap-fetch until every byte is on disk and its SHA-256 checked (the update it emits
#   then, before installing) on 1 and 4 connections, against curl -o alone: the goal is >= 0.95x curl;
#   since the forty-first stop the transfer also writes the install's files of 1 MiB and more as
#   their bytes arrive (StreamingExtractor), which curl's does not; since the forty-second, the
#   stored ones' bytes only there, not in the partial archive too (LeftOutRanges);
# - iap-fetch end to end (grant, download, incremental SHA-256, safe install, finish) against what a
#   user would script instead: curl -o, then sha256sum, then unzip; and curl -o alone;
# - peak memory of each;
# - bytes fetched twice after a SIGKILL at about 50% (partial bytes on disk minus what the journal
#   had recorded; the journal records every 1 MiB).
# Each round runs every measure once, each pair back to back in an order flipped every round, every
# measure after the same clean-up (outputs deleted, sync); the headline is the ratio of medians
# over RUNS rounds (default 7) with each median's spread (min-max) and the ratio's 95% interval;
# best-of is a secondary line.
# TLS=1: every measure over HTTPS, as in production. nginx terminates TLS with a certificate from
# an authority made here with openssl (given to iap-fetch with --ca-file, to curl with
# CURL_CA_BUNDLE) and offers HTTP/2 (curl takes it; iap-fetch stays on HTTP/1.1). It serves the
# archive itself, as the shipped edge does from its cache, and passes grants and manifests to
# iap-server, whose download URLs name it (--public-url).
# Usage: [RUNS=n] [SIZE=bytes] [TLS=1] tools/bench-fetch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
. tools/lib.sh
fetch_extra=()
if [ "${TLS:-0}" = 1 ]; then
  command -v nginx >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; }
  tls_port=$(free_port)
  SERVER_ARGS="--public-url https://127.0.0.1:$tls_port"
fi
fetch_bench_setup
runs=${RUNS:-7}
size=$(stat -c %s "$archive")
if [ "${TLS:-0}" = 1 ]; then
  tls="$work/tls"; mkdir -p "$tls" "$work/www"; chmod 755 "$work" "$work/www"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$tls/ca.key" -out "$tls/ca.pem" -days 1 -subj "/CN=bench CA" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$tls/edge.key" -out "$tls/edge.csr" -subj "/CN=127.0.0.1" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > "$tls/edge.ext"
  openssl x509 -req -in "$tls/edge.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" -CAcreateserial -out "$tls/edge.pem" -days 1 -extfile "$tls/edge.ext" 2>/dev/null
  ln "$(ls "$work"/data/archives/*.zip | head -1)" "$work/www/bench.fetch-1.0.zip"; chmod 644 "$work/www/bench.fetch-1.0.zip"
  start_nginx "$work" "server {
    listen 127.0.0.1:$tls_port ssl http2;
    ssl_certificate $tls/edge.pem; ssl_certificate_key $tls/edge.key;
    location ~ ^/v1/content/[^/]+/(bench\\.fetch-1\\.0\\.zip)\$ { alias $work/www/\$1; }
    location / { proxy_pass $base; proxy_http_version 1.1; proxy_set_header Connection \"\"; }
  }"
  # Under `set -e` a failing command here would turn a finished run's status into 1: nginx may
  # remove its pid file between the test and the read.
  trap 'kill $(jobs -p) 2>/dev/null || true; if [ -f "$work/nginx.pid" ]; then kill "$(cat "$work/nginx.pid" 2>/dev/null)" 2>/dev/null || true; fi; rm -rf "$work"; true' EXIT
  base="https://127.0.0.1:$tls_port"
  export CURL_CA_BUNDLE="$tls/ca.pem"
  fetch_extra=(--ca-file "$tls/ca.pem")
fi

# Seconds from launch until iap-fetch reports every byte received and verified (NDJSON on stdout),
# then the seconds of that before its first update as active (the archive's response accepted:
# process start, grant, manifest and journal set-up; curl's measure starts with a granted URL).
transfer_time() { # connections
  python3 - "$@" <<'PY'
import json, subprocess, sys, time
bin, server, tx, dev, conns = sys.argv[1:6]
start = time.monotonic()
p = subprocess.Popen([bin + "/iap-fetch", "get", "--server", server, "--transaction", tx, "--content-dir", dev,
                      "--json", "--connections", conns] + sys.argv[6:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
done = None
accepted = None
for line in p.stdout:
    u = json.loads(line)
    if accepted is None and u.get("state") == "active":
        accepted = time.monotonic() - start
    if done is None and u.get("state") == "active" and u.get("expectedContentLength", -1) > 0 and u.get("bytesReceived") == u["expectedContentLength"]:
        done = time.monotonic() - start
p.wait()
print(f"{done:.3f} {accepted:.3f}" if done is not None and p.returncode == 0 else "fail")
PY
}
# Each measurement starts with no dirty pages left by the one before (theirs to write back, not its).
settle() { sync; sleep 1; }
timed() { settle; /usr/bin/time -f "%e %M" -o "$work/t" "$@" >/dev/null 2>&1; cat "$work/t"; }
best_fetch=999999; best_curl=999999; best_curl_all=999999; best_t1=999999; best_t4=999999
all_t1=(); all_t4=(); all_curl=(); all_fetch=(); all_pipeline=(); all_setup=(); all_t1_body=()
# lib.sh's median and spread, of the arguments rather than of lines on standard input.
median_of() { printf '%s\n' "$@" | median; }
spread_of() { printf '%s\n' "$@" | spread; }
# Every measure starts from the same state: no output of an earlier one left (their pages freed
# just before, as for the others), nothing dirty.
clean() { rm -rf "$work/device" "$work/c.zip" "$work/unzipped"; settle; }
check_installed() { cmp -s "$work/device/bench.fetch/1.0/Contents/payload.bin" "$work/content-bench.fetch/payload.bin" || { echo "iap-fetch installed wrong bytes" >&2; exit 1; }; }
measure_transfer() { # connections
  local c=$1 t setup
  "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > "$work/tx.jws"
  clean
  read -r t setup <<< "$(transfer_time "$bin" "$base" "$work/tx.jws" "$work/device" "$c" ${fetch_extra[@]+"${fetch_extra[@]}"})"
  [ "$t" = fail ] && { echo "iap-fetch --connections $c failed" >&2; exit 1; }
  echo "run $run: iap-fetch transfer only, $c connection(s): $t s (set-up $setup s)" >&2
  check_installed
  if [ "$c" = 1 ]; then
    all_t1+=("$t"); all_setup+=("$setup"); all_t1_body+=("$(awk -v t="$t" -v s="$setup" 'BEGIN { printf "%.3f", t - s }')")
    awk -v s="$t" -v b="$best_t1" 'BEGIN { exit !(s < b) }' && best_t1=$t
  else all_t4+=("$t"); awk -v s="$t" -v b="$best_t4" 'BEGIN { exit !(s < b) }' && best_t4=$t; fi
  return 0
}
measure_curl() {
  local url secs kb
  "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > "$work/tx-curl.jws"
  url=$(grant_transaction "$work/tx-curl.jws")
  clean
  read -r secs kb <<< "$(timed curl -s -o "$work/c.zip" "$url")"
  all_curl+=("$secs")
  awk -v s="$secs" -v b="$best_curl" 'BEGIN { exit !(s < b) }' && { best_curl=$secs; curl_kb=$kb; }
  echo "run $run: curl -o: $secs s" >&2
}
measure_get() {
  local secs kb
  "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > "$work/tx.jws"
  clean
  read -r secs kb <<< "$(timed "$bin/iap-fetch" get --server "$base" --transaction "$work/tx.jws" --content-dir "$work/device" ${fetch_extra[@]+"${fetch_extra[@]}"})"
  check_installed
  all_fetch+=("$secs")
  awk -v s="$secs" -v b="$best_fetch" 'BEGIN { exit !(s < b) }' && { best_fetch=$secs; fetch_kb=$kb; }
  echo "run $run: iap-fetch get: $secs s" >&2
}
measure_pipeline() {
  local url start secs
  "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > "$work/tx-curl.jws"
  url=$(grant_transaction "$work/tx-curl.jws")
  clean
  start=$(date +%s.%N)
  curl -s -o "$work/c.zip" "$url" && sha256sum "$work/c.zip" >/dev/null && unzip -q "$work/c.zip" -d "$work/unzipped"
  secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }')
  all_pipeline+=("$secs")
  awk -v s="$secs" -v b="$best_curl_all" 'BEGIN { exit !(s < b) }' && best_curl_all=$secs
  echo "run $run: curl + sha256sum + unzip: $secs s" >&2
}
# Each pair runs back to back, its order flipped every round: whoever goes first after the
# previous pair's deletes meets the same page-cache state as often as the other.
for run in $(seq "$runs"); do
  if [ $((run % 2)) = 1 ]; then measure_curl; measure_transfer 1; measure_transfer 4
  else measure_transfer 4; measure_transfer 1; measure_curl; fi
  if [ $((run % 2)) = 1 ]; then measure_get; measure_pipeline; else measure_pipeline; measure_get; fi
done

# SIGKILL at ~50%: rate-limited so the kill lands mid-transfer.
# One transaction through `get` (the queue holds every purchase of the rounds above).
"$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.fetch > "$work/tx.jws"
clean
"$bin/iap-fetch" get --server "$base" --transaction "$work/tx.jws" --content-dir "$work/device" --limit-rate 400M ${fetch_extra[@]+"${fetch_extra[@]}"} >/dev/null 2>&1 &
fetch_pid=$!
journal=$(echo "$work"/device/.iap-fetch)
while kill -0 $fetch_pid 2>/dev/null; do
  partial=$(ls "$work"/device/.iap-fetch/*.partial 2>/dev/null | head -1 || true)
  [ -n "$partial" ] && [ "$(stat -c %s "$partial")" -ge $((size / 2)) ] && break
  sleep 0.01
done
kill -9 $fetch_pid; wait $fetch_pid 2>/dev/null || true
on_disk=$(stat -c %s "$partial")
synced=$(python3 -c 'import json,glob,sys; print(json.load(open([p for p in glob.glob(sys.argv[1] + "/*.json") if not p.endswith(".manifest.json")][0]))["recordedLength"])' "$journal")
"$bin/iap-fetch" get --server "$base" --transaction "$work/tx.jws" --content-dir "$work/device" ${fetch_extra[@]+"${fetch_extra[@]}"} >/dev/null
cmp -s "$work/device/bench.fetch/1.0/Contents/payload.bin" "$work/content-bench.fetch/payload.bin" && resumed=identical || resumed=DIFFERENT

echo "archive: $size bytes; $(nproc) cores; $runs rounds, medians (min-max)$([ "${TLS:-0}" = 1 ] && echo "; over HTTPS (nginx terminates TLS and serves the archive)")"
row() { # label values...
  local label=$1; shift
  printf '%-58s %8.2f  (%s)\n' "$label" "$(median_of "$@")" "$(spread_of "$@")"
}
printf '%-58s %8s  %s\n' "measure" "seconds" "(spread)"
row "iap-fetch get (download + SHA-256 + safe install)" "${all_fetch[@]}"
row "curl -o + sha256sum + unzip -q" "${all_pipeline[@]}"
row "curl -o (transfer only)" "${all_curl[@]}"
row "iap-fetch transfer only (bytes on disk + SHA-256), 1 conn" "${all_t1[@]}"
row "iap-fetch transfer only, --connections 4" "${all_t4[@]}"
row "  of the 1-conn transfer: set-up before the archive's head" "${all_setup[@]}"
# Each ratio with its 95% interval (ratio_interval, tools/lib.sh): round n of each side is a pair.
interval() { printf '%s\n' "${@:2:$1}" > "$work/a.col"; printf '%s\n' "${@:$(($1 + 2))}" > "$work/b.col"; ratio_interval "$work/a.col" "$work/b.col"; }
awk -v a="$(median_of "${all_t1[@]}")" -v b="$(median_of "${all_curl[@]}")" -v ci="$(interval "${#all_curl[@]}" "${all_curl[@]}" "${all_t1[@]}")" \
  'BEGIN { printf "transfer ratio, one connection, curl time / iap-fetch time (medians): %.2f, 95%% interval %s (goal >= 0.95)\n", b / a, ci }'
awk -v a="$(median_of "${all_t1_body[@]}")" -v b="$(median_of "${all_curl[@]}")" -v ci="$(interval "${#all_curl[@]}" "${all_curl[@]}" "${all_t1_body[@]}")" \
  'BEGIN { printf "  the same from the archive'"'"'s head on (grant, manifest, journal set-up left out, as curl'"'"'s measure leaves out its grant): %.2f, 95%% interval %s\n", b / a, ci }'
awk -v a="$(median_of "${all_t4[@]}")" -v b="$(median_of "${all_curl[@]}")" -v ci="$(interval "${#all_curl[@]}" "${all_curl[@]}" "${all_t4[@]}")" \
  'BEGIN { printf "transfer ratio, 4 connections (medians): %.2f, 95%% interval %s\n", b / a, ci }'
awk -v a="$(median_of "${all_fetch[@]}")" -v b="$(median_of "${all_pipeline[@]}")" -v ci="$(interval "${#all_pipeline[@]}" "${all_pipeline[@]}" "${all_fetch[@]}")" \
  'BEGIN { printf "end-to-end ratio, curl pipeline time / iap-fetch time (medians): %.2f, 95%% interval %s (above 1: iap-fetch faster)\n", b / a, ci }'
awk -v a="$best_t1" -v b="$best_curl" -v k="$fetch_kb" -v c="$curl_kb" \
  'BEGIN { printf "best of the rounds: one connection %.2f; peak memory iap-fetch %.1f MiB, curl %.1f MiB\n", b / a, k / 1024, c / 1024 }'
awk -v d="$on_disk" -v s="$synced" -v z="$size" 'BEGIN { printf "SIGKILL at %.0f%%: %d bytes on disk, %d synced in the journal: %.2f MiB fetched again\n", d * 100 / z, d, s, (d - s) / 1048576 }'
echo "resumed download installed $resumed bytes"

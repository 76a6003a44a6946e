#!/usr/bin/env bash
# What a replica's copy of an archive costs to serve, by how it was written: two replicas on one
# PostgreSQL catalog with archive folders of their own (peer fetch, README "Archives on several
# machines"); A receives a ~1 GiB archive by the admin API, B fetches it from A. Then 1 GiB
# downloads from each replica's own copy, alternated (who goes first flips every round): curl's
# MB/s and each replica's CPU seconds per GiB, medians (min-max), B against A as a ratio of medians
# and at the same speed (each side's rounds fitted, read at the median speed).
# Why: the page cache keeps a file in folios as large as the writes that made it, and sendfile
# looks every folio up again for each response; B's copy was written as AsyncHTTPClient handed the
# bytes over until GatheredWrites (docs/performance.md, twenty-fourth stop).
# LINK=<rate>: curl behind a veth link of that rate, as in tools/bench-serve.sh (needs root): the
# speed is the link's, so each replica's CPU is its own work, not a share of curl's.
# Usage: [ROUNDS=n] [SIZE=bytes] [LINK=rate] tools/bench-peer-copy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-21}
tools/install-deps.sh
. tools/lib.sh
build_release iap-server iap-pack iap-sandbox
work=$(mktemp -d); chmod 755 "$work"
link_ns=iap-peer-$$
cleanup() { kill $(jobs -p) 2>/dev/null || true; pg_scratch_cleanup; rm -rf "$work"; ip netns del "$link_ns" 2>/dev/null || true; }
trap cleanup EXIT
address=127.0.0.1
if [ -n "${LINK:-}" ]; then start_link "$LINK" "$link_ns"; address=0.0.0.0; fi
pg_scratch_init; pg_scratch_start
"$pgbin/psql" -h 127.0.0.1 -p "$pgport" -U iap -d postgres -qc "CREATE DATABASE peers"
database="postgres://iap@127.0.0.1:$pgport/peers?sslmode=disable"
bundle=com.example.bench
"$bin/iap-sandbox" init --dir "$work/sandbox" --bundle-id "$bundle" >/dev/null
archive=$(random_archive bench.peer "${SIZE:-$((1024 * 1024 * 1024 - 4096))}" "$work" "$work/out")
size=$(stat -c %s "$archive")
head -c 24 /dev/urandom | base64 > "$work/admin-token"; chmod 600 "$work/admin-token"
declare -A port pid
for replica in a b; do
  port[$replica]=$(free_port)
  LOG_LEVEL=error "$bin/iap-server" serve --data "$work/$replica" --bundle-id "$bundle" --trust-root "$work/sandbox/root.cer" \
    --environment sandbox --host "$address" --port "${port[$replica]}" --database "$database" --grant-keys "$work/keys.json" \
    --advertise-url "http://127.0.0.1:${port[$replica]}" --admin-token-file "$work/admin-token" --token-ttl 86400 > "$work/$replica.log" 2>&1 &
  pid[$replica]=$!
  for _ in $(seq 200); do curl -sf -o /dev/null "http://127.0.0.1:${port[$replica]}/healthz" && break; sleep 0.05; done
done
status=$(curl -s -o /dev/null -w '%{http_code}' -X PUT -T "$archive" -H "Authorization: Bearer $(cat "$work/admin-token")" "http://127.0.0.1:${port[a]}/v1/admin/archives")
[ "$status" = 201 ] || { echo "the upload to A answered $status: $(cat "$work/a.log")" >&2; exit 1; }
for _ in $(seq 1200); do ls "$work"/b/archives/*.zip >/dev/null 2>&1 && break; sleep 0.1; done
cmp "$work"/a/archives/*.zip "$work"/b/archives/*.zip || { echo "B has no copy of A's archive: $(cat "$work/b.log")" >&2; exit 1; }
base="http://127.0.0.1:${port[a]}"
path=$(grant_url "$work" bench.peer | sed -E 's#^http://[^/]+##')
declare -A url
for replica in a b; do
  url[$replica]=$(client_url "http://127.0.0.1:${port[$replica]}$path")
  got=$("${client[@]}" curl -s -o /dev/null -w '%{size_download}' "${url[$replica]}")
  [ "$got" = "$size" ] || { echo "replica $replica sent $got of $size bytes" >&2; exit 1; }
  : > "$work/$replica.dl"
done
echo "archive: $size bytes, uploaded to A, fetched by B; $rounds rounds, alternated${LINK:+; across a $LINK veth link from a network namespace}" >&2
for round in $(seq "$rounds"); do
  order="a b"; [ $((round % 2)) = 0 ] && order="b a"
  for replica in $order; do download "$size" "${url[$replica]}" "${pid[$replica]}" >> "$work/$replica.dl"; done
done
printf '\n%-28s %26s %28s\n' "replica (its own copy)" "MB/s (curl)" "server CPU s/GiB"
for replica in a b; do
  cut -d' ' -f1 "$work/$replica.dl" > "$work/$replica.speed"; cut -d' ' -f2 "$work/$replica.dl" > "$work/$replica.cpu"
  cut -d' ' -f1,2 "$work/$replica.dl" > "$work/$replica.fit"
  label=$([ "$replica" = a ] && echo "A (uploaded)" || echo "B (fetched from A)")
  printf '%-28s %26s %28s\n' "$label" "$(median < "$work/$replica.speed") ($(spread < "$work/$replica.speed"))" "$(median < "$work/$replica.cpu") ($(spread < "$work/$replica.cpu"))"
done
echo "B's CPU per GiB against A's: $(median_ratio "$work/b.cpu" "$work/a.cpu"); at the same speed $(matched_speed_ratio "$work/b.fit" "$work/a.fit")"

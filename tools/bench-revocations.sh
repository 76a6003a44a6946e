#!/usr/bin/env bash
# What a large ledger and catalog cost an idle server: every refund an app ever had stays in the
# revocation ledger, a publisher's catalog holds every version of every product, and each replica
# keeps up with what the others write (the revoked ids in memory, archives to fetch or delete).
# For each case, on SQLite and on PostgreSQL, one iap-server is started on a catalog holding that
# many revocations and versions and left idle for $IDLE seconds with the default
# --revocation-refresh (2 s); it reports the server's CPU seconds in that window, its resident
# memory, the CPU one /readyz costs it (mean of 20: balancers ask every few seconds), the same with one
# archive missing (a replica out of the balancer's set is still probed), and how long
# a refund posted to it takes to refuse the URL it granted (p50 of $REFUNDS), and its CPU seconds
# over $IDLE seconds while another writer (a replica, `iap-server reconcile`, notifications Apple
# retries after an outage) adds one revocation a second: each one moves the ledger's counter.
# Usage: tools/bench-revocations.sh [revocations:versions...]
#        (default 0:0 100000:0 1000000:0 0:25000; IDLE=20 REFUNDS=20)
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh
IDLE=${IDLE:-20} REFUNDS=${REFUNDS:-20}
cases=("$@"); [ ${#cases[@]} -gt 0 ] || cases=(0:0 100000:0 1000000:0 0:25000)
tools/install-deps.sh
build_release iap-server iap-pack iap-sandbox
work=$(mktemp -d); chmod 755 "$work"
trap pg_scratch_cleanup EXIT
pg_scratch_init
pg_scratch_start
psql_() { "$pgbin/psql" -h 127.0.0.1 -p "$pgport" -U iap -v ON_ERROR_STOP=1 -qAt "$@"; }

bundle=com.example.bench
"$bin/iap-sandbox" init --dir "$work/sandbox" --bundle-id "$bundle" >/dev/null
archive=$(random_archive bench.revocations 65536 "$work" "$work/out")

# serve <data> [args...]: starts the server in the background; sets $pid and $base.
serve() {
  local data=$1; shift
  rm -f "$work/port"
  "$bin/iap-server" serve --data "$data" --bundle-id "$bundle" --trust-root "$work/sandbox/root.cer" --environment sandbox \
    --port 0 --port-file "$work/port" "$@" > "$work/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do [ -s "$work/port" ] && break; sleep 0.05; done
  [ -s "$work/port" ] || { cat "$work/server.log" >&2; exit 1; }
  base="http://127.0.0.1:$(cat "$work/port")"
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_mib() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

# fill <backend> <data> <revocations> <versions> <archives>: that many revocations (16-digit ids,
# as Apple's, below the sandbox's, which start at 2000000000000001) and versions of other products,
# each with an archive file in <archives> of the size the catalog gives it (1,000 bytes, sparse: the
# catalog's size is what is measured). Of another size, the server would be unready and /readyz would
# look at every archive on every call, as it did here from the sixteenth stop to the thirty-sixth.
fill() {
  local sql=
  [ "$4" -gt 0 ] && python3 -c 'import sys; [open("%s/%064d.zip" % (sys.argv[1], i), "w").truncate(1000) for i in range(1, int(sys.argv[2]) + 1)]' "$5" "$4"
  case $1 in
  sqlite)
    [ "$3" -gt 0 ] && sql+="WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < $3)
      INSERT INTO revocations (transactionId, revokedAt) SELECT printf('%d', 1000000000000000 + i), '2026-01-01 00:00:00.000' FROM n;"
    [ "$4" -gt 0 ] && sql+="WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < $4)
      INSERT INTO versions (productId, contentVersion, sha256, size, contentLength, publishedAt)
      SELECT 'com.example.p' || i, '1.0', printf('%064d', i), 1000, 1000, '2026-01-01 00:00:00.000' FROM n;"
    [ -z "$sql" ] || sqlite3 "$2/catalog.sqlite" "$sql" ;;
  postgres)
    [ "$3" -gt 0 ] && sql+="INSERT INTO revocations (transaction_id, revoked_at) SELECT (1000000000000000 + i)::text, now() FROM generate_series(1, $3) i;"
    [ "$4" -gt 0 ] && sql+="INSERT INTO versions (product_id, content_version, sha256, size, content_length, published_at)
      SELECT 'com.example.p' || i, '1.0', lpad(i::text, 64, '0'), 1000, 1000, '2026-01-01 00:00:00+00' FROM generate_series(1, $4) i;"
    [ -z "$sql" ] || psql_ -d "$2" -c "$sql" ;;
  esac
}

# propagation: a purchase granted, refunded by notification, until its URL is refused (ms, p50).
propagation() {
  local times=()
  for _ in $(seq "$REFUNDS"); do
    local signed url id start
    signed=$("$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.revocations)
    url=$(curl -s -X POST "$base/v1/downloads" -d "{\"signedTransaction\":\"$signed\"}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["downloads"][0]["url"])')
    id=$("$bin/iap-sandbox" transactions --dir "$work/sandbox" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)[-1]["transactionId"])')
    start=$(date +%s%N)
    "$bin/iap-sandbox" refund --dir "$work/sandbox" "$id" --notify "$base/v1/notifications" >/dev/null
    until [ "$(curl -s -o /dev/null -w '%{http_code}' -r 0-0 "$url")" = 403 ]; do :; done
    times+=($(( ($(date +%s%N) - start) / 1000000 )))
  done
  printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'
}

echo "idle ${IDLE}s per measure, --revocation-refresh 2 s; $(nproc) cores" >&2
printf '%-9s %12s %9s %12s %9s %14s %16s %17s %13s\n' backend revocations versions "idle CPU, s" "RSS, MiB" "readyz CPU, ms" "unready, ms" "refund → 403, ms" "storm CPU, s"
n=0
for backend in sqlite postgres; do
  for case in "${cases[@]}"; do
    revocations=${case%%:*} versions=${case##*:} n=$((n + 1))
    data="$work/data-$n"; args=(); db=
    if [ "$backend" = postgres ]; then
      db="bench$n"; psql_ -d postgres -c "CREATE DATABASE $db"; args=(--database "postgres://iap@127.0.0.1:$pgport/$db?sslmode=disable")
    fi
    serve "$data" "${args[@]}"; "$bin/iap-server" publish --data "$data" "${args[@]}" "$archive" >/dev/null; stop
    fill "$backend" "${db:-$data}" "$revocations" "$versions" "$data/archives"
    serve "$data" "${args[@]}"
    until curl -s -o /dev/null "$base/healthz"; do sleep 0.1; done
    sleep 3
    before=$(cpu_ticks "$pid")
    sleep "$IDLE"
    idle=$(awk -v t=$(( $(cpu_ticks "$pid") - before )) -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.2f", t / hz}')
    rss=$(rss_mib "$pid")
    ready=$(curl -s -w ' %{http_code}' "$base/readyz")
    [ "${ready##* }" = 200 ] || { echo "set-up failed: /readyz answered $ready" >&2; exit 1; }
    before=$(cpu_ticks "$pid")
    for _ in $(seq 20); do curl -s -o /dev/null "$base/readyz"; done
    readyz=$(awk -v t=$(( $(cpu_ticks "$pid") - before )) -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.1f", t / hz * 1000 / 20}')
    # The same while one archive is missing (a replica its balancer took out, probed all the same):
    # the newest, which a kept "ready" looks at each time.
    gone="$data/archives/$(sha256sum "$archive" | cut -c1-64).zip"; mv "$gone" "$gone.away"
    ready=$(curl -s -o /dev/null -w '%{http_code}' "$base/readyz")
    [ "$ready" = 503 ] || { echo "set-up failed: /readyz answered $ready with an archive missing" >&2; exit 1; }
    before=$(cpu_ticks "$pid")
    for _ in $(seq 20); do curl -s -o /dev/null "$base/readyz"; done
    unready=$(awk -v t=$(( $(cpu_ticks "$pid") - before )) -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.1f", t / hz * 1000 / 20}')
    mv "$gone.away" "$gone"
    p50=$(propagation)
    before=$(cpu_ticks "$pid")
    for i in $(seq "$IDLE"); do
      case $backend in
      sqlite) sqlite3 -cmd '.timeout 10000' "$data/catalog.sqlite" "INSERT INTO revocations (transactionId, revokedAt) VALUES ('$((3000000000000000 + i))', '2026-01-01 00:00:00.000')" ;;
      postgres) psql_ -d "$db" -c "INSERT INTO revocations (transaction_id, revoked_at) VALUES ('$((3000000000000000 + i))', now())" ;;
      esac
      sleep 1
    done
    storm=$(awk -v t=$(( $(cpu_ticks "$pid") - before )) -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.2f", t / hz}')
    stop
    printf '%-9s %12s %9s %12s %9s %14s %16s %17s %13s\n' "$backend" "$revocations" "$versions" "$idle" "$rss" "$readyz" "$unready" "$p50" "$storm"
  done
done

#!/usr/bin/env bash
# How soon a replica is ready again after PostgreSQL was away: for each outage length (seconds),
# the database is stopped that long and started again, and the time from its start until the
# replica's /readyz answers 200 is reported (ROUNDS times each: median and spread).
# PostgresNIO's pool retries on a backoff that grows with the outage, to at most a minute; the
# catalog's PoolKeeper replaces a pool still waiting once the database answers again.
# Usage: tools/bench-reconnect.sh [outage seconds...]   (default 10 30 60 120; ROUNDS=1)
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh
ROUNDS=${ROUNDS:-1}
outages=("$@"); [ ${#outages[@]} -gt 0 ] || outages=(10 30 60 120)
tools/install-deps.sh
build_release iap-server
work=$(mktemp -d); chmod 755 "$work"
trap pg_scratch_cleanup EXIT
pg_scratch_init
pg_scratch_start
LOG_LEVEL=error "$bin/iap-server" serve --data "$work/data" --bundle-id com.example.bench --port 0 --port-file "$work/port" \
  --database "postgres://iap@127.0.0.1:$pgport/postgres?sslmode=disable" > "$work/server.log" 2>&1 &
for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.05; done
ready="http://127.0.0.1:$(cat "$work/port")/readyz"
status() { curl -s -o /dev/null -w '%{http_code}' "$ready"; }
for _ in $(seq 100); do [ "$(status)" = 200 ] && break; sleep 0.1; done

printf '%-10s %s\n' "outage" "ready after the database is back: median (min-max), $ROUNDS round(s)"
for outage in "${outages[@]}"; do
  times=()
  for _ in $(seq "$ROUNDS"); do
    pgctl -m fast stop
    sleep "$outage"
    pg_scratch_start
    t0=$(date +%s.%N)
    until [ "$(status)" = 200 ]; do sleep 0.05; done
    times+=("$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { print a - b }')")
  done
  sorted=($(printf '%s\n' "${times[@]}" | sort -g))
  printf '%-10s %.2f s (%.2f-%.2f)\n' "${outage} s" "${sorted[$(( ${#sorted[@]} / 2 ))]}" "${sorted[0]}" "${sorted[-1]}"
done

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
pgbin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
as_pg=(); [ "$(id -u)" -eq 0 ] && as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups) && mkdir -p "$work/pg" && chown postgres "$work/pg"
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  "${as_pg[@]}" "$pgbin/pg_ctl" -D "$work/pg/db" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
pgport=$(free_port)
pgctl() { "${as_pg[@]}" "$pgbin/pg_ctl" -D "$work/pg/db" -l "$work/pg/log" -w "$@" >/dev/null; }
"${as_pg[@]}" "$pgbin/initdb" -D "$work/pg/db" -U iap --auth=trust -E UTF8 >/dev/null
start_db() { pgctl -o "-p $pgport -k $work/pg -c listen_addresses=127.0.0.1" start; }
start_db
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
    start_db
    t0=$(date +%s.%N)
    until [ "$(status)" = 200 ]; do sleep 0.05; done
    times+=("$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { print a - b }')")
  done
  sorted=($(printf '%s\n' "${times[@]}" | sort -g))
  printf '%-10s %.2f s (%.2f-%.2f)\n' "${outage} s" "${sorted[$(( ${#sorted[@]} / 2 ))]}" "${sorted[0]}" "${sorted[-1]}"
done

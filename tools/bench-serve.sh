#!/usr/bin/env bash
# Serving benchmark: iap-server against nginx (sendfile on) on the same ~1 GiB archive, in one run.
# Reports 1 GiB download throughput with curl, server CPU seconds per GiB served and the whole machine's (alternated,
# medians of the rounds), and wrk
# requests/s and p99 latency for 4 KiB and 1 MiB ranges, 16 x 64 KiB multi-range requests and 4 KiB
# ranges on a new connection each, at 16 and 64 connections. iap-server
# checks a grant token (HMAC + revocation) on every request; nginx serves a plain file.
# Range measures alternate the servers over several rounds (default 7) and report the ratio of
# medians, each median with its spread (min-max): what a user sees on a typical run, and a 95%
# interval for the ratio (tools/lib.sh, ratio_interval): a ratio whose interval holds 1 is no
# difference these rounds can tell.
# Whole downloads take well under a second each and vary most from round to round (2:1), so they get
# fifteen times as many rounds (DOWNLOAD_ROUNDS to choose): with 35, the 95% interval of a ratio
# was about +-15%; 200 rounds narrowed it to about +-4% (docs/performance.md, tenth stop).
# IAP_EVENT_LOOPS=n runs iap-server with n event loops (`--event-loops`) instead of one per core;
# nginx keeps its two workers.
# LINK=<rate> (tc's units: 4gbit) measures the whole downloads only, with curl on the other end of
# a link: in a network namespace of its own behind a veth pair (MTU 1500) whose server end sends
# at most <rate> (tbf). On loopback curl shares the sending with the server, and who does how much
# of it moves from round to round (docs/performance.md, ninth stop); across a link that the
# servers can fill, each does its own sending and the link sets the speed, as in production,
# where the client is another machine. Needs root (ip netns, tc).
# Congestion control: on a machine whose choice is BBR without the fq qdisc, the kernel paces every
# loopback segment with timers, and their work is most of a loopback download's CPU figure. Each
# server runs on its defaults: iap-server gives the connections that cross no link cubic, nginx
# keeps the system's (the header line says which). SERVER_ARGS="--loopback-congestion-control system"
# puts iap-server on the system's too; `sysctl net.ipv4.tcp_congestion_control=cubic` for the run
# puts both on cubic (docs/performance.md, forty-third and forty-fourth stops).
# MEASURES picks the range measures (default all four: "4k 1m multi fresh"); DOWNLOAD_ROUNDS=0 skips
# the whole downloads: `DOWNLOAD_ROUNDS=0 MEASURES=4k tools/bench-serve.sh 3 21` looks at small
# ranges alone over more rounds. CONNECTIONS picks the wrk connection counts (default "16 64"; 1 is
# one client asking one request at a time, each answer's latency in full).
# Usage: [DOWNLOAD_ROUNDS=n] [MEASURES="4k 1m multi fresh"] [CONNECTIONS="16 64"] [IAP_EVENT_LOOPS=n] [LINK=rate] tools/bench-serve.sh [seconds-per-wrk-run] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
rounds=${2:-7}
download_rounds=${DOWNLOAD_ROUNDS:-$((15 * rounds))}
for name in ${MEASURES:-}; do
  case $name in 4k | 1m | multi | fresh) ;; *) echo "MEASURES: unknown measure '$name'; use any of: 4k 1m multi fresh" >&2; exit 2 ;; esac
done
for c in ${CONNECTIONS:-}; do
  [[ $c =~ ^[1-9][0-9]*$ ]] || { echo "CONNECTIONS: '$c' is not a connection count; use whole numbers, as \"1 16 64\"" >&2; exit 2; }
done
tools/install-deps.sh
command -v nginx >/dev/null && command -v wrk >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light wrk >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx wrk >/dev/null; }
. tools/lib.sh
build_release iap-server iap-pack iap-sandbox
link_ns=iap-bench-$$
work=$(mktemp -d); chmod 755 "$work"; trap 'kill $(jobs -p) 2>/dev/null || true; [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid" 2>/dev/null)" 2>/dev/null || true; rm -rf "$work"; ip netns del "$link_ns" 2>/dev/null || true' EXIT
if [ -n "${LINK:-}" ]; then start_link "$LINK" "$link_ns"; fi

archive=$(random_archive bench.archive $((1024 * 1024 * 1024 - 4096)) "$work" "$work/out")
size=$(stat -c %s "$archive")
start_sandbox_server "$work" com.example.bench "$archive"
ours_pid=$server_pid
port=$(cat "$work/port")
ours_url=$(grant_url "$work" bench.archive)

# nginx serves the very file iap-server serves (a hard link to the store's copy): sendfile's cost
# depends on how the file's pages sit in the page cache (folio sizes follow the writes that made
# them), so two copies of the same bytes are not the same load.
stored=$(ls "$work"/data/archives/*.zip | head -1)
mkdir -p "$work/www"; ln "$stored" "$work/www/archive.zip"; chmod 755 "$work/www"; chmod 644 "$work/www/archive.zip"
# nginx's workers run as an unprivileged user: check they can read the file before measuring.
nginx_port=$(free_port)  # not port + 1: that one may be taken, and nginx then fails to start
start_nginx "$work" "server { listen 127.0.0.1:$nginx_port; ${LINK:+listen 10.231.0.1:$nginx_port;} root $work/www; }"
nginx_url="http://127.0.0.1:$nginx_port/archive.zip"
ours_url=$(client_url "$ours_url"); nginx_url=$(client_url "$nginx_url")
for url in "$ours_url" "$nginx_url"; do
  code=$("${client[@]}" curl -s -o /dev/null -r 0-99 -w '%{http_code}' "$url")
  [ "$code" = 206 ] || { echo "setup failed: $url answered $code to a range request" >&2; exit 1; }
done
echo "archive: $size bytes; $(nproc) cores; iap-server event loops: ${IAP_EVENT_LOOPS:-one per core}, nginx workers: 2; wrk ${secs}s per run, median of $rounds rounds; downloads: median of $download_rounds rounds${LINK:+, across a $LINK veth link from a network namespace}" >&2
echo "congestion control: nginx the system's ($(cat /proc/sys/net/ipv4/tcp_congestion_control)); iap-server ${SERVER_ARGS:-on its defaults} (its default: cubic on loopback)" >&2
# Runs two measures, the first one first in odd rounds: who goes first flips every round.
in_turn() { # round first second
  if [ $(($1 % 2)) = 1 ]; then "$2"; "$3"; else "$3"; "$2"; fi
}
ours_download() { download "$size" "$ours_url" $ours_pid >> "$work/ours.dl"; }
nginx_download() { download "$size" "$nginx_url" $(nginx_pids "$work") >> "$work/nginx.dl"; }
# Whole downloads alternate too: medians of $download_rounds each.
: > "$work/ours.dl"; : > "$work/nginx.dl"
for round in $(seq "$download_rounds"); do
  in_turn "$round" ours_download nginx_download
  echo "  1 GiB download, round $round: iap-server $(tail -1 "$work/ours.dl"), nginx $(tail -1 "$work/nginx.dl") (MB/s; server, machine and rest-of-machine CPU-s/GiB)" >&2
done

wrk_run() { # url range connections [fresh] -> "req/s p99ms"; fresh: a new connection for every request
  wrk -t"$(($3 < 2 ? 1 : 2))" -c"$3" -d"${secs}s" --latency -H "Range: bytes=$2" ${4:+-H "Connection: close"} "$1" 2>/dev/null | awk '
    /Requests\/sec/ { rps = $2 }
    $1 == "99%" { v = $2; if (v ~ /us$/) { sub(/us/, "", v); v /= 1000 } else if (v ~ /ms$/) { sub(/ms/, "", v) } else if (v ~ /s$/) { sub(/s/, "", v); v *= 1000 }; p99 = v }
    END { printf "%s %s", rps, p99 }'
}
# One wrk run of the current $range and $c against each server, appended to its runs.
ours_wrk() { wrk_run "$ours_url" "$range" "$c" "$fresh" >> "$work/ours.runs"; echo >> "$work/ours.runs"; }
nginx_wrk() { wrk_run "$nginx_url" "$range" "$c" "$fresh" >> "$work/nginx.runs"; echo >> "$work/nginx.runs"; }
printf '\n%-34s %24s %24s %8s %11s\n' "measure" "iap-server" "nginx" "ratio" "95% interval"
# The interval column: where the ratio of medians of these rounds could lie (ratio_interval).
for column in 1 2 3 4; do
  [ "$download_rounds" -gt 0 ] || break
  cut -d' ' -f$column "$work/ours.dl" > "$work/ours.col"; cut -d' ' -f$column "$work/nginx.dl" > "$work/nginx.col"
  om=$(median < "$work/ours.col"); nm=$(median < "$work/nginx.col"); os=$(spread < "$work/ours.col"); ns=$(spread < "$work/nginx.col")
  ci=$(ratio_interval "$work/ours.col" "$work/nginx.col")
  label="1 GiB download, MB/s (curl)"; [ $column = 2 ] && label="server CPU seconds per GiB"; [ $column = 3 ] && label="machine CPU seconds per GiB"
  [ $column = 4 ] && label="  rest of machine (client, etc.)"
  awk -v l="$label" -v o="$om" -v n="$nm" -v a="$os" -v b="$ns" -v ci="$ci" 'BEGIN { printf "%-34s %24s %24s %8.2f %11s\n", l, o " (" a ")", n " (" b ")", (n > 0 ? o/n : 0), ci }'
done
if [ -z "${LINK:-}" ] && [ "$download_rounds" -gt 0 ]; then
  # The same CPU at the same speed: each server's rounds fitted against their speed (lib.sh).
  cut -d' ' -f1,2 "$work/ours.dl" > "$work/ours.fit"; cut -d' ' -f1,2 "$work/nginx.dl" > "$work/nginx.fit"
  echo "  server CPU per GiB at the same speed (each server's rounds fitted): $(matched_speed_ratio "$work/ours.fit" "$work/nginx.fit")"
  echo "  (on loopback the server is charged the part of curl's receiving that runs in its context, which"
  echo "   moves with the speed from round to round: compare the machine's CPU here, and the server's own"
  echo "   across a link, where each side does its own work: LINK=4gbit DOWNLOAD_ROUNDS=35 $0;"
  echo "   tools/bench-cork.sh moves that share threefold with one socket option, for less work in all)"
fi
# Each range measure alternates the two servers $rounds times and compares medians: single runs on
# a shared 2-core machine vary by about 10%, more than the differences being measured.
# The third: 16 ranges of 64 KiB 1 MiB apart in one request, as a delta update's entries
# (multipart/byteranges, one response per request).
if [ -n "${LINK:-}" ]; then
  echo; echo "server RSS after the run: $(awk '/VmHWM/ {print $2/1024 " MiB peak"}' /proc/$ours_pid/status)"
  exit 0
fi
multi=$(seq 0 15 | awk '{ printf "%s%d-%d", (NR > 1 ? "," : ""), $1 * 1048576, $1 * 1048576 + 65535 }')
# The fourth: 4 KiB ranges with a new connection for each (`Connection: close`), as from clients
# that do not keep connections open: the cost of accepting and closing one.
measures=()
for name in ${MEASURES:-4k 1m multi fresh}; do
  case $name in
    4k) measures+=("0-4095") ;;
    1m) measures+=("0-1048575") ;;
    multi) measures+=("$multi") ;;
    fresh) measures+=("fresh:0-4095") ;;
  esac
done
for measure in "${measures[@]}"; do
  range=${measure#fresh:}; fresh=; [ "$range" = "$measure" ] || fresh=1
  for c in ${CONNECTIONS:-16 64}; do
    : > "$work/ours.runs"; : > "$work/nginx.runs"
    for round in $(seq "$rounds"); do
      in_turn "$round" ours_wrk nginx_wrk
      echo "  range ${range:0:20}${fresh:+ (new connections)}, $c conns, round $round: iap-server $(tail -1 "$work/ours.runs"), nginx $(tail -1 "$work/nginx.runs") (req/s p99-ms)" >&2
    done
    # Column 1 req/s, column 2 p99 ms, one file per server and column.
    for column in 1 2; do cut -d' ' -f$column "$work/ours.runs" > "$work/ours.col$column"; cut -d' ' -f$column "$work/nginx.runs" > "$work/nginx.col$column"; done
    ors=$(median < "$work/ours.col1"); op=$(median < "$work/ours.col2"); nrs=$(median < "$work/nginx.col1"); np=$(median < "$work/nginx.col2")
    orr=$(awk '{ printf "%.0f\n", $1 }' "$work/ours.col1" | spread); nrr=$(awk '{ printf "%.0f\n", $1 }' "$work/nginx.col1" | spread)
    opr=$(spread < "$work/ours.col2"); npr=$(spread < "$work/nginx.col2")
    label="range $range, $c conns"
    [ "$range" = "$multi" ] && label="16 x 64 KiB ranges, $c conns"
    [ -n "$fresh" ] && label="range $range, new conn each, $c"
    rci=$(ratio_interval "$work/ours.col1" "$work/nginx.col1"); pci=$(ratio_interval "$work/ours.col2" "$work/nginx.col2")
    awk -v l="$label" -v o="$ors" -v n="$nrs" -v a="$orr" -v b="$nrr" -v ci="$rci" 'BEGIN { printf "%-34s %24s %24s %8.2f %11s\n", l " req/s", sprintf("%.0f (%s)", o, a), sprintf("%.0f (%s)", n, b), o/n, ci }'
    awk -v l="$label" -v o="$op" -v n="$np" -v a="$opr" -v b="$npr" -v ci="$pci" 'BEGIN { printf "%-34s %24s %24s %8.2f %11s\n", l " p99 ms", sprintf("%.2f (%s)", o, a), sprintf("%.2f (%s)", n, b), (n > 0 ? o/n : 0), ci }'
  done
done
echo; echo "server RSS after the run: $(awk '/VmHWM/ {print $2/1024 " MiB peak"}' /proc/$ours_pid/status)"

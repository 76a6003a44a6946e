# Shared steps of the demo and the benchmarks: source it (`. tools/lib.sh`) from the repository root.

# Builds the given products in release mode and sets $bin to where they are.
build_release() {
  for product in "$@"; do swift build -c release --product "$product" 2>&1 | tail -1 >&2; done
  bin=$(swift build -c release --show-bin-path)
}

# Packs <size> random bytes as payload.bin of <product> 1.0, stored (level 0), into <out>; prints the archive's path.
random_archive() { # product size work out
  mkdir -p "$3/content-$1"
  head -c "$2" /dev/urandom > "$3/content-$1/payload.bin"
  "$bin/iap-pack" build "$3/content-$1" --product-id "$1" --content-version 1.0 --level 0 -o "$4" >/dev/null
  echo "$4/$1-1.0.zip"
}

# Creates a sandbox store in <work>/sandbox for <bundle>, publishes <archive>s into <work>/data,
# starts iap-server on a free port trusting the sandbox, and sets $server_pid and $base.
# SERVER_ARGS: more options for `iap-server serve` (word-split), e.g. --public-url.
start_sandbox_server() { # work bundle archive...
  local work=$1 bundle=$2; shift 2
  "$bin/iap-sandbox" init --dir "$work/sandbox" --bundle-id "$bundle" >/dev/null
  for archive in "$@"; do "$bin/iap-server" publish --data "$work/data" "$archive" >/dev/null; done
  serve_sandbox "$bin/iap-server" "$work" "$work/data" "$bundle" ""
}

# serve_sandbox <iap-server binary> <work> <data> <bundle> <tag>: that build serving <data>, trusting
# the sandbox of <work>; its port and log are <work>/port<tag> and <work>/server<tag>.log.
# Sets server_pid and base.
serve_sandbox() {
  local server=$1 work=$2 data=$3 bundle=$4 tag=$5
  LOG_LEVEL=${LOG_LEVEL:-error} "$server" serve --data "$data" --bundle-id "$bundle" --trust-root "$work/sandbox/root.cer" \
    --environment sandbox --port 0 --port-file "$work/port$tag" --token-ttl 86400 ${SERVER_ARGS:-} > "$work/server$tag.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 200); do [ -s "$work/port$tag" ] && break; sleep 0.05; done
  [ -s "$work/port$tag" ] || { echo "$server did not start: $(cat "$work/server$tag.log")" >&2; return 1; }
  base="http://127.0.0.1:$(cat "$work/port$tag")"
}

# Prints the download URL the server grants for the signed transaction in <file>.
grant_transaction() { # file
  curl -s -X POST "$base/v1/downloads" -d "{\"signedTransaction\":\"$(cat "$1")\"}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["downloads"][0]["url"])'
}

# Buys <product> in the sandbox of <work> and prints the download URL the server grants for it.
grant_url() { # work product
  "$bin/iap-sandbox" purchase --dir "$1/sandbox" --product-id "$2" > "$1/granted.jws"
  grant_transaction "$1/granted.jws"
}

# The client benchmarks' set-up: the release tools, a random archive of $SIZE bytes (default just
# under 1 GiB) published on a sandbox server in a temporary folder removed on exit.
# Sets bin, work, archive, base and server_pid.
fetch_bench_setup() {
  build_release iap-server iap-pack iap-sandbox iap-fetch
  work=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
  archive=$(random_archive bench.fetch "${SIZE:-$((1024 * 1024 * 1024 - 4096))}" "$work" "$work/out")
  start_sandbox_server "$work" com.example.bench "$archive"
}

# The packing benchmarks' corpus (tools/make-corpus.py) in <dir>/Contents at <scale>, made once.
bench_corpus() { # dir scale
  [ -f "$1/.complete-$2" ] && return
  echo "generating corpus in $1 (scale $2)..." >&2
  rm -rf "$1"; mkdir -p "$1/Contents"
  python3 tools/make-corpus.py "$1/Contents" "$2"
  touch "$1/.complete-$2"
}

# The median and the spread (min-max) of one number per line on standard input: every benchmark
# reports both, the median as what a user sees on a typical run.
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
spread() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%s-%s", lo, hi }'; }

# Whole downloads, as tools/bench-serve.sh and tools/bench-cork.sh measure them.
# start_link <rate> <namespace>: curl goes behind a link: a network namespace of its own behind a
# veth pair (MTU 1500) whose server end sends at most <rate> (tc's units: 4gbit; tbf). Sets
# `client` (the command prefix that runs curl there) and adds `--host 0.0.0.0` to SERVER_ARGS;
# 10.231.0.1 is the servers' end. Needs root; delete the namespace in the EXIT trap
# (`ip netns del`), which deletes the pair. Without a link, `client` is empty.
client=()
start_link() { # rate namespace [queue latency, 5ms]
  ip netns add "$2"
  ip link add iapb0 type veth peer name iapb1 netns "$2"
  ip addr add 10.231.0.1/30 dev iapb0; ip link set iapb0 up
  ip netns exec "$2" ip addr add 10.231.0.2/30 dev iapb1
  ip netns exec "$2" ip link set iapb1 up; ip netns exec "$2" ip link set lo up
  # The bucket holds a millisecond at the rate (at least 64 KiB): the link's burst, not a queue.
  local burst
  burst=$(python3 -c 'import re,sys; v,u=re.fullmatch(r"([0-9.]+)([kmg]?)bit",sys.argv[1].lower()).groups(); print(max(65536, int(float(v)*{"":1,"k":1e3,"m":1e6,"g":1e9}[u]/8/1000)))' "$1")
  tc qdisc add dev iapb0 root tbf rate "$1" burst "$burst" latency "${3:-5ms}"
  client=(ip netns exec "$2")
  export SERVER_ARGS="${SERVER_ARGS:-} --host 0.0.0.0"
}
# The URL curl is given: across the link when there is one.
client_url() { if [ ${#client[@]} -gt 0 ]; then echo "$1" | sed -E 's#^http://[^/]+:([0-9]+)/#http://10.231.0.1:\1/#'; else echo "$1"; fi; }
# Nanoseconds on CPU of every thread of the processes (schedstat): clock ticks are 10 ms, and a
# 1 GiB download takes 15-20 of them, too coarse for a ratio.
# Read with builtins: a process forked per thread would be charged to the machine's total, and
# iap-server has more threads than nginx has processes.
cpu_ns() { local t=0 f v; for p in "$@"; do for f in /proc/"$p"/task/*/schedstat; do read -r v _ < "$f"; t=$((t + v)); done; done; echo $t; }
# CPU the whole machine was busy (every core, every process, interrupts included), in clock
# ticks. On loopback one connection's work is charged to whichever task runs it: when the server
# has queued more than curl's window takes, curl's window updates run the server's transmissions
# in curl's context, and curl then never sleeps; the server's share and the speed move together,
# from round to round, while their sum stays (docs/performance.md, ninth stop). This total does
# not depend on who was charged; "rest of machine" is it less the server's share.
machine_ticks() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 }' /proc/stat; }  # user nice system irq softirq
# One curl download of <url> (<size> bytes) -> "MB/s, server, machine and rest-of-machine CPU
# seconds per GiB", the server being the processes <pids>.
download() { # size url pids...
  local size=$1 url=$2; shift 2
  local before machine_before speed machine_after after
  before=$(cpu_ns "$@"); machine_before=$(machine_ticks)
  speed=$("${client[@]}" curl -s -o /dev/null -w '%{speed_download}' "$url")
  machine_after=$(machine_ticks); after=$(cpu_ns "$@")  # the machine's window holds curl only
  awk -v s="$speed" -v a="$after" -v b="$before" -v z="$size" -v ma="$machine_after" -v mb="$machine_before" -v hz="$(getconf CLK_TCK)" \
    'BEGIN { g = z / 1073741824; sv = (a - b) / 1e9 / g; m = (ma - mb) / hz / g; printf "%.1f %.4f %.4f %.4f\n", s / 1e6, sv, m, m - sv }'
}

# A port free on 127.0.0.1 now (the kernel's pick), for a peer server that takes a port number.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# How far a ratio of medians can be trusted: a 95% bootstrap interval of median(<a>)/median(<b>),
# files of one number per round, line n of each from the same alternated round (resampled as
# pairs, 4,000 times, fixed seed). With a few rounds whose spread is 2:1, a ratio of 0.96 and one
# of 1.04 can be the same two servers: the interval says when a difference is real (it excludes 1).
ratio_interval() { # a b -> "lo-hi"
  python3 - "$1" "$2" <<'PY'
import random, statistics, sys
a = [float(x) for x in open(sys.argv[1]) if x.strip()]
b = [float(x) for x in open(sys.argv[2]) if x.strip()]
n = min(len(a), len(b))
rng = random.Random(1)
ratios = []
for _ in range(4000):
    picks = [rng.randrange(n) for _ in range(n)]
    mb = statistics.median(b[i] for i in picks)
    if mb > 0: ratios.append(statistics.median(a[i] for i in picks) / mb)
ratios.sort()
print(f"{ratios[int(0.025 * len(ratios))]:.2f}-{ratios[int(0.975 * len(ratios)) - 1]:.2f}" if ratios else "-")
PY
}

# The headline of a comparison: median(<a>)/median(<b>) with its 95% interval, "r.rr (lo-hi)";
# files of one number per round, as ratio_interval's.
median_ratio() { # a b -> "ratio (lo-hi)"
  echo "$(awk -v a="$(median < "$1")" -v b="$(median < "$2")" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }') ($(ratio_interval "$1" "$2"))"
}

# The ratio of two servers' CPU at the same speed, for loopback downloads, where a round's CPU
# follows its speed (docs/performance.md, ninth stop): each server's rounds fitted by least squares
# (CPU against speed), both fits read at the median speed of all rounds. Prints "ratio lo-hi" (the
# interval as ratio_interval's, the rounds resampled as pairs) and the speed it was read at.
matched_speed_ratio() { # a b -> "ratio (lo-hi) at <speed> MB/s"; files of "speed cpu" lines
  python3 - "$1" "$2" <<'PY'
import random, statistics, sys
def rows(path): return [tuple(map(float, line.split()[:2])) for line in open(path) if line.strip()]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
n = min(len(a), len(b))
def at(points, speed):
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my + slope * (speed - mx)
def ratio(picks):
    pa, pb = [a[i] for i in picks], [b[i] for i in picks]
    speed = statistics.median([p[0] for p in pa + pb])
    cb = at(pb, speed)
    return at(pa, speed) / cb if cb > 0 else None, speed
if n < 3:
    print("-"); sys.exit()
value, speed = ratio(range(n))
rng = random.Random(1)
rs = sorted(r for r in (ratio([rng.randrange(n) for _ in range(n)])[0] for _ in range(2000)) if r is not None)
print(f"{value:.2f} ({rs[int(0.025 * len(rs))]:.2f}-{rs[int(0.975 * len(rs)) - 1]:.2f}) at {speed:.0f} MB/s")
PY
}

# nginx in <work> as the benchmarks' peer: two workers, sendfile and keep-alive as a tuned site has
# them, no access log, with <server> as its server block; returns once its pid file is written.
# Stop it with: kill "$(cat "$work/nginx.pid")" (in the caller's EXIT trap).
start_nginx() { # work server-block
  cat > "$1/nginx.conf" <<CONF
worker_processes 2;
daemon off;
pid $1/nginx.pid;
error_log $1/nginx-error.log;
events { worker_connections 4096; }
http {
  sendfile on; tcp_nopush on; access_log off; keepalive_requests 1000000;
  types { application/zip zip; }
  $2
}
CONF
  nginx -c "$1/nginx.conf" -p "$1" &
  for _ in $(seq 200); do [ -s "$1/nginx.pid" ] && break; sleep 0.05; done
}
# The processes of the nginx started in <prefix> (its master and workers), for download's CPU.
nginx_pids() { echo "$(cat "$1/nginx.pid") $(pgrep -P "$(cat "$1/nginx.pid")" | tr '\n' ' ')"; }

# A scratch PostgreSQL cluster in $work/pg for the benchmarks that need one: user iap, trust
# authentication, on 127.0.0.1:$pgport; run as the postgres user when the script runs as root.
# pg_scratch_init sets pgbin, as_pg and pgport and creates the cluster; pgctl runs pg_ctl on it.
pg_scratch_init() {
  pgbin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  as_pg=()
  if [ "$(id -u)" -eq 0 ]; then as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups); mkdir -p "$work/pg"; chown postgres "$work/pg"; fi
  pgport=$(free_port)
  "${as_pg[@]}" "$pgbin/initdb" -D "$work/pg/db" -U iap --auth=trust -E UTF8 >/dev/null
}
pgctl() { "${as_pg[@]}" "$pgbin/pg_ctl" -D "$work/pg/db" -l "$work/pg/log" -w "$@" >/dev/null; }
pg_scratch_start() { pgctl -o "-p $pgport -k $work/pg -c listen_addresses=127.0.0.1" start; }
# The EXIT trap of a benchmark with a scratch cluster: its background jobs, the cluster, $work.
pg_scratch_cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  pg_scratch_stop
  rm -rf "$work"
}
# Stops the cluster if it runs, whatever state the script reached.
pg_scratch_stop() { [ -n "${pgbin:-}" ] && "${as_pg[@]}" "$pgbin/pg_ctl" -D "$work/pg/db" -m immediate stop >/dev/null 2>&1 || true; }

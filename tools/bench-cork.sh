#!/usr/bin/env bash
# What a whole download's CPU figures say, measured: iap-server, nginx, and iap-server's sending loop
# alone in C (tools/sendloop/sendloop.c: FileSender's epoll loop and 2 MiB sendfile turns, nothing
# else), by default twice, corked until the body has left (as iap-server and nginx send a file) and
# uncorked after its first turn, all on one ~1 GiB file, rotated (each round starts one later in
# the order). Per server: medians (min-max) of curl's MB/s, the server's CPU seconds per GiB and the
# whole machine's; then each against nginx, ratios of medians with their 95% intervals, and the
# server's CPU at the same speed (each server's rounds fitted, read at the median speed of both:
# meaningful where their speeds overlap, not for the uncorked loop at twice nginx's speed).
# Why: on loopback a download's kernel work is charged to whichever side's context runs it, so the
# server's share there can move without the server doing more or less work. The two C loops differ
# in one socket option: across a link (LINK=4gbit) they cost the same; on loopback the uncorked one
# was charged several times the CPU for a faster download and less work in all on the VM type of
# the twenty-third stop, and on the later one (kernel 6.18) it is slower and costs more in all
# (docs/performance.md, twenty-third and thirty-fifth stops); a faster round is charged more
# whatever sends it (twenty-fourth stop).
# LOOPS: the C loops to run, each <corked|uncorked>[:<turn KiB>[:level|edge|blocking]] (sendloop.c), e.g.
#   LOOPS="corked corked:8192 corked:2048:edge"; default "corked uncorked"; LOOPS= runs none.
# NGINXES=<n>: n nginx servers (default 1), each its own master and workers on the same file; the
#   second and later, named nginx-2, ..., are read against the first like any other server: how far
#   apart two runs of the same sender read, in the same rotation (the measure's own noise).
# ALSO="<iap-server binary> ...": other builds of iap-server in the same rotation (a change against
#   the shipped code: copy .build/release/iap-server aside, build the change, name the copy here).
# LINK=<rate>: curl behind a veth link of that rate, as in tools/bench-serve.sh (needs root).
# Usage: [ROUNDS=n] [LOOPS=...] [ALSO=...] [LINK=rate] tools/bench-cork.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-40}
tools/install-deps.sh
command -v nginx >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; }
. tools/lib.sh
build_release iap-server iap-pack iap-sandbox
link_ns=iap-cork-$$
work=$(mktemp -d); chmod 755 "$work"; trap 'kill $(jobs -p) 2>/dev/null || true; for p in "$work"/nginx.pid "$work"/nginx-*/nginx.pid; do [ -f "$p" ] && kill "$(cat "$p" 2>/dev/null)" 2>/dev/null || true; done; rm -rf "$work"; ip netns del "$link_ns" 2>/dev/null || true' EXIT
address=127.0.0.1
if [ -n "${LINK:-}" ]; then start_link "$LINK" "$link_ns"; address=0.0.0.0; fi
# The C compiler Debian's build tools or the Swift toolchain (clang) bring.
compiler=${CC:-$(command -v cc || command -v clang)}
"$compiler" -O2 -o "$work/sendloop" tools/sendloop/sendloop.c

archive=$(random_archive bench.archive $((1024 * 1024 * 1024 - 4096)) "$work" "$work/out")
size=$(stat -c %s "$archive")
start_sandbox_server "$work" com.example.bench "$archive"
declare -A url pids
url[iap-server]=$(grant_url "$work" bench.archive); pids[iap-server]=$server_pid
# ALSO: more iap-server builds, each on a copy of the data folder whose archives are hard links (the
# same file, the same page cache), named by their order: iap-server-2, iap-server-3, ...
also_names=()
for other in ${ALSO:-}; do
  n=$((${#also_names[@]} + 2)); data="$work/data-$n"
  cp -al "$work/data" "$data"
  # The catalog is the copy's own (not a link to the first server's files).
  find "$data" -type f ! -path '*/archives/*' | while read -r f; do cp --remove-destination "$work/data/${f#"$data"/}" "$f"; done
  first=$base
  serve_sandbox "$other" "$work" "$data" com.example.bench "-$n"
  url[iap-server-$n]=$(grant_url "$work" bench.archive); pids[iap-server-$n]=$server_pid
  base=$first
  also_names+=("iap-server-$n")
done
# Every server sends the very file iap-server stores (hard links), as in tools/bench-serve.sh.
stored=$(ls "$work"/data/archives/*.zip | head -1)
mkdir -p "$work/www"; ln "$stored" "$work/www/archive.zip"; chmod 755 "$work/www"; chmod 644 "$work/www/archive.zip"
# An nginx named <name> in folder <prefix> (its pid file there), serving the shared file.
add_nginx() { # name prefix
  local port
  port=$(free_port)
  start_nginx "$2" "server { listen 127.0.0.1:$port; ${LINK:+listen 10.231.0.1:$port;} root $work/www; }"
  url[$1]="http://127.0.0.1:$port/archive.zip"
  pids[$1]=$(nginx_pids "$2")
}
add_nginx nginx "$work"
names=(iap-server nginx ${also_names[@]+"${also_names[@]}"})
for n in $(seq 2 "${NGINXES:-1}"); do
  mkdir -p "$work/nginx-$n"; chmod 755 "$work/nginx-$n"
  add_nginx "nginx-$n" "$work/nginx-$n"
  names+=("nginx-$n")
done
for loop in ${LOOPS-corked uncorked}; do
  IFS=: read -r mode turn trigger <<< "$loop"
  port=$(free_port)
  "$work/sendloop" "$address" "$port" "$work/www/archive.zip" "$mode" ${turn:+"$turn"} ${trigger:+"$trigger"} &
  pids[$loop]=$!; url[$loop]="http://127.0.0.1:$port/archive.zip"; names+=("$loop")
done
count=${#names[@]}
# A first download of each, which also checks that each sends the whole file.
for name in "${names[@]}"; do
  url[$name]=$(client_url "${url[$name]}")
  for _ in $(seq 100); do got=$("${client[@]}" curl -s -o /dev/null -w '%{size_download}' "${url[$name]}" || true); [ "$got" = "$size" ] && break; sleep 0.05; done
  [ "$got" = "$size" ] || { echo "setup failed: ${url[$name]} sent $got of $size bytes" >&2; exit 1; }
  : > "$work/$name.dl"
done
echo "archive: $size bytes; $(nproc) cores; $rounds rounds, the $count servers in turn${LINK:+; across a $LINK veth link from a network namespace}" >&2
for round in $(seq "$rounds"); do
  for i in $(seq 0 $((count - 1))); do
    name=${names[$(((i + round) % count))]}
    download "$size" "${url[$name]}" ${pids[$name]} >> "$work/$name.dl"
  done
  echo "  round $round: $(for name in "${names[@]}"; do printf '%s %s; ' "$name" "$(cut -d' ' -f1-3 < <(tail -1 "$work/$name.dl"))"; done)(MB/s, server and machine CPU-s/GiB)" >&2
done

printf '\n%-22s %24s %30s %30s\n' "server" "MB/s (curl)" "server CPU s/GiB" "machine CPU s/GiB"
for name in "${names[@]}"; do
  row=("$name")
  for column in 1 2 3; do
    cut -d' ' -f$column "$work/$name.dl" > "$work/$name.$column"
    row+=("$(median < "$work/$name.$column") ($(spread < "$work/$name.$column"))")
  done
  printf '%-22s %24s %30s %30s\n' "${row[@]}"
done
printf '\nagainst nginx (ratio of medians, 95%% interval)\n%-22s %20s %20s %20s   %s\n' "server" "MB/s" "server CPU" "machine CPU" "server CPU at the same speed"
cut -d' ' -f1,2 "$work/nginx.dl" > "$work/nginx.fit"
for name in "${names[@]}"; do
  [ "$name" = nginx ] && continue
  row=("$name")
  for column in 1 2 3; do
    row+=("$(median_ratio "$work/$name.$column" "$work/nginx.$column")")
  done
  cut -d' ' -f1,2 "$work/$name.dl" > "$work/$name.fit"
  row+=("$(matched_speed_ratio "$work/$name.fit" "$work/nginx.fit")")
  printf '%-22s %20s %20s %20s   %s\n' "${row[@]}"
done

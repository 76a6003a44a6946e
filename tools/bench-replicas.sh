#!/usr/bin/env bash
# Issue 16's measurements, on loopback with real processes:
#  1. grants per second, one iap-server on PostgreSQL against one on SQLite, alternated over
#     $ROUNDS rounds of $GRANTS grant requests from $CLIENTS concurrent clients (medians, spread);
#  2. revocation propagation: a refund POSTed to replica A until replica C refuses the URL it
#     granted ($REFUNDS refunds; p50/p99); C reloads revocations only hourly, so this is NOTIFY;
#  3. the edge: $DOWNLOADS downloads of one $EDGE_MB MiB archive through nginx with the shipped
#     configuration (deploy/nginx/iap-content.conf), bytes from the replicas against bytes served.
# Usage: tools/bench-replicas.sh   (ROUNDS=7 GRANTS=300 CLIENTS=8 REFUNDS=50 DOWNLOADS=100 EDGE_MB=64)
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/lib.sh
ROUNDS=${ROUNDS:-7} GRANTS=${GRANTS:-300} CLIENTS=${CLIENTS:-8} REFUNDS=${REFUNDS:-50} DOWNLOADS=${DOWNLOADS:-100} EDGE_MB=${EDGE_MB:-64}
tools/install-deps.sh
build_release iap-server iap-pack iap-sandbox
work=$(mktemp -d); chmod 755 "$work"
cleanup() {
  [ -f "$work/nginx/nginx.pid" ] && kill "$(cat "$work/nginx/nginx.pid")" 2>/dev/null || true
  pg_scratch_cleanup
}
trap cleanup EXIT

pg_scratch_init
pg_scratch_start
for db in grants replicas edge; do "$pgbin/psql" -h 127.0.0.1 -p "$pgport" -U iap -d postgres -qc "CREATE DATABASE $db"; done
pg() { echo "postgres://iap@127.0.0.1:$pgport/$1?sslmode=disable"; }

bundle=com.example.bench
"$bin/iap-sandbox" init --dir "$work/sandbox" --bundle-id "$bundle" >/dev/null
archive=$(random_archive bench.replicas $((4 * 1024 * 1024)) "$work" "$work/out")
echo "adminadminadminadmin" > "$work/admin-token"

# serve <name> <port-file> [extra args...]: starts a replica in the background.
serve() {
  local name=$1; shift
  LOG_LEVEL=error "$bin/iap-server" serve --data "$work/$name" --bundle-id "$bundle" --trust-root "$work/sandbox/root.cer" \
    --environment sandbox --port 0 --port-file "$work/$name.port" --token-ttl 86400 --admin-token-file "$work/admin-token" "$@" \
    > "$work/$name.log" 2>&1 &
  for _ in $(seq 200); do [ -s "$work/$name.port" ] && break; sleep 0.05; done
  [ -s "$work/$name.port" ] || { echo "$name did not start: $(cat "$work/$name.log")" >&2; exit 1; }
}
port() { cat "$work/$1.port"; }

echo "buying $((GRANTS + REFUNDS + DOWNLOADS)) purchases in the sandbox..." >&2
for _ in $(seq $((GRANTS + REFUNDS))); do "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.replicas --json; done > "$work/purchases.jsonl"
for _ in $(seq "$DOWNLOADS"); do "$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id bench.edge --json; done > "$work/edge-purchases.jsonl"

# 1. Grants per second.
"$bin/iap-server" publish --data "$work/sqlite" "$archive" >/dev/null
"$bin/iap-server" publish --data "$work/pgone" --database "$(pg grants)" "$archive" >/dev/null
serve sqlite
serve pgone --database "$(pg grants)"

# 2. Propagation: A and C share PostgreSQL, the archive folder and the grant keys.
shared=(--database "$(pg replicas)" --archives "$work/shared/archives" --grant-keys "$work/shared/keys.json" --revocation-refresh 3600)
"$bin/iap-server" publish --data "$work/a" "${shared[@]:0:4}" "$archive" >/dev/null
serve a "${shared[@]}"
serve c "${shared[@]}"

# 3. The edge: two replicas behind nginx with the shipped configuration.
edge_archive=$(random_archive bench.edge $((EDGE_MB * 1024 * 1024)) "$work" "$work/out")
edgeport=$(free_port)
eshared=(--database "$(pg edge)" --archives "$work/eshared/archives" --grant-keys "$work/eshared/keys.json" --public-url "http://127.0.0.1:$edgeport")
"$bin/iap-server" publish --data "$work/e1" "${eshared[@]:0:4}" "$edge_archive" >/dev/null
serve e1 "${eshared[@]}"
serve e2 "${eshared[@]}"
mkdir -p "$work/nginx/cache" "$work/nginx/temp"; chmod -R 777 "$work/nginx"
python3 - "$work" "$edgeport" "$(port e1)" "$(port e2)" <<'EOF'
import sys, re
work, edge, *replicas = sys.argv[1:]
out, done = [], False
for line in open("deploy/nginx/iap-content.conf"):
    if line.strip().startswith("server 127.0.0.1:"):
        if not done:
            opts = " ".join(line.split()[2:])
            out += [f"    server 127.0.0.1:{p} {opts}\n" for p in replicas]
            done = True
        continue
    out.append(line.replace("/var/cache/nginx/", f"{work}/nginx/cache/").replace("/var/log/nginx/", f"{work}/nginx/").replace("listen 8080;", f"listen 127.0.0.1:{edge};"))
open(f"{work}/nginx/iap-content.conf", "w").write("".join(out))
t = f"{work}/nginx/temp"
open(f"{work}/nginx/nginx.conf", "w").write(f"""worker_processes 1; pid {work}/nginx/nginx.pid; error_log {work}/nginx/error.log warn;
events {{ worker_connections 1024; }}
http {{ access_log off; client_body_temp_path {t}/b; proxy_temp_path {t}/p; fastcgi_temp_path {t}/f; uwsgi_temp_path {t}/u; scgi_temp_path {t}/s;
  include {work}/nginx/iap-content.conf; }}
""")
EOF
nginx -c "$work/nginx/nginx.conf" -p "$work/nginx"

python3 - "$work" "$ROUNDS" "$GRANTS" "$CLIENTS" "$REFUNDS" "$DOWNLOADS" "$(port sqlite)" "$(port pgone)" "$(port a)" "$(port c)" "$edgeport" "$(port e1)" "$(port e2)" "$bin" <<'EOF'
import json, sys, time, statistics, subprocess, threading, http.client, queue
work, rounds, grants, clients, refunds, downloads = sys.argv[1], *map(int, sys.argv[2:7])
sqlite, pgone, a, c, edge, e1, e2 = map(int, sys.argv[7:14]); bin = sys.argv[14]
purchases = [json.loads(l) for l in open(f"{work}/purchases.jsonl")]
tx = lambda p: p["signedTransaction"]
tid = lambda p: p["transactionId"]

def post(port, path, body, conn=None):
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse(); data = r.read()
    if own: conn.close()
    return r.status, data

def grant_round(port, batch):
    work_q = queue.Queue()
    for p in batch: work_q.put(p)
    errors = []
    def worker():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while True:
            try: p = work_q.get_nowait()
            except queue.Empty: break
            status, _ = post(port, "/v1/downloads", {"signedTransaction": tx(p)}, conn)
            if status != 200: errors.append(status)
        conn.close()
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads: t.start()
    for t in threads: t.join()
    elapsed = time.perf_counter() - start
    assert not errors, errors[:5]
    return len(batch) / elapsed

def spread(xs): return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"

batch = purchases[:grants]
grant_round(sqlite, batch[:50]); grant_round(pgone, batch[:50])  # warm up
lite, pg = [], []
for r in range(rounds):
    order = [(sqlite, lite), (pgone, pg)] if r % 2 == 0 else [(pgone, pg), (sqlite, lite)]
    for port, out in order: out.append(grant_round(port, batch))
print(f"grants/s, {grants} grants from {clients} clients per round, {rounds} alternated rounds, medians (min-max):")
print(f"  SQLite      {spread(lite)}")
print(f"  PostgreSQL  {spread(pg)}")
for name, xs in (("pg", pg), ("sqlite", lite)):
    open(f"{work}/grants-{name}.col", "w").write("".join(f"{x}\n" for x in xs))
interval = subprocess.run(["bash", "-c", '. tools/lib.sh && ratio_interval "$1" "$2"', "_", f"{work}/grants-pg.col", f"{work}/grants-sqlite.col"],
                          capture_output=True, text=True, check=True).stdout.strip()
print(f"  ratio of medians PostgreSQL/SQLite: {statistics.median(pg)/statistics.median(lite):.2f}x, 95% interval {interval}")

# Propagation: grant on C, refund posted to A, until C refuses the URL.
samples = []
for p in purchases[grants:grants + refunds]:
    status, data = post(c, "/v1/downloads", {"signedTransaction": tx(p)})
    assert status == 200, data
    url = json.loads(data)["downloads"][0]["url"]
    path = url.split(f":{c}", 1)[1]
    body = json.loads(subprocess.run([f"{bin}/iap-sandbox", "refund", "--dir", f"{work}/sandbox", tid(p)], capture_output=True, text=True, check=True).stdout)
    probe = http.client.HTTPConnection("127.0.0.1", c, timeout=30)
    start = time.perf_counter()
    status, _ = post(a, "/v1/notifications", body)
    assert status == 200
    while True:
        probe.request("HEAD", path); r = probe.getresponse(); r.read()
        if r.status == 403: break
        if time.perf_counter() - start > 10: raise SystemExit("C never refused the refunded URL")
    samples.append((time.perf_counter() - start) * 1000)
    probe.close()
samples.sort()
p99 = samples[min(len(samples) - 1, int(round(0.99 * (len(samples) - 1))))]
print(f"revocation propagation, refund POSTed to A until C answers 403 ({len(samples)} refunds): "
      f"p50 {statistics.median(samples):.1f} ms, p99 {p99:.1f} ms, max {max(samples):.1f} ms")

# The edge: one archive, many buyers.
def metric(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics"); text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("iap_content_bytes_served_total"))
served, first_from_replicas = 0, None
for i, p in enumerate(json.loads(l) for l in open(f"{work}/edge-purchases.jsonl")):
    status, data = post(edge, "/v1/downloads", {"signedTransaction": tx(p)})
    assert status == 200, data
    path = json.loads(data)["downloads"][0]["url"].split(f":{edge}", 1)[1]
    conn = http.client.HTTPConnection("127.0.0.1", edge, timeout=60)
    conn.request("GET", path); r = conn.getresponse()
    n = 0
    while True:
        chunk = r.read(1 << 20)
        if not chunk: break
        n += len(chunk)
    conn.close()
    assert r.status == 200, r.status
    served += n
    if i == 0: first_from_replicas = metric(e1) + metric(e2)
from_replicas = metric(e1) + metric(e2)
after = served - served // downloads
print(f"edge: {downloads} downloads of {served // downloads} bytes through nginx: {served} bytes served, {from_replicas:.0f} from the replicas "
      f"({first_from_replicas:.0f} for the first); after the first {100 * (1 - (from_replicas - first_from_replicas) / after):.2f}% from the edge")
EOF

#!/usr/bin/env bash
# Where a one-connection transfer's time goes: for iap-fetch and curl on the same 1 GiB archive,
# alternating over RUNS rounds (default 5), the wall time until every byte is on disk (and, for
# iap-fetch, its SHA-256 checked) and the CPU seconds of each client thread and of the server,
# read from /proc at that moment. Written for issue 19: it shows that the transfer is bound by the
# one thread that copies socket bytes into the page cache (as curl is), and what iap-fetch spends
# beside it (SHA-256 and bookkeeping, on the second core).
# Usage: [RUNS=n] [SIZE=bytes] tools/bench-fetch-cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
. tools/lib.sh
fetch_bench_setup
cd "$work"
RUNS=${RUNS:-5} python3 - "$bin" "$base" "$server_pid" <<'PY'
import json, os, statistics, subprocess, sys, time
bin, base, server = sys.argv[1], sys.argv[2], int(sys.argv[3])
tick = os.sysconf("SC_CLK_TCK")
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / tick
def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            s = open(f"/proc/{pid}/task/{t}/stat").read()
            name = s.split("(")[1].split(")")[0]
            f = s.rsplit(")", 1)[1].split()
            key = "event loop" if name.startswith("NIO") else "concurrency pool" if "qos" in name else name
            out[key] = out.get(key, 0) + (int(f[11]) + int(f[12])) / tick
        except OSError:
            pass
    return out
def settle():
    subprocess.run("sync", shell=True)
    time.sleep(1)
rows = {k: [] for k in ["fetch wall", "fetch event loop", "fetch pool", "fetch server", "curl wall", "curl cpu", "curl server"]}
for round in range(int(os.environ["RUNS"])):
    subprocess.run(f"{bin}/iap-sandbox purchase --dir sandbox --product-id bench.fetch > tx.jws", shell=True, check=True)
    subprocess.run("rm -rf dev", shell=True)
    settle()
    s0, t0 = cpu(server), time.monotonic()
    p = subprocess.Popen([bin + "/iap-fetch", "get", "--server", base, "--transaction", "tx.jws", "--content-dir", "dev", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        u = json.loads(line)
        if u.get("state") == "active" and u.get("expectedContentLength", -1) > 0 and u.get("bytesReceived") == u["expectedContentLength"]:
            rows["fetch wall"].append(time.monotonic() - t0)
            th = threads(p.pid)
            rows["fetch event loop"].append(th.get("event loop", 0))
            rows["fetch pool"].append(th.get("concurrency pool", 0))
            rows["fetch server"].append(cpu(server) - s0)
            break
    p.kill(); p.wait()
    grant = subprocess.run(["curl", "-s", "-X", "POST", base + "/v1/downloads", "-d", json.dumps({"signedTransaction": open("tx.jws").read().strip()})],
                           capture_output=True, text=True).stdout
    url = json.loads(grant)["downloads"][0]["url"]
    subprocess.run("rm -f c.zip", shell=True)
    settle()
    s0, t0 = cpu(server), time.monotonic()
    r = subprocess.run(["/usr/bin/time", "-f", "%U %S", "curl", "-s", "-o", "c.zip", url], capture_output=True, text=True)
    rows["curl wall"].append(time.monotonic() - t0)
    rows["curl cpu"].append(sum(map(float, r.stderr.split())))
    rows["curl server"].append(cpu(server) - s0)
    print(f"round {round + 1}: iap-fetch {rows['fetch wall'][-1]:.2f} s (event loop {rows['fetch event loop'][-1]:.2f}, pool {rows['fetch pool'][-1]:.2f} CPU s); "
          f"curl {rows['curl wall'][-1]:.2f} s ({rows['curl cpu'][-1]:.2f} CPU s)", file=sys.stderr)
print("seconds, medians (min-max) over", len(rows["curl wall"]), "rounds")
for k, v in rows.items():
    print(f"{k:20} {statistics.median(v):6.2f}  ({min(v):.2f}-{max(v):.2f})")
print(f"transfer ratio, curl / iap-fetch wall (medians): {statistics.median(rows['curl wall']) / statistics.median(rows['fetch wall']):.2f}")
print(f"copy thread ratio, curl CPU / iap-fetch event-loop CPU (medians): {statistics.median(rows['curl cpu']) / statistics.median(rows['fetch event loop']):.2f}")
PY

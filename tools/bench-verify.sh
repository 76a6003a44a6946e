#!/usr/bin/env bash
# Verification benchmark: our StoreKit 2 verifier (PurchaseVerification, what iap-server runs on
# every grant) against Apple's own, the App Store Server Library's SignedDataVerifier for Python
# (the peer a server team would otherwise pick; its interoperability is tested in the suite), on
# the same signed transactions in one run. Both verify ES256 and the x5c chain to the same root
# (Apple's library with online checks off, as ours makes none), and both cache a verified chain.
# Measures, verifications per second:
#   cold:   a new verifier per token, so every chain is built and validated;
#   warm-1: one verifier, one task (Python: one process);
#   warm-N: one verifier per core's worth of work (ours: N tasks on one verifier; Python: N
#           processes, as a Python server scales past the GIL);
# the two sides alternate over ROUNDS rounds (default 7), who goes first flipping every round;
# medians with spread (min-max), the ratio of medians and its 95% interval (tools/lib.sh).
# Usage: [ROUNDS=n] [TOKENS=n] tools/bench-verify.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
. tools/lib.sh
build_release verify-bench
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
rounds=${ROUNDS:-7}
"$bin/verify-bench" --export "$work/tokens" "${TOKENS:-5000}"

cat > "$work/apple.py" <<'PY'
# Apple's SignedDataVerifier over <folder>'s tokens: one line "<measure> <verifications/s>" each.
import multiprocessing, os, sys, time
from appstoreserverlibrary.models.Environment import Environment
from appstoreserverlibrary.signed_data_verifier import SignedDataVerifier

folder = sys.argv[1]
root = open(os.path.join(folder, "root.cer"), "rb").read()
tokens = open(os.path.join(folder, "tokens.txt")).read().split()
cores = os.cpu_count()

def verifier():
    return SignedDataVerifier([root], False, Environment.SANDBOX, "com.example.app", None)

def check(decoded):
    if decoded.bundleId != "com.example.app":
        sys.exit(f"Apple's verifier decoded bundleId {decoded.bundleId!r}")

def share(worker, barrier):
    v = verifier()
    check(v.verify_and_decode_signed_transaction(tokens[0]))
    barrier.wait()
    for token in tokens[worker::cores]:
        v.verify_and_decode_signed_transaction(token)

cold = tokens[: max(200, len(tokens) // 20)]
start = time.monotonic()
for token in cold:
    check(verifier().verify_and_decode_signed_transaction(token))
print(f"cold {len(cold) / (time.monotonic() - start):.0f}")

v = verifier()
v.verify_and_decode_signed_transaction(tokens[0])
start = time.monotonic()
for token in tokens:
    v.verify_and_decode_signed_transaction(token)
print(f"warm-1 {len(tokens) / (time.monotonic() - start):.0f}")

# Processes start and warm their chain cache first; the clock starts when all are ready.
fork = multiprocessing.get_context("fork")
barrier = fork.Barrier(cores + 1)
workers = [fork.Process(target=share, args=(w, barrier)) for w in range(cores)]
for w in workers: w.start()
barrier.wait()
start = time.monotonic()
for w in workers: w.join()
if any(w.exitcode != 0 for w in workers):
    sys.exit("a verifying process failed")
print(f"warm-{cores} {len(tokens) / (time.monotonic() - start):.0f}")
PY

ours() { "$bin/verify-bench" --from "$work/tokens" 1 >> "$work/ours.runs"; }
apple() { python3 "$work/apple.py" "$work/tokens" >> "$work/apple.runs"; }
: > "$work/ours.runs"; : > "$work/apple.runs"
for round in $(seq "$rounds"); do
  if [ $((round % 2)) = 1 ]; then ours; apple; else apple; ours; fi
  echo "  round $round: ours $(tail -3 "$work/ours.runs" | tr '\n' ' ')| Apple's $(tail -3 "$work/apple.runs" | tr '\n' ' ')" >&2
done

echo "$(wc -l < "$work/tokens/tokens.txt") StoreKit 2 signed transactions (ES256, x5c chain of 3); $(nproc) cores; medians (min-max) of $rounds alternated rounds, verifications/s"
printf '%-10s %24s %24s %8s %12s\n' measure ours "Apple's (Python)" ratio "95% interval"
for measure in $(awk '{ print $1 }' "$work/ours.runs" | awk '!seen[$0]++'); do
  awk -v m="$measure" '$1 == m { print $2 }' "$work/ours.runs" > "$work/ours.col"
  awk -v m="$measure" '$1 == m { print $2 }' "$work/apple.runs" > "$work/apple.col"
  om=$(median < "$work/ours.col"); am=$(median < "$work/apple.col")
  printf '%-10s %24s %24s %8.1f %12s\n' "$measure" "$om ($(spread < "$work/ours.col"))" "$am ($(spread < "$work/apple.col"))" \
    "$(awk -v a="$om" -v b="$am" 'BEGIN { print a / b }')" "$(ratio_interval "$work/ours.col" "$work/apple.col")"
done

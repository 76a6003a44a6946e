#!/usr/bin/env bash
# Delta update benchmark (issue 17), on the ~1 GiB packing corpus (tools/make-corpus.py) as 1.0
# and a 1.1 that changes 3% of its files and adds and removes a few. In one run, alternating
# the two sides of each comparison over RUNS rounds (default 7), medians with spread (min-max):
#   packing: `iap-pack build` of 1.1 in full vs with `--previous` 1.0 (same bytes, checked), the
#            content folder edited in place as in a build pipeline's workspace; and with
#            `--previous` but without 1.0's hash cache (a fresh checkout, every file hashed);
#   client:  `iap-fetch get` of 1.1 on an empty device (the whole archive) vs on a device with
#            1.0 installed (a delta): time, bytes fetched, peak memory;
#   zstd --patch-from (a patch per version pair) on the same two archives: patch size, time
#            to make and to apply it.
# Usage: [RUNS=n] [CHANGED_PERCENT=3] [PACK_ONLY=1] tools/bench-delta.sh [corpus-dir] [scale]   (scale 0.1 for a quick run)
# The packing goal is stated for a 1% change: CHANGED_PERCENT=1 PACK_ONLY=1 tools/bench-delta.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-/tmp/iap-bench-corpus}
scale=${2:-1}
tools/install-deps.sh
command -v zstd >/dev/null && [ -x /usr/bin/time ] || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq zstd time >/dev/null; }
. tools/lib.sh
bench_corpus "$corpus" "$scale"
build_release iap-server iap-pack iap-sandbox iap-fetch
work=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
runs=${RUNS:-7}
product=bench.delta

# 1.0 is packed from the workspace $work/v2, which is then edited in place into 1.1: 3% of the
# files rewritten (text edited, binaries re-randomised at the same size), 5 added and 5 removed;
# deterministic.
cp -a "$corpus/Contents" "$work/v2"
sleep 2  # the hash cache leaves out files changed in the last 2 s
"$bin/iap-pack" build "$work/v2" --product-id $product --content-version 1.0 -o "$work/old" >/dev/null
python3 - "$work/v2" <<'EOF'
import os, random, sys
root = sys.argv[1]
rng = random.Random(17)
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
for path in rng.sample(files, max(1, len(files) * int(os.environ.get("CHANGED_PERCENT", "3")) // 100)):
    data = open(path, 'rb').read()
    if path.endswith(('.bin', '.jpg')):
        data = rng.randbytes(len(data))
    else:
        at = rng.randrange(max(1, len(data)))
        data = data[:at] + b'edited in 1.1 ' + data[at:]
    open(path, 'wb').write(data)
for path in rng.sample(files, 5):
    os.remove(path)
for i in range(5):
    os.makedirs(os.path.join(root, 'new'), exist_ok=True)
    open(os.path.join(root, 'new', f'added-{i}.json'), 'wb').write(('{"added": %d}\n' % i).encode() * 1000)
EOF
cat "$work"/v2/*/* "$work"/v2/*/*/* >/dev/null 2>&1 || true

timed() { # label command... : appends "seconds peakKiB" to $work/runs-<label>
  local label=$1; shift
  # Each command starts with nothing of the one before still being written back, which would
  # otherwise land on whichever comes next.
  sync
  /usr/bin/time -f "%e %M" -o "$work/time" "$@" > "$work/out-$label" 2> "$work/err" || { cat "$work/err" >&2; exit 1; }
  cat "$work/time" >> "$work/runs-$label"
  echo "  $label: $(cat "$work/time")" >&2
}
summary() { # label -> "median (min-max) peakMiB"
  printf '%s (%s) %.1f' "$(cut -d' ' -f1 "$work/runs-$1" | median)" "$(cut -d' ' -f1 "$work/runs-$1" | spread)" \
    "$(cut -d' ' -f2 "$work/runs-$1" | sort -g | tail -1 | awk '{ print $1 / 1024 }')"
}
ratio() { awk -v a="$(cut -d' ' -f1 "$work/runs-$1" | median)" -v b="$(cut -d' ' -f1 "$work/runs-$2" | median)" 'BEGIN { printf "%.3f", a / b }'; }

# Packing.
cp -a "$work/old" "$work/old-nocache"; rm -f "$work/old-nocache/.$product-1.0.zip.hashes"
pack_step() { # label: one timed build
  case $1 in
    pack-full) timed pack-full "$bin/iap-pack" build "$work/v2" --product-id $product --content-version 1.1 -o "$work/full" ;;
    pack-previous) timed pack-previous "$bin/iap-pack" build "$work/v2" --product-id $product --content-version 1.1 -o "$work/inc" --previous "$work/old/$product-1.0.zip" ;;
    pack-previous-nocache) timed pack-previous-nocache "$bin/iap-pack" build "$work/v2" --product-id $product --content-version 1.1 -o "$work/inc-nocache" --previous "$work/old-nocache/$product-1.0.zip" ;;
    pack-full-nosync) timed pack-full-nosync "$bin/iap-pack" build "$work/v2" --product-id $product --content-version 1.1 -o "$work/full-nosync" --no-sync ;;
    pack-previous-nosync) timed pack-previous-nosync "$bin/iap-pack" build "$work/v2" --product-id $product --content-version 1.1 -o "$work/inc-nosync" --previous "$work/old/$product-1.0.zip" --no-sync ;;
  esac
}
steps="pack-full pack-previous pack-previous-nocache pack-full-nosync pack-previous-nosync"
for round in $(seq "$runs"); do
  rm -rf "$work/full" "$work/inc" "$work/inc-nocache" "$work/full-nosync" "$work/inc-nosync"
  # The order flips every round: what a build meets depends on what ran just before it (pages
  # the one before freed or left to write back), so each side gets both turns.
  order=$steps; [ $((round % 2)) = 0 ] && order=$(echo "$steps" | tr ' ' '\n' | tac | tr '\n' ' ')
  for step in $order; do pack_step "$step"; done
  for out in inc inc-nocache full-nosync inc-nosync; do
    cmp -s "$work/full/$product-1.1.zip" "$work/$out/$product-1.1.zip" || { echo "--previous gave other bytes than a full build" >&2; exit 1; }
  done
  # The disk's floor for a durable write of an archive this size (what --previous cannot avoid
  # without reflinks, which ext4 lacks): the same bytes copied with O_DIRECT and fsync.
  rm -f "$work/disk-floor"
  timed disk-write dd if="$work/full/$product-1.1.zip" of="$work/disk-floor" bs=8M oflag=direct conv=fsync status=none
done
old="$work/old/$product-1.0.zip"; new="$work/full/$product-1.1.zip"

pack_report() {
  echo "1.0: $(stat -c %s "$old") bytes, 1.1: $(stat -c %s "$new") bytes, $(find "$work/v2" -type f | wc -l) files, ${CHANGED_PERCENT:-3}% changed; $(nproc) cores; medians (min-max) of $runs alternated rounds"
  printf '%-34s %s\n' "pack 1.1 full (s, peak MiB)" "$(summary pack-full)"
  printf '%-34s %s\n' "pack 1.1 --previous (s, peak MiB)" "$(summary pack-previous)"
  printf '%-34s %s   (goal <= 0.10)\n' "  --previous / full" "$(ratio pack-previous pack-full)"
  printf '%-34s %s\n' "  disk floor: dd direct+fsync" "$(summary disk-write)"
  printf '%-34s %s\n' "pack --previous, no hash cache" "$(summary pack-previous-nocache)"
  printf '%-34s %s\n' "  no cache / full" "$(ratio pack-previous-nocache pack-full)"
  printf '%-34s %s\n' "pack 1.1 full --no-sync" "$(summary pack-full-nosync)"
  printf '%-34s %s\n' "pack 1.1 --previous --no-sync" "$(summary pack-previous-nosync)"
  printf '%-34s %s   (goal <= 0.10)\n' "  --previous / full, both no-sync" "$(ratio pack-previous-nosync pack-full-nosync)"
}
if [ -n "${PACK_ONLY:-}" ]; then pack_report; exit 0; fi

# The client: 1.0 installed once on a base device; each delta round starts from a hard-linked
# copy of it (same inodes, as on the device), each full round from an empty folder.
start_sandbox_server "$work" com.example.bench "$old"
tx=$("$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id $product)
echo "$tx" > "$work/tx.jws"
"$bin/iap-fetch" get --server "$base" --transaction "$work/tx.jws" --content-dir "$work/base" >/dev/null
"$bin/iap-server" publish --data "$work/data" "$new" >/dev/null
for round in $(seq "$runs"); do
  rm -rf "$work/dev-full" "$work/dev-delta"; cp -al "$work/base" "$work/dev-delta"; sync
  timed get-full "$bin/iap-fetch" get --server "$base" --transaction "$work/tx.jws" --content-dir "$work/dev-full" --json
  timed get-delta "$bin/iap-fetch" get --server "$base" --transaction "$work/tx.jws" --content-dir "$work/dev-delta" --json
  diff -r "$work/v2" "$work/dev-delta/$product/1.1/Contents" >/dev/null || { echo "the delta install differs from 1.1" >&2; exit 1; }
done
fetched=$(grep -o '"bytesToFetch":[0-9]*' "$work/out-get-delta" | tail -1 | cut -d: -f2)
delta_line=$(grep -o '"delta":"[^"]*"' "$work/out-get-delta" | tail -1)
python3 - "$work/old/$product-1.0.manifest.json" "$work/full/$product-1.1.manifest.json" "$fetched" > "$work/bytes" <<'EOF'
import json, sys
old = {e['path']: e for e in json.load(open(sys.argv[1]))['entries']}
new = json.load(open(sys.argv[2]))
shas = {e['sha256'] for e in old.values()}
changed = sum(e['compressedSize'] for e in new['entries'] if e['kind'] == 'file' and e['sha256'] not in shas)
manifest = len(open(sys.argv[2], 'rb').read())
fetched = int(sys.argv[3])
print(changed, manifest, fetched, (fetched + manifest) / (changed + manifest))
EOF
read -r changed manifest_bytes fetched_bytes bytes_ratio < "$work/bytes"

# zstd --patch-from on the same pair of archives (a window over the whole old archive).
for round in $(seq "$runs"); do
  rm -f "$work/patch.zst" "$work/patched.zip"
  timed zstd-make zstd -q --patch-from="$old" "$new" -o "$work/patch.zst" --long=31 -T2
  timed zstd-apply zstd -q -d --patch-from="$old" "$work/patch.zst" -o "$work/patched.zip" --long=31
  cmp -s "$work/patched.zip" "$new" || { echo "zstd's patch did not rebuild 1.1" >&2; exit 1; }
done

pack_report
echo "$delta_line"
printf '%-34s %s\n' "iap-fetch 1.1 whole (s, peak MiB)" "$(summary get-full)"
printf '%-34s %s\n' "iap-fetch 1.1 delta (s, peak MiB)" "$(summary get-delta)"
printf '%-34s %s   (goal <= 0.10)\n' "  delta / whole" "$(ratio get-delta get-full)"
printf '%-34s %s fetched + %s manifest vs %s changed entries: %.3fx   (goal <= 1.05)\n' "delta bytes" "$fetched_bytes" "$manifest_bytes" "$changed" "$bytes_ratio"
printf '%-34s %s bytes\n' "zstd --patch-from patch" "$(stat -c %s "$work/patch.zst")"
printf '%-34s %s\n' "  make patch (s, peak MiB)" "$(summary zstd-make)"
printf '%-34s %s\n' "  apply patch (s, peak MiB)" "$(summary zstd-apply)"

#!/usr/bin/env bash
# The main job on embedded defaults: pack every product in content/, serve them, buy one in the
# sandbox store, get a verified download grant, download (with a resume), install it the way a
# device does, then refund it and watch access being cut. Everything runs on 127.0.0.1 and is
# stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

step "building the tools (release)"
. tools/lib.sh
build_release iap-pack iap-server iap-sandbox iap-fetch
work=$(mktemp -d "${TMPDIR:-/tmp}/iap-demo.XXXXXX")
server_pid=
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

step "packing every product in content/ (reproducible ZIP + manifest, CRC-32 and SHA-256 per entry)"
for product in content/*/; do "$bin/iap-pack" build "$product" --output "$work/archives"; done

step "creating the sandbox store: its own root -> intermediate -> leaf chain with Apple's marker OIDs"
"$bin/iap-sandbox" init --dir "$work/sandbox" --bundle-id com.example.demo

step "starting iap-server on a free port, trusting the sandbox root, accepting sandbox purchases"
"$bin/iap-server" serve --data "$work/data" --bundle-id com.example.demo --port 0 --port-file "$work/port" \
  --trust-root "$work/sandbox/root.cer" --environment sandbox > "$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.05; done
base="http://127.0.0.1:$(cat "$work/port")"
echo "listening on $base"

step "publishing the archives (each is validated: structure, CRCs, plist, 2 GiB cap)"
for archive in "$work"/archives/*.zip; do "$bin/iap-server" publish --data "$work/data" "$archive"; done
"$bin/iap-server" catalog --data "$work/data"

product=com.example.cosmos.levels1
step "GET /v1/products/$product (what SKProduct.downloadContentVersion/Lengths told apps)"
curl -s "$base/v1/products/$product"; echo

step "buying $product in the sandbox: a signed StoreKit 2 transaction (ES256 JWS) is queued, unfinished"
signed=$("$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id "$product")
echo "${signed:0:72}…"
"$bin/iap-sandbox" transactions --dir "$work/sandbox"

step "POST /v1/downloads: the server verifies the purchase and grants a short-lived URL (what iap-fetch asks for)"
curl -s -X POST "$base/v1/downloads" -d "{\"signedTransaction\":\"$signed\"}" | tee "$work/grant.json"; echo
url=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["downloads"][0]["url"])' "$work/grant.json")

step "buying the two other products too, and 100 coins (a consumable: no hosted content), then running iap-fetch over the device's queue"
"$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id com.example.magazine.issue42 > /dev/null
"$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id com.example.soundkit.drums > /dev/null
"$bin/iap-sandbox" purchase --dir "$work/sandbox" --product-id com.example.coins100 --type consumable > /dev/null
echo "iap-fetch: grant -> resumable download (Range/If-Range) -> SHA-256 -> safe install -> finish transaction"
echo "(the coins have nothing to download: iap-fetch leaves that transaction unfinished for the app to deliver)"
"$bin/iap-fetch" run --server "$base" --queue "$work/sandbox/queue" --content-dir "$work/device"

step "the installed contentURL folders, and the transactions now finished (only after installing; the coins are the app's to finish)"
for dir in "$work"/device/*/*/; do echo "${dir#$work/}: $(find "$dir" -type f | wc -l) files"; done
(cd "$work/device/$product/1.0" && find . -type f | sort | head -6)
"$bin/iap-sandbox" transactions --dir "$work/sandbox"
coins=$("$bin/iap-sandbox" transactions --dir "$work/sandbox" --json | python3 -c 'import json,sys; print([t for t in json.load(sys.stdin) if t["productId"] == "com.example.coins100"][0]["transactionId"])')
echo "the app credits the 100 coins, then finishes that transaction itself:"
"$bin/iap-sandbox" finish --dir "$work/sandbox" "$coins"

step "a content update: 1.1 of $product adds a level; run --updates fetches only what changed (a delta update)"
cp -r "content/$product/Contents" "$work/levels-1.1"
echo '{"id": "ring-11"}' > "$work/levels-1.1/levels/ring-11.json"
"$bin/iap-pack" build "$work/levels-1.1" --product-id "$product" --content-version 1.1 --output "$work/archives-1.1" > /dev/null
"$bin/iap-server" publish --data "$work/data" "$work/archives-1.1/$product-1.1.zip"
"$bin/iap-fetch" run --server "$base" --queue "$work/sandbox/queue" --content-dir "$work/device" --updates
echo "installed now (1.0 was replaced only once 1.1 was complete):"
"$bin/iap-fetch" installed --content-dir "$work/device"

step "refunding the purchase: the sandbox signs a REFUND notification V2 and POSTs it to the server"
id=$("$bin/iap-sandbox" transactions --dir "$work/sandbox" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["transactionId"])')
"$bin/iap-sandbox" refund --dir "$work/sandbox" "$id" --notify "$base/v1/notifications" > /dev/null

step "after the refund: the old download URL and a new grant are both refused"
curl -s -w "  (HTTP %{http_code})\n" "$url"
curl -s -w "  (HTTP %{http_code})\n" -X POST "$base/v1/downloads" -d "{\"signedTransaction\":\"$signed\"}"
echo "the device asks again: the refunded product is named, not failed; what it installed stays (the app decides):"
"$bin/iap-fetch" run --server "$base" --queue "$work/sandbox/queue" --content-dir "$work/device" --updates 2>&1 | grep -v "is up to date"

step "stopping the server (SIGTERM: graceful drain)"
kill -TERM "$server_pid"; wait "$server_pid" && echo "server exited cleanly"; server_pid=

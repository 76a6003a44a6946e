#!/usr/bin/env bash
# The demo on embedded defaults: packs every product in content/, verifies each archive, and
# installs one the way a device does (safe extraction into <products>/<id>/<version>/).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
echo "==> building (release)"
swift build -c release --product iap-pack 2>&1 | tail -1
bin=$(swift build -c release --show-bin-path)
work=$(mktemp -d "${TMPDIR:-/tmp}/iap-demo.XXXXXX")
trap 'rm -rf "$work"' EXIT

for product in content/*/; do
  echo
  echo "==> packing $product"
  "$bin/iap-pack" build "$product" --output "$work/archives"
done

echo
echo "==> verifying every archive against its manifest (structure, CRC-32, SHA-256, offsets)"
for archive in "$work"/archives/*.zip; do "$bin/iap-pack" verify "$archive"; done

echo
echo "==> the same input packs to the same bytes (reproducible builds)"
first=$(ls "$work"/archives/*.zip | head -1)
product=$(basename "$first" | sed 's/-[0-9.]*\.zip$//')
"$bin/iap-pack" build "content/$product" --output "$work/again" --json >/dev/null
cmp "$first" "$work/again/$(basename "$first")" && echo "identical: $(sha256sum "$first" | cut -c1-16)…"

echo
echo "==> entries of $(basename "$first")"
"$bin/iap-pack" inspect "$first"

#!/usr/bin/env bash
# Installs the Debian packages the project needs, only those missing (run as root, or with sudo).
set -euo pipefail
# postgresql and nginx: the catalog, replica and edge tests start their own servers from their binaries.
# systemd: its systemd-analyze checks the shipped unit (deploy/systemd); nothing is started with it.
# sqlite3: tests write the catalog as an operator or an older server would, behind the server's back.
# iproute2: its ss reads the congestion control of the server's connections (and bench LINK= sets up its veth link with ip).
packages=(libdeflate-dev zlib1g-dev libsqlite3-dev sqlite3 libssl-dev curl unzip zip python3 util-linux openssl postgresql nginx systemd iproute2)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The interoperability tests check our JWS against Python's `cryptography`, and our verifier
# against Apple's own App Store Server Library.
if ! python3 -c 'import cryptography' 2>/dev/null; then
  echo "installing: cryptography (PyPI)" >&2
  python3 -m pip install -q cryptography
fi
# The receipt differential test parses payloads with asn1crypto, independently of swift-asn1.
if ! python3 -c 'import asn1crypto' 2>/dev/null; then
  echo "installing: asn1crypto (PyPI)" >&2
  python3 -m pip install -q asn1crypto
fi
# The HTTP lint test (and tools/http-lint.py) judges the server's responses with REDbot and httplint.
if ! python3 -c 'import redbot, httplint' 2>/dev/null; then
  echo "installing: redbot (PyPI)" >&2
  python3 -m pip install -q redbot
fi
if ! python3 -c 'import appstoreserverlibrary' 2>/dev/null; then
  echo "installing: app-store-server-library (PyPI)" >&2
  python3 -m pip install -q app-store-server-library
fi

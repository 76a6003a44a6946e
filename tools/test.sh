#!/usr/bin/env bash
# The test command: installs what is missing, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
exec swift test "$@"

#!/usr/bin/env bash
# The test command: installs what is missing, checks the formatting (.swift-format), then runs the
# whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
swift format lint --strict --recursive Sources Tests tools/bench-support tools/verify-bench tools/receipt-bench Package.swift
exec swift test "$@"

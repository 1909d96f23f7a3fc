#!/usr/bin/env bash
# Install attnlab on a fresh Debian/Ubuntu machine with Python 3.11.
#   bash scripts/install.sh          runtime: Chromium (figure export), torch (CPU), attnlab + deps
#   bash scripts/install.sh --test   the same, plus the test dependencies
# torch==2.13.0 is installed before anything that depends on torch: otherwise pip resolves a
# multi-GB CUDA build. Idempotent: a second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -r requirements.txt -e .
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -r requirements-test.txt
fi

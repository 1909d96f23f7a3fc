#!/usr/bin/env bash
# One short GPU check for a session that is lent a CUDA machine (see the device tool):
# the CUDA paths against CPU results (pytest -m cuda), then the benchmarks on CUDA.
# Writes everything to ${OUT:-out}/ so it comes back from the device machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/device.txt" 2>&1
python -m pytest -q -m cuda tests > "$OUT/cuda_tests.txt" 2>&1; echo "pytest exit $?" >> "$OUT/cuda_tests.txt"
python -m attnlab.bench attention --device cuda --no-memory --json "$OUT/bench_attention_cuda.json" \
  > "$OUT/bench_attention_cuda.txt" 2>&1
tail -n 30 "$OUT"/*.txt

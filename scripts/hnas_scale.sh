#!/usr/bin/env bash
# The scale runs of issue 29 (docs/TRAINING.md, "Scale runs"): 8-layer masked-LM encoders on
# KJV + Shakespeare, 10,000 steps each: enc8-hnas with seeds 0, 1, 2, enc8-unas and enc8-dnas with seed 0.
#
#   bash scripts/hnas_scale.sh           start, or resume, every unfinished run in the background and return
#   bash scripts/hnas_scale.sh status    step, tokens/s, held-out loss and state of each run
#   bash scripts/hnas_scale.sh stop      SIGTERM: each run finishes its step, checkpoints it and exits 0
#   bash scripts/hnas_scale.sh ship      copy each finished run to checkpoints/<name>: recipe.json,
#                                        metrics.jsonl, latest.json and the final step without its
#                                        optimizer state (model.safetensors, config.json, vocab.txt, ...)
#
# Every run: `nice -n 19`, one thread, CPU, its own directory runs/hnas-scale/<name> and log
# runs/hnas-scale/logs/<name>.log; at most HNAS_SCALE_JOBS (default 2) at a time, in the order below.
# Safe to re-run: a finished run (latest.json at train.steps) is skipped, a started one continues with
# --resume (bitwise the same as an uninterrupted run), a run whose trainer is still alive is left to it,
# and a second scheduler is not started while one is alive. A SIGKILL loses at most the steps since the
# last checkpoint (save_every = 100 steps). HNAS_SCALE_STEPS=N trains (or extends) every run to N steps;
# HNAS_SCALE_DIR (runs/hnas-scale), HNAS_SCALE_JOBS (2) and HNAS_SCALE_SHIP (checkpoints) move the rest.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
source scripts/env.sh

ROOT=${HNAS_SCALE_DIR:-runs/hnas-scale}
JOBS=${HNAS_SCALE_JOBS:-2}
STEPS=${HNAS_SCALE_STEPS:-}
SHIP=${HNAS_SCALE_SHIP:-checkpoints}
# name, recipe, seed: one seed of each variant first, so that all three can be compared earliest.
RUNS=(
  "enc8-hnas-s0 enc8-hnas 0"
  "enc8-unas-s0 enc8-unas 0"
  "enc8-dnas-s0 enc8-dnas 0"
  "enc8-hnas-s1 enc8-hnas 1"
  "enc8-hnas-s2 enc8-hnas 2"
)
STATE="$ROOT/.state"
LOGS="$ROOT/logs"

say() { echo "$(date '+%F %T') $*"; }

alive() {  # alive PIDFILE: the process it names is running (and is one of ours)
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -qa "hnas_scale\|attnlab.train" "/proc/$pid/cmdline" 2>/dev/null
}

target_steps() {  # target_steps RECIPE
  if [ -n "$STEPS" ]; then echo "$STEPS"; return; fi
  "$PY" -c 'import sys; from attnlab.train import load_recipe; print(load_recipe(sys.argv[1]).train.steps)' "$1"
}

latest_step() {  # latest_step RUNDIR: the step of its last complete checkpoint, or -1
  "$PY" -c 'import json, sys
try:
    print(int(json.load(open(sys.argv[1] + "/latest.json"))["step"]))
except (OSError, ValueError, KeyError):
    print(-1)' "$1"
}

run_one() {  # run_one NAME RECIPE SEED: train (or resume) one run to the end, in the foreground
  local name=$1 recipe=$2 seed=$3 dir="$ROOT/$1" pidfile="$STATE/$1.pid" log="$LOGS/$1.log"
  local args=(--recipe "$recipe" --seed "$seed" --out "$dir" --device cpu --no-progress)
  [ -n "$STEPS" ] && args+=(--steps "$STEPS")
  if alive "$pidfile"; then  # a trainer of an earlier scheduler still runs: wait for it
    say "$name: already running (pid $(cat "$pidfile")); waiting for it"
    while alive "$pidfile"; do sleep 60; done
    return 0
  fi
  [ -f "$dir/recipe.json" ] && args+=(--resume)
  say "$name: start at step $(latest_step "$dir"): ${args[*]}" | tee -a "$log"
  OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
    nice -n 19 "$PY" -m attnlab.train "${args[@]}" >>"$log" 2>&1 &
  echo $! >"$pidfile"
  local rc=0
  wait $! || rc=$?
  say "$name: trainer exited with status $rc at step $(latest_step "$dir")" | tee -a "$log"
  rm -f "$pidfile"
}

scheduler() {
  trap 'say "scheduler: SIGTERM: no new run starts"; exit 0' TERM
  local spec name recipe seed
  for spec in "${RUNS[@]}"; do
    read -r name recipe seed <<<"$spec"
    if [ "$(latest_step "$ROOT/$name")" -ge "$(target_steps "$recipe")" ]; then
      say "$name: finished (step $(latest_step "$ROOT/$name")); skipped"
      continue
    fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    run_one "$name" "$recipe" "$seed" &
    sleep 5
  done
  wait
  say "scheduler: every run has ended"
  rm -f "$STATE/scheduler.pid"
}

status() {
  local spec name recipe seed dir
  for spec in "${RUNS[@]}"; do
    read -r name recipe seed <<<"$spec"
    dir="$ROOT/$name"
    local state="not started"
    [ -f "$dir/recipe.json" ] && state="stopped"
    alive "$STATE/$name.pid" && state="running (pid $(cat "$STATE/$name.pid"))"
    "$PY" - "$dir" "$(target_steps "$recipe")" "$state" "$name" <<'EOF'
import json, sys
from pathlib import Path
from attnlab.train import read_metrics
d, target, state, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
try:
    ck = json.loads((d / "latest.json").read_text())["step"]
except (OSError, ValueError, KeyError):
    ck = -1
rows = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
last = rows[-1] if rows else {}
speeds = [r["tokens_per_s"] for r in rows[-20:] if "tokens_per_s" in r]
evals = [r for r in rows if r.get("eval_loss") is not None]
tps = sum(speeds) / len(speeds) if speeds else 0.0
if ck >= target:
    state = "finished"
line = f"{name:13s} step {last.get('step', '-'):>6}/{target} (checkpoint {ck})  {state}"
if tps:
    per_step = (last["tokens"] / last["step"]) if last.get("step") else 0
    hours = (target - last["step"]) * per_step / tps / 3600 if per_step else float("nan")
    line += f"  {tps:.0f} tokens/s  ~{hours:.1f} h left"
if evals:
    line += f"  eval_loss {evals[-1]['eval_loss']:.3f} @ {evals[-1]['step']}"
print(line)
EOF
  done
  if alive "$STATE/scheduler.pid"; then echo "scheduler: running (pid $(cat "$STATE/scheduler.pid"))"
  else echo "scheduler: not running"; fi
}

stop() {
  local spec name
  if alive "$STATE/scheduler.pid"; then kill -TERM "$(cat "$STATE/scheduler.pid")"; fi
  for spec in "${RUNS[@]}"; do
    read -r name _ <<<"$spec"
    if alive "$STATE/$name.pid"; then
      say "$name: SIGTERM to pid $(cat "$STATE/$name.pid") (checkpoints its step, then exits)"
      kill -TERM "$(cat "$STATE/$name.pid")"
    fi
  done
}

ship() {
  local spec name recipe dir step sdir dest
  for spec in "${RUNS[@]}"; do
    read -r name recipe _ <<<"$spec"
    dir="$ROOT/$name"
    step=$(latest_step "$dir")
    if [ "$step" -lt "$(target_steps "$recipe")" ] || alive "$STATE/$name.pid"; then
      say "$name: not finished (step $step); not shipped"
      continue
    fi
    sdir=$(printf 'step-%08d' "$step")
    dest="$SHIP/$name"
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp/$sdir"
    cp "$dir/recipe.json" "$dir/metrics.jsonl" "$dir/latest.json" "$dest.tmp/"
    find "$dir/$sdir" -maxdepth 1 -type f ! -name 'optimizer.*' -exec cp {} "$dest.tmp/$sdir/" \;
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    say "$name: shipped step $step to $dest ($(du -sh "$dest/$sdir/model.safetensors" | cut -f1) of weights)"
  done
}

main() {
  mkdir -p "$STATE" "$LOGS"
  case "${1:-start}" in
    start)
      if alive "$STATE/scheduler.pid"; then
        echo "hnas_scale: the scheduler is already running (pid $(cat "$STATE/scheduler.pid"))"
        status
        exit 0
      fi
      setsid nohup nice -n 19 bash "$SELF" _scheduler >>"$LOGS/scheduler.log" 2>&1 </dev/null &
      echo $! >"$STATE/scheduler.pid"
      say "hnas_scale: scheduler started (pid $!); logs in $LOGS; progress: bash scripts/hnas_scale.sh status"
      ;;
    _scheduler) scheduler ;;
    status) status ;;
    stop) stop ;;
    ship) ship ;;
    *) echo "usage: bash scripts/hnas_scale.sh [start|status|stop|ship]" >&2; exit 2 ;;
  esac
}

# One line, read whole before it runs: editing this file while a scheduler runs cannot derail it.
main "$@"; exit $?

#!/usr/bin/env bash
# The summarization-setting runs of issue 29 item 3 (docs/TRAINING.md, "HNAS in the encoder of an
# encoder-decoder"): recipe s2s-hnas (a tiny BART trained from scratch on lead summaries of KJV +
# Shakespeare, HNAS in the encoder's self-attention) with seeds 0, 1, 2, one run at a time.
#
#   bash scripts/s2s_hnas.sh           start, or resume, the unfinished runs in the background and return
#   bash scripts/s2s_hnas.sh status    step, tokens/s, hours left, held-out loss and state of each run
#   bash scripts/s2s_hnas.sh stop      SIGTERM: the run finishes its step, checkpoints it and exits 0
#   bash scripts/s2s_hnas.sh ship      copy each finished run to checkpoints/<name>: recipe.json,
#                                      metrics.jsonl, latest.json, the final step without its optimizer
#                                      state (weights.safetensors: theta + the model) and model/
#   bash scripts/s2s_hnas.sh report    u per encoder layer over the seeds (python -m attnlab.train.seq2seq_hnas)
#
# Every run: `nice -n 19 python -m attnlab.train` (so scripts/quiet_block.sh pauses it too), one thread,
# CPU, in runs/s2s-hnas/<name> with its log in runs/s2s-hnas/logs/<name>.log; S2S_HNAS_JOBS (default 1)
# at a time, because the two cores are shared with the scale runs. Safe to re-run: a finished run is
# skipped, a started one continues with --resume (the same tensors as an uninterrupted run), a live
# trainer is waited for, and a second scheduler is not started. S2S_HNAS_STEPS=N trains (or extends)
# every run to N steps; S2S_HNAS_DIR (runs/s2s-hnas) and S2S_HNAS_SHIP (checkpoints) move the rest.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
source scripts/env.sh

ROOT=${S2S_HNAS_DIR:-runs/s2s-hnas}
JOBS=${S2S_HNAS_JOBS:-1}
STEPS=${S2S_HNAS_STEPS:-}
SHIP=${S2S_HNAS_SHIP:-checkpoints}
RECIPE=s2s-hnas
RUNS=("s2s-hnas-s0 0" "s2s-hnas-s1 1" "s2s-hnas-s2 2")  # name, seed
STATE="$ROOT/.state"
LOGS="$ROOT/logs"

say() { echo "$(date '+%F %T') $*"; }

alive() {  # alive PIDFILE: the process it names is running (and is one of ours)
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -qa "s2s_hnas\|attnlab.train" "/proc/$pid/cmdline" 2>/dev/null
}

target_steps() {
  if [ -n "$STEPS" ]; then echo "$STEPS"; return; fi
  "$PY" -c 'from attnlab.train.config import recipe_path
from attnlab.train.retrofit_config import HFRunConfig
print(HFRunConfig.from_file(recipe_path("s2s-hnas")).train.steps)'
}

latest_step() {  # latest_step RUNDIR: the step of its last complete checkpoint, or -1
  "$PY" -c 'import json, sys
try:
    print(int(json.load(open(sys.argv[1] + "/latest.json"))["step"]))
except (OSError, ValueError, KeyError):
    print(-1)' "$1"
}

run_one() {  # run_one NAME SEED: train (or resume) one run to the end, in the foreground
  local name=$1 seed=$2 dir="$ROOT/$1" pidfile="$STATE/$1.pid" log="$LOGS/$1.log"
  local args=(--recipe "$RECIPE" --seed "$seed" --out "$dir" --device cpu --no-progress)
  [ -n "$STEPS" ] && args+=(--steps "$STEPS")
  if alive "$pidfile"; then
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
  local spec name seed target
  target=$(target_steps)
  for spec in "${RUNS[@]}"; do
    read -r name seed <<<"$spec"
    if [ "$(latest_step "$ROOT/$name")" -ge "$target" ]; then
      say "$name: finished (step $(latest_step "$ROOT/$name")); skipped"
      continue
    fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    run_one "$name" "$seed" &
    sleep 5
  done
  wait
  say "scheduler: every run has ended"
  rm -f "$STATE/scheduler.pid"
}

status() {
  local spec name seed dir state target
  target=$(target_steps)
  for spec in "${RUNS[@]}"; do
    read -r name seed <<<"$spec"
    dir="$ROOT/$name"
    state="not started"
    [ -f "$dir/recipe.json" ] && state="stopped"
    alive "$STATE/$name.pid" && state="running (pid $(cat "$STATE/$name.pid"))"
    "$PY" - "$dir" "$target" "$state" "$name" <<'EOF'
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
line = f"{name:12s} step {last.get('step', '-'):>5}/{target} (checkpoint {ck})  {state}"
if tps and last.get("step"):
    per_step = last["tokens"] / last["step"]
    line += f"  {tps:.0f} source tokens/s  ~{(target - last['step']) * per_step / tps / 3600:.1f} h left"
if evals:
    line += f"  eval_loss {evals[-1]['eval_loss']:.3f} @ {evals[-1]['step']}"
if last.get("u"):
    line += "  u per layer " + " ".join(f"{sum(r) / len(r):.3f}" for r in last["u"])
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
  local spec name dir step sdir dest target
  target=$(target_steps)
  for spec in "${RUNS[@]}"; do
    read -r name _ <<<"$spec"
    dir="$ROOT/$name"
    step=$(latest_step "$dir")
    if [ "$step" -lt "$target" ] || alive "$STATE/$name.pid" || [ ! -d "$dir/model" ]; then
      say "$name: not finished (step $step); not shipped"
      continue
    fi
    sdir=$(printf 'step-%08d' "$step")
    dest="$SHIP/$name"
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp/$sdir"
    cp "$dir/recipe.json" "$dir/metrics.jsonl" "$dir/latest.json" "$dest.tmp/"
    find "$dir/$sdir" -maxdepth 1 -type f ! -name 'optimizer.*' -exec cp {} "$dest.tmp/$sdir/" \;
    cp -r "$dir/model" "$dest.tmp/model"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    say "$name: shipped step $step to $dest ($(du -sh "$dest" | cut -f1))"
  done
}

report() {  # u per encoder layer over the runs that have a checkpoint (finished or not: see "step")
  local spec name dirs=()
  for spec in "${RUNS[@]}"; do
    read -r name _ <<<"$spec"
    [ -f "$ROOT/$name/latest.json" ] && dirs+=("$ROOT/$name")
  done
  [ ${#dirs[@]} -gt 0 ] || { echo "s2s_hnas: no run has a checkpoint yet" >&2; exit 2; }
  "$PY" -m attnlab.train.seq2seq_hnas "${dirs[@]}"
}

main() {
  mkdir -p "$STATE" "$LOGS"
  case "${1:-start}" in
    start)
      if alive "$STATE/scheduler.pid"; then
        echo "s2s_hnas: the scheduler is already running (pid $(cat "$STATE/scheduler.pid"))"
        status
        exit 0
      fi
      setsid nohup nice -n 19 bash "$SELF" _scheduler >>"$LOGS/scheduler.log" 2>&1 </dev/null &
      echo $! >"$STATE/scheduler.pid"
      say "s2s_hnas: scheduler started (pid $!); logs in $LOGS; progress: bash scripts/s2s_hnas.sh status"
      ;;
    _scheduler) scheduler ;;
    status) status ;;
    stop) stop ;;
    ship) ship ;;
    report) report ;;
    *) echo "usage: bash scripts/s2s_hnas.sh [start|status|stop|ship|report]" >&2; exit 2 ;;
  esac
}

# One line, read whole before it runs: editing this file while a scheduler runs cannot derail it.
main "$@"; exit $?

#!/usr/bin/env bash
# One scheduler for attnlab's long training runs, sourced by the queue scripts (scripts/hnas_scale.sh,
# scripts/s2s_hnas.sh, scripts/causal_retrofit.sh), which set the queue and call `queue_main "$@"`:
#
#   QUEUE      the queue's name, for messages and usage (e.g. hnas_scale)
#   ROOT       its directory: runs ROOT/<name>, logs ROOT/logs/<name>.log, pid files ROOT/.state/
#   RUNS       one "name recipe seed [more train arguments]" per run, in the order they start; a run's
#              own `--steps N` is its target (STEPS, when set, still overrides every run)
#   JOBS       runs at a time (1)          STEPS   train (or extend) every run to this many steps ('')
#   SHIP       where `ship` copies finished runs (checkpoints)
#   THREADS    CPU threads per trainer (1): more give a different float summation order, so the same
#              seed then no longer reproduces a one-thread run bit for bit
#   REPORT     optional: a command `report` runs with the run directories that have a checkpoint
#
# Verbs: start (default: the scheduler in the background, then return), status, stop (SIGTERM: each
# run finishes its step, checkpoints it and exits 0), ship (each finished run to SHIP/<name>:
# recipe.json, metrics.jsonl, latest.json, the final step without its optimizer state, and model/ when
# the run writes one), report.
#
# Every trainer: `nice -n 19 python -m attnlab.train` (so scripts/quiet_block.sh pauses it), CPU, its
# own directory and log. Safe to re-run: a finished run (latest.json at its target step, in ROOT or
# already shipped to SHIP: a fresh checkout has no runs/) is skipped, a started one continues with
# --resume (bitwise the same as an uninterrupted run at the same THREADS), a run whose trainer is
# still alive is waited for, and a second scheduler is not started while one is alive. A run whose
# arguments name another run's directory (e.g. `--model ROOT/base/model`) starts after that run ends.
# A SIGKILL loses at most the steps since the last checkpoint.
set -euo pipefail

JOBS=${JOBS:-1}
STEPS=${STEPS:-}
SHIP=${SHIP:-checkpoints}
THREADS=${THREADS:-1}
REPORT=${REPORT:-}
STATE="$ROOT/.state"
LOGS="$ROOT/logs"

say() { echo "$(date '+%F %T') $*"; }

alive() {  # alive PIDFILE: the process it names is running (and is one of ours)
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -qa "$QUEUE\|train_queue\|attnlab.train" "/proc/$pid/cmdline" 2>/dev/null
}

target_steps() {  # target_steps RECIPE: STEPS, or the recipe's train.steps (native or Hugging Face recipe)
  if [ -n "$STEPS" ]; then echo "$STEPS"; return; fi
  "$PY" -c 'import sys
from attnlab.train.config import load_recipe, recipe_file_kind, recipe_path
from attnlab.train.retrofit_config import HFRunConfig
path = recipe_path(sys.argv[1])
cfg = HFRunConfig.from_file(path) if recipe_file_kind(path) else load_recipe(sys.argv[1])
print(cfg.train.steps)' "$1"
}

latest_step() {  # latest_step RUNDIR: the step of its last complete checkpoint, or -1
  "$PY" -c 'import json, sys
try:
    print(int(json.load(open(sys.argv[1] + "/latest.json"))["step"]))
except (OSError, ValueError, KeyError):
    print(-1)' "$1"
}

run_target() {  # run_target NAME: STEPS, else the run's own --steps, else its recipe's train.steps
  local spec n r seed rest args i
  for spec in "${RUNS[@]}"; do
    read -r n r seed rest <<<"$spec"
    [ "$n" = "$1" ] || continue
    if [ -n "$STEPS" ]; then echo "$STEPS"; return; fi
    read -ra args <<<"${rest:-}"
    for ((i = 0; i + 1 < ${#args[@]}; i++)); do
      if [ "${args[$i]}" = --steps ]; then echo "${args[$((i + 1))]}"; return; fi
    done
    target_steps "$r"
    return
  done
  echo "$QUEUE: no run named $1" >&2
  return 2
}

done_step() {  # done_step NAME: the larger of its run's and its shipped copy's step, or -1
  local a b
  a=$(latest_step "$ROOT/$1"); b=$(latest_step "$SHIP/$1")
  if [ "$a" -ge "$b" ]; then echo "$a"; else echo "$b"; fi
}

run_one() {  # run_one NAME RECIPE SEED [ARGS...]: train (or resume) one run to the end, in the foreground
  local name=$1 recipe=$2 seed=$3 dir="$ROOT/$1" pidfile="$STATE/$1.pid" log="$LOGS/$1.log"
  shift 3
  local args=(--recipe "$recipe" --seed "$seed" --out "$dir" --device cpu --no-progress --threads "$THREADS" "$@")
  [ -n "$STEPS" ] && args+=(--steps "$STEPS")
  if alive "$pidfile"; then  # a trainer of an earlier scheduler still runs: wait for it
    say "$name: already running (pid $(cat "$pidfile")); waiting for it"
    while alive "$pidfile"; do sleep 60; done
    return 0
  fi
  [ -f "$dir/recipe.json" ] && args+=(--resume)
  say "$name: start at step $(latest_step "$dir"): ${args[*]}" | tee -a "$log"
  OMP_NUM_THREADS=$THREADS OMP_WAIT_POLICY=PASSIVE MKL_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS \
    TOKENIZERS_PARALLELISM=false nice -n 19 "$PY" -m attnlab.train "${args[@]}" >>"$log" 2>&1 &
  echo $! >"$pidfile"
  local rc=0
  wait $! || rc=$?
  say "$name: trainer exited with status $rc at step $(latest_step "$dir")" | tee -a "$log"
  rm -f "$pidfile"
}

depends_on() {  # depends_on ARGS...: the names of this queue's runs whose directories ARGS mention
  local spec other arg
  for spec in "${RUNS[@]}"; do
    read -r other _ <<<"$spec"
    for arg in "$@"; do
      case "$arg" in "$ROOT/$other"|"$ROOT/$other/"*) echo "$other" ;; esac
    done
  done
}

scheduler() {
  trap 'say "scheduler: SIGTERM: no new run starts"; exit 0' TERM
  local spec name recipe seed rest dep
  declare -A started=()
  for spec in "${RUNS[@]}"; do
    read -r name recipe seed rest <<<"$spec"
    read -ra rest <<<"${rest:-}"
    if [ "$(done_step "$name")" -ge "$(run_target "$name")" ]; then
      say "$name: finished (step $(done_step "$name")); skipped"
      continue
    fi
    for dep in $(depends_on "${rest[@]}"); do  # wait for the run it builds on
      if [ -n "${started[$dep]:-}" ]; then
        say "$name: waits for $dep"
        wait "${started[$dep]}" || true
      fi
      if [ "$(done_step "$dep")" -lt "$(run_target "$dep")" ]; then
        say "$name: not started: $dep did not finish"
        continue 2
      fi
    done
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    run_one "$name" "$recipe" "$seed" "${rest[@]}" &
    started[$name]=$!
    sleep 5
  done
  wait
  say "scheduler: every run has ended"
  rm -f "$STATE/scheduler.pid"
}

status() {
  local spec name recipe dir state
  for spec in "${RUNS[@]}"; do
    read -r name recipe _ <<<"$spec"
    dir="$ROOT/$name"
    state="not started"
    [ -f "$dir/recipe.json" ] && state="stopped"
    if [ ! -f "$dir/recipe.json" ] && [ -f "$SHIP/$name/latest.json" ]; then dir="$SHIP/$name"; state="shipped"; fi
    alive "$STATE/$name.pid" && state="running (pid $(cat "$STATE/$name.pid"))"
    "$PY" - "$dir" "$(run_target "$name")" "$state" "$name" <<'EOF'
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
    state = "finished, shipped" if state == "shipped" else "finished"
line = f"{name:13s} step {last.get('step', '-'):>6}/{target} (checkpoint {ck})  {state}"
if tps and last.get("step") and ck < target:
    per_step = last["tokens"] / last["step"]
    line += f"  {tps:.0f} tokens/s  ~{(target - last['step']) * per_step / tps / 3600:.1f} h left"
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
  local spec name recipe dir step sdir dest
  for spec in "${RUNS[@]}"; do
    read -r name recipe _ <<<"$spec"
    dir="$ROOT/$name"
    step=$(latest_step "$dir")
    if [ "$step" -lt 0 ] && [ -f "$SHIP/$name/latest.json" ]; then
      say "$name: already shipped (step $(latest_step "$SHIP/$name")); left as it is"
      continue
    fi
    if [ "$step" -lt "$(run_target "$name")" ] || alive "$STATE/$name.pid"; then
      say "$name: not finished (step $step); not shipped"
      continue
    fi
    sdir=$(printf 'step-%08d' "$step")
    dest="$SHIP/$name"
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp/$sdir"
    cp "$dir/recipe.json" "$dir/metrics.jsonl" "$dir/latest.json" "$dest.tmp/"
    find "$dir/$sdir" -maxdepth 1 -type f ! -name 'optimizer.*' -exec cp {} "$dest.tmp/$sdir/" \;
    [ -d "$dir/model" ] && cp -r "$dir/model" "$dest.tmp/model"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    say "$name: shipped step $step to $dest ($(du -sh "$dest" | cut -f1))"
  done
}

report() {  # REPORT over the runs that have a checkpoint (finished or not: it prints each run's step)
  local spec name dirs=()
  [ -n "$REPORT" ] || { echo "$QUEUE: this queue has no report" >&2; exit 2; }
  for spec in "${RUNS[@]}"; do
    read -r name _ <<<"$spec"
    if [ -f "$ROOT/$name/latest.json" ]; then dirs+=("$ROOT/$name")
    elif [ -f "$SHIP/$name/latest.json" ]; then dirs+=("$SHIP/$name"); fi
  done
  [ ${#dirs[@]} -gt 0 ] || { echo "$QUEUE: no run has a checkpoint yet" >&2; exit 2; }
  # shellcheck disable=SC2086  # REPORT is a command line
  $REPORT "${dirs[@]}"
}

queue_main() {  # queue_main VERB: the queue script's entry point (its path is $SELF)
  mkdir -p "$STATE" "$LOGS"
  case "${1:-start}" in
    start)
      if alive "$STATE/scheduler.pid"; then
        echo "$QUEUE: the scheduler is already running (pid $(cat "$STATE/scheduler.pid"))"
        status
        return 0
      fi
      setsid nohup nice -n 19 bash "$SELF" _scheduler >>"$LOGS/scheduler.log" 2>&1 </dev/null &
      echo $! >"$STATE/scheduler.pid"
      say "$QUEUE: scheduler started (pid $!); logs in $LOGS; progress: bash $SELF status"
      ;;
    _scheduler) scheduler ;;
    status) status ;;
    stop) stop ;;
    ship) ship ;;
    report) report ;;
    *) echo "usage: bash $SELF [start|status|stop|ship|report]" >&2; return 2 ;;
  esac
}

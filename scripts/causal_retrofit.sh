#!/usr/bin/env bash
# The paper's Fig. 4 question on a local causal LM (issue 28 item 3; docs/RETROFIT.md, "A local causal
# LM to retrofit"): recipe causal-lm (a small GPT-2 trained from scratch with its own softmax attention)
# into runs/causal-retrofit/gpt2-kjv, then the HNAS retrofit of its model/ with seeds 0, 1, 2
# (the shipped retrofit-hnas recipe with --steps 200, the MiniLM retrofit's length), one run at a time.
#
#   bash scripts/causal_retrofit.sh           start, or resume, the unfinished runs in the background and return
#   bash scripts/causal_retrofit.sh status    step, tokens/s, time left, held-out loss (and u per layer) of each run
#   bash scripts/causal_retrofit.sh stop      SIGTERM: the run finishes its step, checkpoints it and exits 0
#   bash scripts/causal_retrofit.sh report    the LM's last held-out loss; u per layer over the seeds with 95 %
#                                             t-intervals and each retrofit's held-out loss at u = 0, 0.5, 1
#                                             and trained (python -m attnlab.train.retrofit --losses)
#   bash scripts/causal_retrofit.sh ship      finished runs -> CAUSAL_RETROFIT_SHIP/<name> (not needed for report)
#
# The scheduler is scripts/train_queue.sh: every trainer `nice -n 19 python -m attnlab.train`, one thread,
# CPU, in ROOT/<name> with its log in ROOT/logs/<name>.log; finished runs are skipped, started ones
# resumed with --resume, a live trainer is waited for; the retrofits name the LM's directory, so they
# start after it has finished. Environment: CAUSAL_RETROFIT_DIR (ROOT, runs/causal-retrofit),
# CAUSAL_RETROFIT_STEPS (train every run, the LM too, to N steps: for a quick check), CAUSAL_RETROFIT_CORPUS
# (a text file instead of kjv+shakespeare, both stages), CAUSAL_RETROFIT_SHIP (checkpoints/causal-retrofit).
# Do not extend the LM once the retrofits have started: they read its model/.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
source scripts/env.sh

QUEUE=causal_retrofit
ROOT=${CAUSAL_RETROFIT_DIR:-runs/causal-retrofit}
JOBS=1
STEPS=${CAUSAL_RETROFIT_STEPS:-}
SHIP=${CAUSAL_RETROFIT_SHIP:-checkpoints/causal-retrofit}
THREADS=1
CORPUS=${CAUSAL_RETROFIT_CORPUS:+--corpus $CAUSAL_RETROFIT_CORPUS}
RUNS=("gpt2-kjv causal-lm 0 $CORPUS")  # name, recipe, seed, more train arguments
for seed in 0 1 2; do  # --model names the LM's directory: the scheduler starts these after it
  RUNS+=("hnas-s$seed retrofit-hnas $seed --model $ROOT/gpt2-kjv/model --steps 200 ${CORPUS:---corpus kjv+shakespeare}")
done
REPORT="bash $SELF _report"

report_runs() {  # report_runs DIR...: the LM's held-out loss, then the retrofits' u and losses
  local dir hnas=()
  for dir in "$@"; do
    case "$dir" in
      */gpt2-kjv) "$PY" -c 'import json, sys
from attnlab.train import read_metrics
evals = [r for r in read_metrics(sys.argv[1] + "/metrics.jsonl") if r.get("eval_loss") is not None]
print(json.dumps({"lm": sys.argv[1], "step": evals[-1]["step"], "eval_loss": evals[-1]["eval_loss"]}))' "$dir" ;;
      *) hnas+=("$dir") ;;
    esac
  done
  [ ${#hnas[@]} -gt 0 ] || { echo "$QUEUE: no retrofit has a checkpoint yet" >&2; return 2; }
  "$PY" -m attnlab.train.retrofit --losses "${hnas[@]}"
}

source scripts/train_queue.sh

# One line, read whole before it runs: editing this file while a scheduler runs cannot derail it.
if [ "${1:-}" = _report ]; then shift; report_runs "$@"; exit $?; fi; queue_main "$@"; exit $?

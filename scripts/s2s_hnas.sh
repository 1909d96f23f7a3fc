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
# The scheduler is scripts/train_queue.sh (what re-running, stopping and shipping do). Every run:
# `nice -n 19 python -m attnlab.train` (so scripts/quiet_block.sh pauses it too), CPU, in
# runs/s2s-hnas/<name> with its log in runs/s2s-hnas/logs/<name>.log; S2S_HNAS_JOBS (default 1) at a
# time, because the two cores are shared with the scale runs. S2S_HNAS_STEPS=N trains (or extends)
# every run to N steps; S2S_HNAS_DIR (runs/s2s-hnas), S2S_HNAS_SHIP (checkpoints) and S2S_HNAS_THREADS
# (1 per trainer) move the rest.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
source scripts/env.sh

QUEUE=s2s_hnas
ROOT=${S2S_HNAS_DIR:-runs/s2s-hnas}
JOBS=${S2S_HNAS_JOBS:-1}
STEPS=${S2S_HNAS_STEPS:-}
SHIP=${S2S_HNAS_SHIP:-checkpoints}
THREADS=${S2S_HNAS_THREADS:-1}
RUNS=("s2s-hnas-s0 s2s-hnas 0" "s2s-hnas-s1 s2s-hnas 1" "s2s-hnas-s2 s2s-hnas 2")  # name, recipe, seed
REPORT="$PY -m attnlab.train.seq2seq_hnas"  # u per encoder layer over the seeds
source scripts/train_queue.sh

# One line, read whole before it runs: editing this file while a scheduler runs cannot derail it.
queue_main "$@"; exit $?

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
# The scheduler is scripts/train_queue.sh (what re-running, stopping and shipping do). Every run:
# `nice -n 19`, CPU, its own directory runs/hnas-scale/<name> and log runs/hnas-scale/logs/<name>.log;
# at most HNAS_SCALE_JOBS (default 2) at a time, in the order below; save_every = 100 steps.
# HNAS_SCALE_STEPS=N trains (or extends) every run to N steps; HNAS_SCALE_DIR (runs/hnas-scale),
# HNAS_SCALE_SHIP (checkpoints) and HNAS_SCALE_THREADS (1 per trainer) move the rest. A run already
# shipped to HNAS_SCALE_SHIP at its target step counts as finished (a fresh checkout has no runs/).
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
source scripts/env.sh

QUEUE=hnas_scale
ROOT=${HNAS_SCALE_DIR:-runs/hnas-scale}
JOBS=${HNAS_SCALE_JOBS:-2}
STEPS=${HNAS_SCALE_STEPS:-}
SHIP=${HNAS_SCALE_SHIP:-checkpoints}
THREADS=${HNAS_SCALE_THREADS:-1}
# name, recipe, seed: one seed of each variant first, so that all three can be compared earliest.
RUNS=(
  "enc8-hnas-s0 enc8-hnas 0"
  "enc8-unas-s0 enc8-unas 0"
  "enc8-dnas-s0 enc8-dnas 0"
  "enc8-hnas-s1 enc8-hnas 1"
  "enc8-hnas-s2 enc8-hnas 2"
)
REPORT=""
source scripts/train_queue.sh

# One line, read whole before it runs: editing this file while a scheduler runs cannot derail it.
queue_main "$@"; exit $?

#!/usr/bin/env bash
# The session's benchmarks in one quiet block (docs/BENCHMARKS.md: "say the load average next to every
# figure"): the background training runs (attnlab.train, e.g. scripts/hnas_scale.sh) are paused with
# SIGSTOP for the block and resumed on exit (also on Ctrl+C or an error), then each command runs in
# turn with the load average printed before and after it. Outputs: OUT/NAME.log (stdout + stderr) and
# OUT/loads.txt. Run it only when no test suite or helper is running.
#
#   bash scripts/quiet_block.sh OUT 'name=command' ['name=command' ...]
#   bash scripts/quiet_block.sh /tmp/qb 'llama=python3 -m attnlab.bench analysis --causal llama'
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
OUT=${1:?usage: quiet_block.sh OUT 'name=command' ...}
shift
mkdir -p "$OUT"
PAUSED=$(pgrep -f "attnlab.train" | tr '\n' ' ')
resume() { [ -n "$PAUSED" ] && kill -CONT $PAUSED 2>/dev/null; echo "$(date '+%T') resumed: ${PAUSED:-none}" >> "$OUT/loads.txt"; }
trap resume EXIT
[ -n "$PAUSED" ] && kill -STOP $PAUSED
echo "$(date '+%T') paused: ${PAUSED:-none}" >> "$OUT/loads.txt"
sleep 20  # let the load average fall a little
for item in "$@"; do
  name=${item%%=*}
  cmd=${item#*=}
  echo "$(date '+%T') $name before: $(cut -d' ' -f1-3 /proc/loadavg)  $cmd" | tee -a "$OUT/loads.txt"
  PYTHONPATH=. bash -c "$cmd" > "$OUT/$name.log" 2>&1
  echo "$(date '+%T') $name after (rc $?): $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/loads.txt"
done

#!/usr/bin/env bash
# Install everything (scripts/install.sh) and start the attnlab app on the embedded default model.
#   bash scripts/app.sh                      serves http://127.0.0.1:8501
#   ATTNLAB_ADDRESS=0.0.0.0 bash scripts/app.sh   to listen on every interface (containers)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/env.sh
exec "$PY" app/serve.py \
  --server.address "${ATTNLAB_ADDRESS:-127.0.0.1}" --server.port "${ATTNLAB_PORT:-8501}" \
  --server.headless true --browser.gatherUsageStats false

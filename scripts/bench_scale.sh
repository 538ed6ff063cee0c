#!/usr/bin/env bash
# Peak RSS per rank, checkpoint write/read time and bytes per rank, and export's peak RSS, against
# world size (ep = world), for this checkout and (with BEFORE=<commit>) an older one side by side.
# Usage: [BEFORE=028a211] scripts/bench_scale.sh [--ep 2,4,8] [--scale 1,4] [--experts 32] [--export]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
PY="${VPY:-$ROOT/.venv/bin/python}"
if [ -n "${BEFORE:-}" ]; then
  OLD="$(mktemp -d)/before"
  mkdir -p "$OLD" && git archive "$BEFORE" | tar -x -C "$OLD"
  "$PY" -m moe_trainer.bench.scale --code "$OLD" --label "before ($BEFORE)" --out runs/bench_scale "$@"
fi
exec "$PY" -m moe_trainer.bench.scale --label "after" --out runs/bench_scale "$@"

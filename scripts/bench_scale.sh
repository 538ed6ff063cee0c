#!/usr/bin/env bash
# Peak RSS per rank, checkpoint write/read time and bytes per rank, and export's peak RSS, against
# world size (ep = world), for this checkout and (with BEFORE=<commit>) an older one side by side.
# Usage: [BEFORE=028a211] scripts/bench_scale.sh [--ep 2,4,8] [--scale 1,4] [--experts 32] [--export]
# Makes .venv if missing and installs the project, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
PY="${VPY:-$ROOT/.venv/bin/python}"
if [ -n "${BEFORE:-}" ]; then
  OLD="$(mktemp -d)/before"
  mkdir -p "$OLD" && git archive "$BEFORE" | tar -x -C "$OLD"
  "$PY" -m moe_trainer.bench.scale --code "$OLD" --label "before ($BEFORE)" --out runs/bench_scale "$@"
fi
exec "$PY" -m moe_trainer.bench.scale --label "after" --out runs/bench_scale "$@"

#!/usr/bin/env bash
# The headline benchmarks (within about 30 minutes on 2 cores): end to end vs transformers + DeepSpeed and
# expert parallelism vs DeepSpeed AutoEP (ep = world 1 and 2), each job alone in rounds alternating the order.
# Rewrites the table between the bench_all markers of docs/BENCHMARKS.md and draws PNGs in docs/bench/.
# Usage: scripts/bench_all.sh [--smoke] [--only train,ep]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
exec .venv/bin/python -m moe_trainer.bench.bench_all "$@"

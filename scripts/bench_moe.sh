#!/usr/bin/env bash
# Benchmark one MoE layer (fwd+bwd): ours (grouped, loop) vs DeepSpeed vs transformers; writes docs/BENCHMARKS_moe.md.
# Usage: scripts/bench_moe.sh [--iters N] [--warmup N] [--impls a,b] [--dtypes fp32,bf16] [--profile] [--out PATH]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
exec .venv/bin/python -m moe_trainer.bench.moe "$@"

#!/usr/bin/env bash
# Expert-parallel throughput: our trainer at world 1/2/4 (fp32, bf16; dedup on/off) vs DeepSpeed AutoEP on
# transformers' DeepseekV3ForCausalLM with our weights. Prints a markdown table (see docs/BENCHMARKS_ep.md).
# Usage: scripts/bench_ep.sh [--steps N] [--warmup N] [--worlds 1,2,4] [--dtypes fp32,bf16] [--peer-worlds 2,4] [--out JSON]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
exec .venv/bin/python -m moe_trainer.bench.ep "$@"

#!/usr/bin/env bash
# End-to-end training speed: our trainer (1 rank, 2 ranks dp2/ep2) vs transformers' DeepseekV3ForCausalLM
# under the same DeepSpeed ZeRO-1 engine, fp32 and bf16, on configs/moe_bench.yaml; writes docs/BENCHMARKS_train.md.
# Usage: scripts/bench_train.sh [--steps N] [--warmup N] [--runs ours1,hf,ours2] [--dtypes fp32,bf16] [--rounds N]
#                               [--hf-experts grouped_mm] [--out PATH]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
exec .venv/bin/python -m moe_trainer.bench.train "$@"

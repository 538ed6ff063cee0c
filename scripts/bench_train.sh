#!/usr/bin/env bash
# End-to-end training speed: our trainer (1 rank, 2 ranks dp2/ep2) vs transformers' DeepseekV3ForCausalLM
# under the same DeepSpeed ZeRO-1 engine, fp32 and bf16, on configs/moe_bench.yaml; writes docs/BENCHMARKS_train.md.
# Usage: scripts/bench_train.sh [--steps N] [--warmup N] [--runs ours1,hf,ours2] [--dtypes fp32,bf16] [--rounds N]
#                               [--hf-experts grouped_mm] [--out PATH]
# Makes .venv if missing and installs the project with its test extras (the peers: transformers), as
# train.sh and test.sh do; DS_ACCELERATOR=cpu where there is no GPU.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
exec .venv/bin/python -m moe_trainer.bench.train "$@"

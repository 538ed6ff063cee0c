#!/usr/bin/env bash
# Benchmark one MoE layer (fwd+bwd): ours (grouped, loop) vs DeepSpeed vs transformers; writes docs/BENCHMARKS_moe.md.
# Usage: scripts/bench_moe.sh [--iters N] [--warmup N] [--impls a,b] [--dtypes fp32,bf16] [--profile] [--out PATH]
# Makes .venv if missing and installs the project with its test extras (the peers: transformers), as
# train.sh and test.sh do; DS_ACCELERATOR=cpu where there is no GPU.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
exec .venv/bin/python -m moe_trainer.bench.moe "$@"

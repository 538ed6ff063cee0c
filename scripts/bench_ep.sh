#!/usr/bin/env bash
# Expert-parallel throughput: our trainer at world 1/2/4 (fp32, bf16; dedup on/off) vs DeepSpeed AutoEP on
# transformers' DeepseekV3ForCausalLM with our weights. Prints a markdown table (see docs/BENCHMARKS_ep.md).
# Usage: scripts/bench_ep.sh [--steps N] [--warmup N] [--worlds 1,2,4] [--dtypes fp32,bf16] [--peer-worlds 2,4] [--out JSON]
# Makes .venv if missing and installs the project with its test extras (the peers: transformers), as
# train.sh and test.sh do; DS_ACCELERATOR=cpu where there is no GPU.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
exec .venv/bin/python -m moe_trainer.bench.ep "$@"

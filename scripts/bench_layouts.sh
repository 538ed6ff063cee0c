#!/usr/bin/env bash
# MoE (DeepSeek-V3 style) vs dense (Llama 3) layouts at equal model FLOPs per token on 4 ranks:
# tokens/s, bytes per step by collective, parameter + optimizer memory per rank, next to tools/plan.py.
#   ./scripts/bench_layouts.sh [--steps 3] [--only ep,dense] [--json rows.json]
# Writes nothing but stdout (and --json); docs/BENCHMARKS_layouts.md holds a recorded run.
# Makes .venv if missing and installs the project with its test extras, as train.sh and test.sh do;
# DS_ACCELERATOR=cpu where there is no GPU.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m moe_trainer.bench.layouts "$@"

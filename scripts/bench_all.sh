#!/usr/bin/env bash
# The headline benchmarks (within about 30 minutes on 2 cores): end to end vs transformers + DeepSpeed and
# expert parallelism vs DeepSpeed AutoEP (ep = world 1 and 2), each job alone in rounds alternating the order.
# Rewrites the table between the bench_all markers of docs/BENCHMARKS.md and draws PNGs in docs/bench/.
# Usage: scripts/bench_all.sh [--smoke] [--only train,ep]
# Makes .venv if missing and installs the project, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
exec .venv/bin/python -m moe_trainer.bench.bench_all "$@"

#!/usr/bin/env bash
# The expert all-to-alls hidden by parallel.overlap=a2a at ep 2 on CPU ranks, with the emulated link set
# so that the all-to-all time is 0.5x, 1x and 2x the compute; alternating rounds (moe_trainer/bench/overlap.py).
# Usage: scripts/bench_overlap.sh [--ratios 0.5,1,2] [--steps 6] [--warmup 2] [--rounds 3] [--json PATH] [--pp 2 --v 2]
# Makes .venv if missing and installs the project, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
exec "$VPY" -m moe_trainer.bench.overlap "$@"

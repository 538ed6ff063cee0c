#!/usr/bin/env bash
# What the replica check, the spike guard and the straggler gather cost when no fault happens: the same job
# alone, in alternating rounds, with them off and on (moe_trainer/bench/faults.py).
# Usage: scripts/bench_faults.sh [--ranks 2] [--steps 12] [--rounds 3] [--config configs/moe_bench.yaml]
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project ""
exec "$VPY" -m moe_trainer.bench.faults "$@"

#!/usr/bin/env bash
# Pipeline parallelism: bubble measured vs theory (the trainer under the deepspeed launcher, pp 2 and 4,
# m = 1, 4, 8, 16), activation memory per stage under GPipe order vs 1F1B, and the largest micro-batch in a
# fixed activation budget with recompute none/selective/full and its tokens/s. Prints markdown tables
# (see docs/BENCHMARKS_pp.md).
# Interleaved 1F1B (--parts interleaved, --vs 1,2,4 [--p2p shm|gloo]): bubble and peak activation memory per (pp, v, m).
# The executor on stages of fixed cost (--parts schedule [--transports shm,shm-strict,gloo] [--stage-ms 60]):
# the bubble of the schedule and the transfers alone, next to (p-1)/(v m+p-1).
# Usage: scripts/bench_pp.sh [--parts bubble,memory,recompute,interleaved,schedule] [--pps 2,4] [--vs 1,2,4] [--ms 1,4,8,16] [--real-gpipe]
#                            [--seq 512] [--budget-mbs 4] [--out JSON] [--timeline PNG]
# Makes .venv if missing and installs the project with its test extras (the peers: transformers), as
# train.sh and test.sh do; DS_ACCELERATOR=cpu where there is no GPU.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m moe_trainer.bench.pp "$@"

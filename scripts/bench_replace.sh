#!/usr/bin/env bash
# Online expert re-placement under skewed routing: step time with parallel.replace_every on vs off at ep 2,
# alternating rounds, the ratio with its spread, and the bytes and wall time of a re-placement (see
# docs/BENCHMARKS_ep.md). Usage: scripts/bench_replace.sh [--rounds 3] [--steps 24] [--every 8] [--skew 0.3]
# [--world 2] [--redundant R] [--topk K] [--set KEY=VALUE ...] [--predict] [--out JSON]; --predict sets the
# step model's prediction (plan/time.py on this machine's rates, the run's load replayed) beside each run
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
exec .venv/bin/python -m moe_trainer.bench.replace "$@"

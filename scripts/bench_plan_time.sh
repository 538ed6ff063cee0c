#!/usr/bin/env bash
# The step-time model (tools/plan.py --time) held to this CPU: moe_tiny's predicted step at 1 and 2
# ranks from the measured matmul rate and copy bandwidth, against the trainer's measured median step
# (moe_trainer/bench/plan_time.py). Arguments go to the module (--ranks 1,2 --steps 30 --out F.json).
# Makes .venv if missing and installs the project, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
exec .venv/bin/python -m moe_trainer.bench.plan_time "$@"

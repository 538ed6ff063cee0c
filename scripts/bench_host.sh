#!/usr/bin/env bash
# Host time of a MoE decoder layer by proxy on the CPU (moe_trainer/bench/host_proxy.py): Megatron-Core's
# MoE TransformerLayer (local, non-TE modules; megatron-core from the test extra) against this trainer's
# layer on the accelerator path, forward + backward at tiny shapes on one thread, in alternating rounds;
# the kernels each launches by part, the figure derived for a GPU and what `tools/plan.py calibrate`
# reads with it. Arguments go to the module (--rounds, --iters, --tokens, --out F.json).
# Makes .venv if missing and installs the project, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"  # megatron-core warns at import that TE and Apex are absent
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
exec .venv/bin/python -m moe_trainer.bench.host_proxy "$@"

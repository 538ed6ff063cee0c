#!/usr/bin/env bash
# The accelerator path forced on CPU vs the CPU back end (moe_trainer/bench/kernels.py): whole-model
# forward + backward, back ends taking turns round by round. Arguments go to the module.
source "$(dirname "$0")/_env.sh"
install_project ""
exec "$VPY" -m moe_trainer.bench.kernels "$@"

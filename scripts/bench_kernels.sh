#!/usr/bin/env bash
# The accelerator path forced on CPU vs the CPU back end (moe_trainer/bench/kernels.py): whole-model
# forward + backward, back ends taking turns round by round. Arguments go to the module.
# --proxy [ARGS]: instead, the GPU-time proxy (moe_trainer/bench/kernel_proxy.py): ops and bytes
# outside the GEMMs, GEMM FLOPs and minimal bytes, of the accelerator path's forward + backward.
# Makes .venv if missing and installs the project, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
if [ "${1:-}" = "--proxy" ]; then
  shift
  exec .venv/bin/python -m moe_trainer.bench.kernel_proxy "$@"
fi
exec .venv/bin/python -m moe_trainer.bench.kernels "$@"

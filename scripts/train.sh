#!/usr/bin/env bash
# Make .venv if missing, install the project, and train the default MoE config on the
# default corpus with the DeepSpeed launcher: 2 ranks on CPU, every GPU where there are GPUs.
# Extra arguments go to the trainer: ./scripts/train.sh --set train.max_steps=20
# --max-restarts K (first): after a failure the job restarts itself, resuming from its last good
# checkpoint, up to K times (python -m moe_trainer.restart, as torchrun's --max-restarts).
source "$(dirname "$0")/_env.sh"
RESTARTS=0
if [ "${1:-}" = "--max-restarts" ]; then RESTARTS="${2:?--max-restarts needs a count}"; shift 2; fi
install_project ""
if has_gpu; then NGPU="$(nvidia-smi -L | wc -l)"; else NGPU=2; fi
# CONFIG=path names a config file; unset, the trainer's default (configs/moe_tiny.yaml) applies, and a
# resume then counts only the --sets as changes to the run directory's config.yaml
CONFIG_ARGS=()
if [ -n "${CONFIG:-}" ]; then CONFIG_ARGS=(--config "$CONFIG"); fi
exec "$VPY" -m moe_trainer.restart --max-restarts "$RESTARTS" -- \
  "$ROOT/.venv/bin/deepspeed" --num_gpus "$NGPU" --module moe_trainer.train ${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"} "$@"

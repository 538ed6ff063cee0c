#!/usr/bin/env bash
# Make .venv if missing, install the project, and train the default MoE config on the
# default corpus with the DeepSpeed launcher: 2 ranks on CPU, every GPU where there are GPUs.
# Extra arguments go to the trainer: ./scripts/train.sh --set train.max_steps=20
source "$(dirname "$0")/_env.sh"
install_project ""
if has_gpu; then NGPU="$(nvidia-smi -L | wc -l)"; else NGPU=2; fi
CONFIG="${CONFIG:-configs/moe_tiny.yaml}"
exec "$ROOT/.venv/bin/deepspeed" --num_gpus "$NGPU" --module moe_trainer.train --config "$CONFIG" "$@"

"""Rewrite a checkpoint under another layout, without training:

    deepspeed --num_gpus N --module moe_trainer.reshard --config configs/X.yaml \
        --set train.resume=RUN/checkpoints/step_K --set run.out_dir=OUT [--set parallel.ep=...]

This layout's ranks load the checkpoint (each reading only the pieces it holds) and write it
again as OUT/checkpoints/step_K. Training never needs it (any layout resumes from any
checkpoint); it shows what a layout loaded, exactly, and the reshard tests compare the two.
"""
from __future__ import annotations

import os
import sys

from .checkpoint import CheckpointError
from .config import ConfigError, validate_layout
from .resolve import load_config
from .hf import HFFormatError
from .train import _single_process_env, exit_without_final_collection, local_world_size, make_trainer, parse_args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        _single_process_env()
        layout = validate_layout(cfg, int(os.environ["WORLD_SIZE"]), local_world_size())
        if cfg.train.resume in ("auto", "none"):
            raise ConfigError("train.resume must name the checkpoint directory to reshard.")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from . import checkpoint
    from .parallel.launch import shutdown_distributed
    try:
        trainer = make_trainer(cfg, layout)
        trainer.prepare_run_dir()
        trainer.maybe_resume()
        path = checkpoint.save(trainer)
    except (CheckpointError, ConfigError, HFFormatError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    shutdown_distributed()
    if path is not None:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    exit_without_final_collection(main())

#!/usr/bin/env python
"""Expert-load analysis of a run directory and redundant-expert placement planning.

  python tools/expert_load.py RUN_DIR --out DIR [--step N]
  python tools/expert_load.py plan --load FILE|RUN_DIR --replicas R --groups G --nodes N --gpus P --out plan.json

The logic lives in moe_trainer.expert_load; `--help` on either form explains it.
"""
import sys
from pathlib import Path

try:
    from moe_trainer.expert_load import main
except ModuleNotFoundError as e:  # run from a checkout without installing the package
    if e.name not in ("moe_trainer", "moe_trainer.expert_load"):
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moe_trainer.expert_load import main

if __name__ == "__main__":
    sys.exit(main())

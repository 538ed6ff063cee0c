"""CLI for the collective benchmark; the logic is moe_trainer/bench/collectives.py.

    deepspeed --num_gpus 2 tools/bench_collectives.py [--max-bytes 16M --iters 10 --json out.json]
    torchrun --nproc-per-node 2 tools/bench_collectives.py [...]
"""
import os
import sys

# Launchers run this file by path, so the repository root is not on sys.path.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from moe_trainer.bench.collectives import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

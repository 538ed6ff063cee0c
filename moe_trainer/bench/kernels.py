"""The accelerator path forced on CPU against the CPU back end: forward + backward of a whole
model (configs/moe_bench.yaml by default) in one process, the back ends taking turns round by
round (the first back end of a round rotates), median step time per round after warm-up, and the
ratio accelerator / cpu with its spread over rounds.

The accelerator path is not at home on a CPU (torch._grouped_mm's CPU fallback is a loop of
GEMMs, SDPA's CPU kernels are slower than the explicit attention); the target is that nothing in
it is pathological: within 1.5x of the CPU back end in bf16.

    python -m moe_trainer.bench.kernels [--config C] [--dtypes bf16,fp32] [--rounds 5] [--steps 4] [--warmup 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from .. import kernels
from ..resolve import load_config
from ..models.registry import build_model

BACKENDS = ("cpu", "accelerator")


def step_seconds(model, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    out = model(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def measure(config: str, dtype: torch.dtype, rounds: int, steps: int, warmup: int, micro_batch: int) -> dict:
    cfg = load_config(config, [])
    models = {}
    for name in BACKENDS:
        with kernels.using(name):
            models[name] = build_model(cfg.model, seed=cfg.run.seed).to(dtype)
    ids = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.train.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    for model in models.values():  # warm-up: first calls build kernels and allocator pools
        for _ in range(warmup):
            step_seconds(model, ids)
    medians = {name: [] for name in BACKENDS}
    for r in range(rounds):
        order = BACKENDS[r % 2:] + BACKENDS[:r % 2]
        for name in order:
            medians[name].append(statistics.median(step_seconds(models[name], ids) for _ in range(steps)))
    ratios = [a / c for a, c in zip(medians["accelerator"], medians["cpu"])]
    return {"dtype": str(dtype).removeprefix("torch."), "step_s": {k: statistics.median(v) for k, v in medians.items()},
            "ratio_accelerator_over_cpu": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds": rounds, "steps_per_round": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/moe_bench.yaml")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        print("bench.kernels: --rounds and --steps must be at least 1 and --warmup at least 0.", file=sys.stderr)
        return 2
    results = []
    for name in a.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(name.strip())
        if dtype is None:
            print(f"bench.kernels: --dtypes takes bf16 and fp32, got {name!r}.", file=sys.stderr)
            return 2
        res = measure(a.config, dtype, a.rounds, a.steps, a.warmup, a.micro_batch)
        results.append(res)
        print(f"{a.config} {res['dtype']}: cpu {res['step_s']['cpu']:.3f} s, accelerator "
              f"{res['step_s']['accelerator']:.3f} s per forward + backward; accelerator / cpu "
              f"{res['ratio_accelerator_over_cpu']:.2f}x (rounds {res['ratio_min']:.2f}-{res['ratio_max']:.2f}x, "
              f"{a.rounds} rounds of {a.steps} steps, {torch.get_num_threads()} threads)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "python -m moe_trainer.bench.kernels " + " ".join(argv or sys.argv[1:]),
                       "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

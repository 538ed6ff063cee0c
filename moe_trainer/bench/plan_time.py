"""This CPU as a calibration point of the step-time model (plan/time.py): the same model, fed this
machine's measured matmul rate (metrics.measure_matmul_tflops, the roofline the trainer's MFU uses)
and memory bandwidth (a large tensor copy), predicts the trainer's step of configs/moe_tiny.yaml at
1 and 2 ranks; the trainer then runs that config through the DeepSpeed launcher and its measured
median step (metrics.jsonl, after a warm-up) is held against the prediction.

On this machine every efficiency is 1 (the rates are measured, not datasheet peaks), the glue is
eager (no fused kernels), and the links between ranks are shared memory at the copy bandwidth.

    python -m moe_trainer.bench.plan_time [--ranks 1,2] [--steps 30] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..resolve import load_config
from ..metrics import measure_matmul_tflops
from ..plan.gpus import Efficiency, Gpu
from ..plan.time import Mechanisms, step_time
from ..plan.work import setup_from_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/moe_tiny.yaml"
WARMUP = 3  # steps left out of the median (start-up, allocator warm-up)


def copy_bandwidth(nbytes: int = 256 << 20, trials: int = 5) -> float:
    """Bytes per second a large copy moves (read + write), best of `trials`."""
    a = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * nbytes / (time.perf_counter() - start))
    return best


def predict(ranks: int, threads: int) -> dict:
    """The model's step for moe_tiny on `ranks` CPU ranks of `threads` threads each."""
    torch.set_num_threads(threads)
    tflops = measure_matmul_tflops(torch.float32, torch.device("cpu"))
    bw = copy_bandwidth()
    cpu = Gpu(f"this CPU ({threads} threads per rank)", tflops, 0.0, bw / 1e12, bw / 1e9, bw / 1e9, ranks,
              "measured: metrics.measure_matmul_tflops and a tensor copy")
    # a CPU rank runs each op in the thread that dispatches it: no launch queue for the host to fall behind
    eff = Efficiency(gemm=1.0, grouped=1.0, attn_fwd=1.0, attn_bwd=1.0, memory=1.0, nvlink=1.0, net=1.0, a2a=1.0,
                     host_eager_us=0.0, launch_us=0.0, graph_us=0.0, sync_us=0.0)
    cfg = load_config(str(ROOT / CONFIG), ["train.dtype=fp32"])
    r = step_time(setup_from_config(cfg, ranks, gpus_per_node=ranks), cpu, eff, Mechanisms(), 1.0)
    return {"matmul_tflops": tflops, "copy_gbs": bw / 1e9, "step_s": r.step, "compute_s": r.compute,
            "exposed_comm_s": r.exposed_comm, "optimizer_s": r.optimizer}


def measure(ranks: int, steps: int) -> dict:
    """The trainer's median step over `steps` steps after a warm-up, through the DeepSpeed launcher."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"train.max_steps={steps}", f"run.out_dir={tmp}/run", "train.log_every=1", "train.eval_every=0",
                "train.checkpoint_every=0", "train.dtype=fp32"]
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
               str(29700 + ranks), "--module", "moe_trainer.train", "--config", str(ROOT / CONFIG)]
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        if done.returncode:
            raise RuntimeError(f"the trainer failed ({done.returncode}): {done.stderr[-2000:]}")
        rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_last_s"] for r in rows if "step_time_last_s" in r and r.get("step", 0) > WARMUP]
    split = {k: statistics.median(r[k] for r in rows if k in r and r.get("step", 0) > WARMUP)
             for k in ("time.compute_s", "time.optimizer_s", "time.exposed_all_to_all_s") if any(k in r for r in rows)}
    return {"step_s": statistics.median(times), "steps": len(times), **split}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    try:
        ranks = [int(r) for r in a.ranks.split(",")]
        assert ranks and all(r >= 1 for r in ranks) and a.steps > WARMUP
    except (ValueError, AssertionError):
        print(f"bench.plan_time: --ranks takes positive counts like 1,2 and --steps more than {WARMUP}.",
              file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    results = []
    for n in ranks:
        pred = predict(n, max(1, cores // n))
        meas = measure(n, a.steps)
        ratio = pred["step_s"] / meas["step_s"]
        results.append({"ranks": n, "predicted": pred, "measured": meas, "predicted_over_measured": ratio})
        print(f"moe_tiny, {n} rank(s): predicted step {pred['step_s'] * 1e3:.1f} ms (compute "
              f"{pred['compute_s'] * 1e3:.1f}, exposed comm {pred['exposed_comm_s'] * 1e3:.1f}, optimizer "
              f"{pred['optimizer_s'] * 1e3:.1f}; matmul {pred['matmul_tflops']:.3f} TFLOP/s, copy "
              f"{pred['copy_gbs']:.1f} GB/s), measured median {meas['step_s'] * 1e3:.1f} ms over {meas['steps']} "
              f"steps: predicted / measured {ratio:.2f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": "python -m moe_trainer.bench.plan_time " + " ".join(
            argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "cores": cores, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

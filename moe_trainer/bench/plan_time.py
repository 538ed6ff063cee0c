"""This CPU as a calibration point of the step-time model (plan/time.py): the same model, fed this
machine's measured matmul rate (metrics.measure_matmul_tflops, the roofline the trainer's MFU uses)
and memory bandwidth (a large tensor copy), predicts the trainer's step of configs/moe_tiny.yaml at
1 and 2 ranks; the trainer then runs that config through the DeepSpeed launcher and its measured
median step (metrics.jsonl, after a warm-up) is held against the prediction.

On this machine every efficiency is 1 (the rates are measured, not datasheet peaks), the glue is
eager (no fused kernels), and the links between ranks are shared memory at the copy bandwidth. The
host is `inline`: a CPU rank's thread runs each kernel it dispatches, so the host's time per kernel
(Python, autograd, the dispatcher) adds to the kernels' own instead of hiding behind a queue as on a
GPU. Its cost is measured too: a forward and backward of the model on a micro-batch of 8 tokens,
where the kernels' own work is negligible, divided by the kernels the model counts for one micro-batch
(plan.work.block_kernels, the GPU path's count; the product is what the model charges per micro-batch).
Two more steps run under torch.profiler (debug.profile_steps, outside the median) and their split by kind
(GEMMs, attention, communication, the rest, idle) is printed beside the model's.

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
from ..plan.time_report import format_profile_comparison, predicted_parts
from ..profiling import read_summaries
from ..plan.work import setup_from_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/moe_tiny.yaml"
WARMUP = 3  # steps left out of the median (start-up, allocator warm-up)
PROFILED = 2  # steps after the measured ones, under torch.profiler: the step split by kind, measured


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


def host_us_per_kernel(cfg, trials: int = 15) -> float:
    """This rank's host time per launched kernel: the median forward + backward of the model on one
    8-token micro-batch (compute negligible) over the kernels the step model counts for a micro-batch."""
    from ..models.registry import build_model
    from ..plan.work import block_kernels
    model = build_model(cfg.model, seed=cfg.run.seed)
    ids = torch.randint(0, cfg.model.vocab_size, (1, 8))

    def step():
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    s = setup_from_config(cfg, 1, gpus_per_node=1)
    kernels = sum(block_kernels(s, layer, False) for layer in range(cfg.model.num_hidden_layers))
    return _median_seconds(step, trials) / kernels * 1e6


def _median_seconds(fn, trials: int = 15) -> float:
    times = []
    for _ in range(trials + 3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def kernel_efficiency(cfg, s, peak_tflops: float) -> dict:
    """The rates this machine sustains at the config's own shapes, as fractions of the large-matmul peak:
    the routed experts' forward + backward as the kernel back end runs them (grouped), and the causal
    attention core's forward and backward (attn_fwd, attn_bwd), FLOPs counted as the step model counts them."""
    from .. import kernels
    from ..plan.work import _attn_dims, attention_core_flops
    m, peak = cfg.model, peak_tflops * 1e12
    mbs, seq = cfg.train.micro_batch_size, cfg.train.seq_len
    dqk, dv = _attn_dims(m)
    q, k = (torch.randn(mbs, m.num_attention_heads, seq, dqk, requires_grad=True) for _ in range(2))
    v = torch.randn(mbs, m.num_attention_heads, seq, dv, requires_grad=True)
    attn = kernels.backend().causal_attention
    fwd_s = _median_seconds(lambda: attn(q, k, v, dqk ** -0.5))
    out = attn(q, k, v, dqk ** -0.5)
    grad = torch.randn_like(out)
    bwd_s = _median_seconds(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    fwd_flops, bwd_flops = attention_core_flops(m, s)
    # every routed copy of the micro-batch's tokens, spread evenly over all the experts on one rank
    n = m.n_routed_experts
    rows = mbs * seq * m.num_experts_per_tok
    counts = [rows // n] * n
    counts[-1] += rows - sum(counts)
    experts_flops = 3 * 2.0 * rows * 3 * m.hidden_size * m.moe_intermediate_size  # three GEMMs, fwd + two bwd
    return {"grouped": experts_flops / experts_seconds(m, counts) / peak, "attn_fwd": fwd_flops / fwd_s / peak,
            "attn_bwd": bwd_flops / bwd_s / peak}


def experts_seconds(m, counts: list[int]) -> float:
    """The median forward + backward of the experts module (len(counts) experts of the config's shape, as
    the kernel back end runs them) on counts[e] rows for expert e."""
    from ..moe.experts import Experts
    rows = sum(counts)
    experts = Experts(len(counts), m.hidden_size, m.moe_intermediate_size)
    for w in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(w, std=m.initializer_range)
    x = torch.randn(rows, m.hidden_size, requires_grad=True)
    gate = torch.rand(rows, requires_grad=True)
    c = torch.tensor(counts, dtype=torch.int64)
    return _median_seconds(lambda: experts(x, c, gate).sum().backward())


# the 2-rank run of 2026-12-06 02:48 UTC (docs/PLANS.md, "The CPU as a calibration point"): one thread per
# rank; the efficiencies were measured at 1 rank (the table's figures), the copy bandwidth too
RATES_2026_12_06 = {"matmul_tflops": 0.110, "copy_gbs": 32.0, "host_us_per_kernel": 33.6,
                    "efficiency": {"grouped": 0.32, "attn_fwd": 0.13, "attn_bwd": 0.25}}


def cpu_from_rates(rates: dict, ranks: int) -> tuple[Gpu, Efficiency]:
    """The step model's "GPU" and efficiencies of this machine from its measured `rates` (cpu_model's)."""
    bw = rates["copy_gbs"] * 1e9
    cpu = Gpu("this CPU", rates["matmul_tflops"], 0.0, bw / 1e12, bw / 1e9, bw / 1e9, ranks,
              "measured: metrics.measure_matmul_tflops and a tensor copy")
    eff = Efficiency(gemm=1.0, memory=1.0, nvlink=1.0, net=1.0, a2a=1.0, host_eager_us=rates["host_us_per_kernel"],
                     launch_us=0.0, graph_us=0.0, sync_us=0.0, **rates["efficiency"])
    return cpu, eff


def cpu_model(cfg, ranks: int, threads: int) -> tuple[Gpu, Efficiency, dict]:
    """This machine as the step model's "GPU" for `cfg` on `ranks` CPU ranks of `threads` threads each:
    the measured rates stand in for the datasheet's peaks and efficiencies (the links: shared memory at
    the copy bandwidth), and the measured figures themselves."""
    torch.set_num_threads(threads)
    tflops = measure_matmul_tflops(torch.float32, torch.device("cpu"))
    # a CPU rank runs each op in the thread that dispatches it (host "inline"); its reads of the
    # tokens-per-expert counts are part of the measured host time
    rates = {"matmul_tflops": tflops, "copy_gbs": copy_bandwidth() / 1e9, "host_us_per_kernel": host_us_per_kernel(cfg),
             "efficiency": kernel_efficiency(cfg, setup_from_config(cfg, ranks, gpus_per_node=ranks), tflops)}
    return (*cpu_from_rates(rates, ranks), rates)


def predict(ranks: int, threads: int) -> dict:
    """The model's step for moe_tiny on `ranks` CPU ranks of `threads` threads each."""
    cfg = load_config(str(ROOT / CONFIG), ["train.dtype=fp32"])
    cpu, eff, rates = cpu_model(cfg, ranks, threads)
    s = setup_from_config(cfg, ranks, gpus_per_node=ranks)
    r = step_time(s, cpu, eff, Mechanisms(host="inline"), 1.0)
    return {**rates, "step_s": r.step, "parts": predicted_parts(r),
            "compute_s": r.compute, "exposed_comm_s": r.exposed_comm, "optimizer_s": r.optimizer,
            "host_s": r.host_wait}


def measure(ranks: int, steps: int) -> dict:
    """The trainer's median step over `steps` steps after a warm-up, through the DeepSpeed launcher; then
    PROFILED more steps under torch.profiler on every rank (debug.profile_steps), left out of the median, whose
    summaries (profiling.summarize) split the step by kind."""
    with tempfile.TemporaryDirectory() as tmp:
        window = [steps + 1, steps + PROFILED]
        sets = [f"train.max_steps={steps + PROFILED}", f"run.out_dir={tmp}/run", "train.log_every=1",
                "train.eval_every=0", "train.checkpoint_every=0", "train.dtype=fp32",
                f"debug.profile_steps=[{window[0]},{window[1]}]", f"debug.profile_ranks={list(range(ranks))}"]
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
               str(29700 + ranks), "--module", "moe_trainer.train", "--config", str(ROOT / CONFIG)]
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        if done.returncode:
            raise RuntimeError(f"the trainer failed ({done.returncode}): {done.stderr[-2000:]}")
        rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
        profiles = read_summaries(Path(tmp, "run"))
    rows = [r for r in rows if WARMUP < r.get("step", 0) <= steps and "event" not in r]
    times = [r["step_time_last_s"] for r in rows if "step_time_last_s" in r]
    split = {k: statistics.median(r[k] for r in rows if k in r)
             for k in ("time.compute_s", "time.optimizer_s", "time.exposed_all_to_all_s") if any(k in r for r in rows)}
    return {"step_s": statistics.median(times), "steps": len(times), **split, "profile": profiles}


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
              f"{pred['optimizer_s'] * 1e3:.1f}, host {pred['host_s'] * 1e3:.1f} at "
              f"{pred['host_us_per_kernel']:.1f} us per kernel; efficiency "
              f"{', '.join(f'{k} {v:.2f}' for k, v in pred['efficiency'].items())}; matmul {pred['matmul_tflops']:.3f} TFLOP/s, copy "
              f"{pred['copy_gbs']:.1f} GB/s), measured median {meas['step_s'] * 1e3:.1f} ms over {meas['steps']} "
              f"steps: predicted / measured {ratio:.2f}", flush=True)
        print(format_profile_comparison(pred["parts"], meas["profile"], f"moe_tiny at {n} rank(s)"), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": "python -m moe_trainer.bench.plan_time " + " ".join(
            argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "cores": cores, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

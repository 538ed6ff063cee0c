"""End-to-end training speed: our trainer vs transformers' DeepseekV3ForCausalLM under
the same DeepSpeed ZeRO-1 engine (what a user would otherwise do), fp32 and bf16,
plus our trainer on 2 ranks (dp 2, ep 2).

Model: configs/moe_bench.yaml (hidden 512, MLA, 64 routed experts top-6 of
hidden 256, 2 shared, sequence 512, no MTP). Each run is its own subprocess:

- ours: the real trainer under the DeepSpeed launcher (`moe_trainer.train`), one
  rank with all the cores, or 2 ranks with one core each; its metrics.jsonl
  step_time_s (data + forward + backward + optimizer, per step) is read back;
- transformers: our model's initial weights converted with `hf.to_hf`, loaded by
  `DeepseekV3ForCausalLM.from_pretrained(experts_implementation=...)`, wrapped by
  `deepspeed.initialize` with the DeepSpeed config our trainer generates, and
  trained on the same batches by a plain loop (forward, CE loss, backward, step).

Every run repeats --rounds times (default 2), interleaved, and the timed steps of
its rounds are pooled: this shared VM drifts 5-10% between minutes, and a single
pass let a slow minute land on one run only (the peer's figure moved 10% between
two single-pass runs). The parent measures the matmul roofline
(metrics.measure_matmul_tflops, all cores) once per round, keeps the best, and
writes a markdown table. Model FLOPs: metrics.train_flops_per_token.

    scripts/bench_train.sh                          # writes docs/BENCHMARKS_train.md
    scripts/bench_train.sh --steps 6 --dtypes bf16 --runs ours1,hf --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/moe_bench.yaml"
RUNS = ["ours1", "hf", "hfk", "ours2"]
LABELS = {"ours1": "ours, 1 rank (trainer, ZeRO-1)",
          "hf": "transformers DeepseekV3ForCausalLM + DeepSpeed ZeRO-1, 1 rank",
          "hfk": "the same transformers + DeepSpeed run with our allocator setting (keep_freed_memory)",
          "ours2": "ours, 2 ranks (dp 2, ep 2, dedup dispatch), aggregate"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(threads: int) -> dict:
    e = dict(os.environ)
    e.setdefault("DS_ACCELERATOR", "cpu")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = str(threads)
    return e


def _cfg(dtype: str, steps: int, extra=()):
    from moe_trainer.config import load_config
    return load_config(str(ROOT / CONFIG), [f"train.dtype={dtype}", f"train.max_steps={steps}", *extra])


# ----------------------------------------------------------------------------- ours (real trainer)

def run_ours(ranks: int, dtype: str, args, tmp: Path) -> dict:
    out = tmp / f"ours{ranks}_{dtype}"
    sets = [f"train.dtype={dtype}", f"train.max_steps={args.steps}", f"run.out_dir={out}",
            "metrics.peak_tflops=1.0", "train.checkpoint_every=0"]  # peak: the bench's own roofline is used
    if ranks > 1:
        # same global batch (dp 2 halves each rank's accumulation); a token's hidden state crosses to
        # the other rank once however many of its 6 experts live there (DeepSeek-V3's dedup)
        sets += [f"parallel.ep={ranks}", "parallel.dedup_dispatch=true"]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
           str(_free_port()), "--module", "moe_trainer.train", f"--config={CONFIG}"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(max(1, args.threads // ranks)), capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    timed = [r for r in recs if "step_time_s" in r and r["step"] > args.warmup]
    cfg = _cfg(dtype, args.steps)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    shutil.rmtree(out, ignore_errors=True)
    split = {k: statistics.median(r[f"time.{k}_s"] for r in timed) for k in ("forward", "backward", "optimizer")}
    return {"times": [r["step_time_s"] for r in timed], "tokens_per_step": tokens, "split": split}


# ----------------------------------------------------------------------------- transformers + DeepSpeed

def worker_hf(dtype: str, args, keep_freed: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import deepspeed
    from transformers import DeepseekV3ForCausalLM
    from moe_trainer.config import validate_layout
    from moe_trainer.data import open_data
    from moe_trainer.hf import to_hf
    from moe_trainer.models.registry import build_model
    from moe_trainer.parallel.launch import keep_freed_memory
    from moe_trainer.parallel.zero import deepspeed_config, param_groups
    if keep_freed:
        keep_freed_memory()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = _cfg(dtype, args.steps)
    layout = validate_layout(cfg, 1)
    t = cfg.train
    with tempfile.TemporaryDirectory() as d:
        to_hf(build_model(cfg.model, cfg.run.seed), Path(d) / "hf")
        model = DeepseekV3ForCausalLM.from_pretrained(
            Path(d) / "hf", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
            experts_implementation=args.hf_experts, attn_implementation="sdpa")
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, t.weight_decay),
                                           config=deepspeed_config(cfg, layout))
    _, train_data, _ = open_data(cfg.data.path, t.seq_len, cfg.run.seed, cfg.model.vocab_size, cfg.data.val_fraction)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        for micro in range(layout.grad_accum):
            batch = train_data.micro_batch(step, micro, t.global_batch_size, t.micro_batch_size, 0, 1)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            logits = engine(input_ids=inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"times": times[args.warmup:], "tokens_per_step": t.global_batch_size * t.seq_len,
            "loss": float(loss)}


def run_hf(dtype: str, args, keep_freed: bool = False) -> dict:
    cmd = [sys.executable, "-m", "moe_trainer.bench_train", "--_worker", f"{'hfk' if keep_freed else 'hf'}:{dtype}",
           "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--hf-experts", args.hf_experts]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(args.threads), capture_output=True, text=True)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (p.stderr or p.stdout)[-1500:]}


# ----------------------------------------------------------------------------- driver

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list from {RUNS}")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    ap.add_argument("--rounds", type=int, default=2,
                    help="run every configuration this many times, interleaved, and pool the timed steps: on a "
                         "shared machine a slow minute then lands on every run, not on one")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores of the machine")
    ap.add_argument("--hf-experts", default="grouped_mm", help="transformers experts_implementation")
    ap.add_argument("--out", default="docs/BENCHMARKS_train.md")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        kind, dt = args._worker.split(":")
        print("RESULT " + json.dumps(worker_hf(dt, args, keep_freed=kind == "hfk")), flush=True)
        return
    import torch
    from moe_trainer.metrics import measure_matmul_tflops, train_flops_per_token
    torch.set_num_threads(args.threads)
    t_start = time.time()
    dtypes, runs = args.dtypes.split(","), args.runs.split(",")
    fpt = train_flops_per_token(_cfg("fp32", args.steps).model, _cfg("fp32", args.steps).train.seq_len)
    roof, per_round = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for rnd in range(args.rounds):  # runs interleaved, so a slow spell of the machine hits all of them
            for dt in dtypes:  # the roofline: the best of the rounds' measurements
                m = measure_matmul_tflops(torch.bfloat16 if dt == "bf16" else torch.float32, torch.device("cpu"),
                                          seconds=2.0)
                roof[dt] = max(roof.get(dt, 0.0), m)
            print(f"round {rnd + 1} roofline TFLOP/s (all cores): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in roof.items()), flush=True)
            for dt in dtypes:
                for run in runs:
                    r = (run_hf(dt, args, keep_freed=run == "hfk") if run.startswith("hf")
                         else run_ours(int(run[-1]), dt, args, Path(tmp)))
                    per_round.setdefault((run, dt), []).append(r)
                    if r.get("times"):
                        print(f"round {rnd + 1} {run:6s} {dt}: step {statistics.median(r['times']):.3f} s", flush=True)
    results = {}
    for (run, dt), rs in per_round.items():
        bad = [r for r in rs if "error" in r or not r.get("times")]
        if bad:
            results[(run, dt)] = r = bad[0]
            print(f"{run} {dt}: ERROR {r.get('error', 'no timed steps')}", flush=True)
            continue
        r = dict(rs[0], times=[t for x in rs for t in x["times"]])
        if all("split" in x for x in rs):
            r["split"] = {k: statistics.median(x["split"][k] for x in rs) for k in rs[0]["split"]}
        r["median_s"], r["min_s"] = statistics.median(r["times"]), min(r["times"])
        r["tok_s"] = r["tokens_per_step"] / r["median_s"]
        r["best_tok_s"] = r["tokens_per_step"] / r["min_s"]
        r["mfu"] = r["tok_s"] * fpt / 1e12 / roof[dt]
        results[(run, dt)] = r
        print(f"{run:6s} {dt}: step {r['median_s']:.3f} s (min {r['min_s']:.3f})  {r['tok_s']:8.0f} tok/s "
              f"(best {r['best_tok_s']:.0f})  MFU {100 * r['mfu']:.1f}%", flush=True)
    write_md(args, sys.argv[1:] if argv is None else argv, roof, fpt, results, time.time() - t_start)
    print(f"wrote {args.out}")


def write_md(args, raw, roof, fpt, results, elapsed):
    import platform
    import torch
    import transformers
    import deepspeed
    cmd = "scripts/bench_train.sh" + ("" if not raw else " " + " ".join(raw))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    L = ["# End-to-end training benchmark (one optimizer step = forward + backward + ZeRO-1 step)", "",
         f"Command: `{cmd}` (repo root; `DS_ACCELERATOR=cpu` without a GPU). Wall time {elapsed:.0f} s; "
         f"1-min load average at the end {load:.1f} on {os.cpu_count()} CPUs.", "",
         f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
         f"DeepSpeed {deepspeed.__version__}, transformers {transformers.__version__}, CPU only.", "",
         f"Model: `{CONFIG}` (hidden 512, MLA heads 8, q_lora 256, kv_lora 128; 1 dense + 3 MoE layers, 64 routed "
         "experts top-6 of hidden 256 + 2 shared; sequence 512; global batch 16 sequences = 8192 tokens per "
         "optimizer step, micro-batch 4: 4 accumulated micro-batches on 1 rank, 2 per rank on 2 ranks). "
         f"Model FLOPs {fpt / 1e6:.1f} MFLOP per trained token (metrics.train_flops_per_token: "
         f"activated experts only, causal attention, 3x forward).", "",
         "Roofline: best plain torch.matmul TFLOP/s on the model's projection shapes, all cores "
         f"(metrics.measure_matmul_tflops; the best of {args.rounds} measurements, one per round): "
         + ", ".join(f"{k} {v:.3f}" for k, v in roof.items()) + ".", "",
         f"transformers: experts_implementation={args.hf_experts}, attn_implementation=sdpa, weights from our "
         f"initial model via `hf.to_hf`, same DeepSpeed config (`parallel.zero.deepspeed_config`) and batches. "
         f"Timed: every run {args.rounds} time(s), interleaved (round 1: every run of every dtype, then "
         f"round 2, ...); median step over the {args.steps - args.warmup} steps after {args.warmup} warm-up "
         f"steps of every round, pooled (min in brackets). MFU = tokens/s x FLOP/token / roofline (2 ranks: "
         f"aggregate against the same all-core roofline).", "",
         "Split (ours): median seconds per optimizer step in forward / backward / optimizer, from the "
         "trainer's metrics.jsonl `time.*_s`.", "",
         "| run | dtype | step s median (min) | tokens/s (best) | MFU | ours / this | split fwd / bwd / opt s |",
         "|---|---|---:|---:|---:|---:|---|"]
    for dt in args.dtypes.split(","):
        ours = results.get(("ours1", dt), {})
        for run in args.runs.split(","):
            r = results.get((run, dt), {})
            if "tok_s" not in r:
                err = str(r.get("error", "no result")).strip().splitlines()
                L.append(f"| {LABELS[run]} | {dt} | error: {(err[-1] if err else '')[:150]} | | | | |")
                continue
            ratio = f"{ours['tok_s'] / r['tok_s']:.2f}x" if "tok_s" in ours else "n/a"
            split = " / ".join(f"{r['split'][k]:.3f}" for k in ("forward", "backward", "optimizer")) \
                if "split" in r else ""
            L.append(f"| {LABELS[run]} | {dt} | {r['median_s']:.3f} ({r['min_s']:.3f}) | {r['tok_s']:.0f} "
                     f"({r['best_tok_s']:.0f}) | {100 * r['mfu']:.1f}% | {ratio} | {split} |")
    L += ["", "## Targets", ""]
    for dt in args.dtypes.split(","):
        o, hf, o2 = (results.get((k, dt), {}) for k in ("ours1", "hf", "ours2"))
        if "tok_s" not in o:
            continue
        line = f"- {dt}: MFU {100 * o['mfu']:.1f}%"
        if dt == "bf16":
            line += f" (target 45%: {'met' if o['mfu'] >= 0.45 else 'MISSED'})"
        if "tok_s" in hf:
            sp = o["tok_s"] / hf["tok_s"]
            line += f"; ours / transformers+DeepSpeed = {sp:.2f}x (target 1.5x: {'met' if sp >= 1.5 else 'MISSED'})"
        if "tok_s" in o2:
            sc = o2["tok_s"] / o["tok_s"]
            line += f"; 2 ranks / 1 rank (all cores) = {sc:.2f}x (target 0.8x: {'met' if sc >= 0.8 else 'MISSED'})"
        L.append(line + ".")
    L += ["", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    main()

"""End-to-end training speed: our trainer vs transformers' DeepseekV3ForCausalLM under
the same DeepSpeed ZeRO-1 engine (what a user would otherwise do), fp32 and bf16,
plus our trainer on 2 ranks (dp 2, ep 2).

Model: configs/moe_bench.yaml (hidden 512, MLA, 64 routed experts top-6 of
hidden 256, 2 shared, sequence 512, no MTP). Each run is its own job:

- ours: the real trainer (`moe_trainer.train.make_trainer`, its own training loop)
  under the DeepSpeed launcher, one rank with all the cores, or 2 ranks with one
  core each; each step's step_time (data + forward + backward + optimizer) and
  its split are reported;
- transformers: our model's initial weights converted with `hf.to_hf`, loaded by
  `DeepseekV3ForCausalLM.from_pretrained(experts_implementation=...)`, wrapped by
  `deepspeed.initialize` with the DeepSpeed config our trainer generates, and
  trained on the same batches by a plain loop (forward, CE loss, backward, step).

The jobs of one dtype start together and take turns one optimizer step at a time
(bench/turns.py): while one job steps, the others sleep. This shared VM's speed
moves 15-20% between minutes, and whole runs one after the other let a slow minute
land on one of them; turn by turn, it costs every job about the same steps. The
parent measures the matmul roofline (metrics.measure_matmul_tflops, all cores)
before and after each dtype's steps, with every job asleep, and keeps the best.
Model FLOPs: metrics.train_flops_per_token.

    scripts/bench_train.sh                          # writes docs/BENCHMARKS_train.md
    scripts/bench_train.sh --steps 6 --dtypes bf16 --runs ours1,hf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moe_trainer.bench.turns import free_port, worker_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/moe_bench.yaml"
RUNS = ["ours1", "hf", "hfk", "ours2"]
LABELS = {"ours1": "ours, 1 rank (trainer, ZeRO-1)",
          "hf": "transformers DeepseekV3ForCausalLM + DeepSpeed ZeRO-1, 1 rank",
          "hfk": "the same transformers + DeepSpeed run with our allocator setting (keep_freed_memory)",
          "ours2": "ours, 2 ranks (dp 2, ep 2, dedup dispatch), aggregate"}


def _cfg(dtype: str, steps: int, extra=()):
    from moe_trainer.resolve import load_config
    return load_config(str(ROOT / CONFIG), [f"train.dtype={dtype}", f"train.max_steps={steps}", *extra])


# ----------------------------------------------------------------------------- ours (real trainer)

def ours_sets(ranks: int, dtype: str, steps: int, out: Path) -> list[str]:
    sets = [f"train.dtype={dtype}", f"train.max_steps={steps}", f"run.out_dir={out}",
            "metrics.peak_tflops=1.0", "train.checkpoint_every=0"]  # peak: the bench's own roofline is used
    if ranks > 1:
        # same global batch (dp 2 halves each rank's accumulation); a token's hidden state crosses to
        # the other rank once however many of its 6 experts live there (DeepSeek-V3's dedup)
        sets += [f"parallel.ep={ranks}", "parallel.dedup_dispatch=true"]
    return sets


def worker_ours(ranks: int, dtype: str, args) -> None:
    """One rank of our trainer under the launcher, each step in its turn."""
    from moe_trainer.bench.turns import Turns, train_in_turns
    from moe_trainer.config import validate_layout
    from moe_trainer.parallel.launch import shutdown_distributed
    from moe_trainer.train import make_trainer
    cfg = _cfg(dtype, args.steps, [*args.set, *ours_sets(ranks, dtype, args.steps, Path(args.out_dir))])
    trainer = make_trainer(cfg, validate_layout(cfg, ranks))
    turns = Turns(args.turns)
    train_in_turns(trainer, turns, lambda r: {"step_s": r["step_time"], "forward": r["times"].forward,
                                               "backward": r["times"].backward,
                                               "optimizer": r["times"].optimizer})
    turns.close({"tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len})
    shutdown_distributed()


def ours_cmd(ranks: int, dtype: str, args, tmp: Path, turns: str) -> list[str]:
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
            str(free_port()), "--module", "moe_trainer.bench.train", "--_worker", f"ours{ranks}:{dtype}",
            "--steps", str(args.steps), "--out-dir", str(tmp / f"ours{ranks}_{dtype}"), "--turns", turns,
            *_set_args(args)]


def _set_args(args) -> list[str]:
    """The driver's --set overrides, passed on to every worker (the smoke runs shrink the model)."""
    return [a for kv in args.set for a in ("--set", kv)]


# ----------------------------------------------------------------------------- transformers + DeepSpeed

def worker_hf(dtype: str, args, keep_freed: bool = False) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import deepspeed
    from transformers import DeepseekV3ForCausalLM
    from moe_trainer.bench.turns import Turns
    from moe_trainer.config import validate_layout
    from moe_trainer.data import open_data
    from moe_trainer.hf import to_hf
    from moe_trainer.models.registry import build_model
    from moe_trainer.kernels.cpu.allocator import keep_freed_memory
    from moe_trainer.parallel.zero import deepspeed_config, param_groups
    if keep_freed:
        keep_freed_memory()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = _cfg(dtype, args.steps, args.set)
    layout = validate_layout(cfg, 1)
    t = cfg.train
    with tempfile.TemporaryDirectory() as d:
        to_hf(build_model(cfg.model, cfg.run.seed), Path(d) / "hf")
        model = DeepseekV3ForCausalLM.from_pretrained(
            Path(d) / "hf", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
            experts_implementation=args.hf_experts, attn_implementation=args.hf_attn)
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, t.weight_decay),
                                           config=deepspeed_config(cfg, layout))
    _, train_data, _ = open_data(cfg.data.path, t.seq_len, cfg.run.seed, cfg.model.vocab_size, cfg.data.val_fraction)
    turns = Turns(args.turns)
    for step in range(args.steps):
        turns.wait()
        t0 = time.perf_counter()
        for micro in range(layout.grad_accum):
            batch = train_data.micro_batch(step, micro, t.global_batch_size, t.micro_batch_size, 0, 1)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            logits = engine(input_ids=inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
            engine.backward(loss)
            engine.step()
        turns.report({"step_s": time.perf_counter() - t0})
    turns.close({"tokens_per_step": t.global_batch_size * t.seq_len, "loss": float(loss)})
    dist.destroy_process_group()


def hf_cmd(run: str, dtype: str, args, turns: str) -> list[str]:
    return [sys.executable, "-m", "moe_trainer.bench.train", "--_worker", f"{run}:{dtype}", "--steps", str(args.steps),
            "--hf-experts", args.hf_experts, "--hf-attn", args.hf_attn, "--turns", turns, *_set_args(args)]


# ----------------------------------------------------------------------------- driver

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list from {RUNS}")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores of the machine")
    ap.add_argument("--hf-experts", default="grouped_mm", help="transformers experts_implementation (with "
                    "--mode alone: a comma list, the fastest measured in the run is the peer)")
    ap.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation in turns mode (alone: "
                    "the faster of eager and sdpa, measured in the run)")
    ap.add_argument("--mode", choices=("turns", "alone"), default="turns",
                    help="turns: the jobs take turns step by step (secondary view); alone: the headline, each job "
                         "alone, --rounds rounds alternating the order (bench/headline.py)")
    ap.add_argument("--rounds", type=int, default=3, help="--mode alone: rounds per job")
    ap.add_argument("--probe-steps", type=int, default=0, help="--mode alone: steps of each peer candidate "
                    "when picking the fastest (0: --steps)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every job (e.g. a smaller model for a smoke run)")
    ap.add_argument("--out", default="docs/BENCHMARKS_train.md")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--turns", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        kind, dt = args._worker.split(":")
        if kind.startswith("ours"):
            worker_ours(int(kind[-1]), dt, args)
        else:
            worker_hf(dt, args, keep_freed=kind == "hfk")
        return
    if args.mode == "alone":
        out = args.out if args.out.endswith(".json") else "docs/bench/train_headline.json"
        write_json(headline(args), out)
        print(f"wrote {out}")
        return
    import torch
    from moe_trainer.metrics import train_flops_per_token
    torch.set_num_threads(args.threads)
    t_start = time.time()
    dtypes, runs = args.dtypes.split(","), args.runs.split(",")
    cfg = _cfg("fp32", args.steps, args.set)
    fpt = train_flops_per_token(cfg.model, cfg.train.seq_len)
    roof, results = {}, {}
    # ours1 steps in turns with one other run at a time: each ratio is measured side by side, and no
    # more than two runs' memory is resident (four fp32 runs filled 19 of the 24 GB, and the peer's
    # page faults under glibc's allocator then slowed it by another 20%)
    phases = [["ours1", run] for run in runs if run != "ours1"] if "ours1" in runs else [runs]
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for dt in dtypes:
            ours_steps = []
            for phase in phases or [["ours1"]]:
                per_run = run_in_turns(dt, phase, args, Path(tmp))
                roof[dt] = max(roof.get(dt, 0.0), per_run.pop("roofline"))
                ours = per_run.get("ours1", {})
                for run, r in per_run.items():
                    if run != "ours1":
                        if "tok_s" in r and "tok_s" in ours:
                            r["ratio"] = ours["tok_s"] / r["tok_s"]  # ours1 / this run, in this phase
                        results[(run, dt)] = r
                if "steps" in ours:
                    ours_steps += ours["steps"]
                elif "ours1" in phase:
                    results[("ours1", dt)] = ours
            if ours_steps:  # ours1 pooled over its phases
                results[("ours1", dt)] = summary({"tokens_per_step": ours["tokens_per_step"]}, ours_steps)
    for (run, dt), r in results.items():
        if "error" in r:
            print(f"{run} {dt}: ERROR {r['error']}", flush=True)
            continue
        r["mfu"] = r["tok_s"] * fpt / 1e12 / roof[dt]
        print(f"{run:6s} {dt}: step {r['median_s']:.3f} s (min {r['min_s']:.3f})  {r['tok_s']:8.0f} tok/s "
              f"(best {r['best_tok_s']:.0f})  MFU {100 * r['mfu']:.1f}%", flush=True)
    write_md(args, sys.argv[1:] if argv is None else argv, roof, fpt, results, time.time() - t_start)
    print(f"wrote {args.out}")


def run_in_turns(dt: str, runs: list[str], args, tmp: Path) -> dict:
    """Every run of one dtype as a job, stepping in turns; {run: summary or {"error"}, "roofline": best}."""
    import torch
    from moe_trainer.bench.turns import Referee
    from moe_trainer.metrics import measure_matmul_tflops
    referee = Referee()
    try:
        for run in runs:
            if run.startswith("ours"):
                ranks = int(run[-1])
                referee.start(run, ours_cmd(ranks, dt, args, tmp, referee.address(run)),
                              worker_env(max(1, args.threads // ranks), ROOT), cwd=ROOT)
            else:
                referee.start(run, hf_cmd(run, dt, args, referee.address(run)), worker_env(args.threads, ROOT), cwd=ROOT)
        referee.wait_ready()
        def roof():
            return measure_matmul_tflops(torch.bfloat16 if dt == "bf16" else torch.float32, torch.device("cpu"),
                                         seconds=2.0)
        best = roof()  # every job asleep

        def show(i: int, steps: dict) -> None:
            shown = ", ".join(f"{run} {steps[run][-1]['step_s']:.3f}" for run in referee.running())
            print(f"{dt} step {i + 1}: {shown}", flush=True)

        steps = referee.take_turns(args.steps, show)
        best = max(best, roof())
        out = {"roofline": best}
        for run, result in referee.finish_all().items():
            out[run] = summary(result, steps[run][args.warmup:])
        for run, err in referee.failures().items():
            out[run] = {"error": err}
        return out
    finally:
        referee.close()


def headline(args) -> dict:
    """The headline figures (bench/headline.py): ours on 1 rank against the transformers peer at its
    best, each alone, --rounds rounds alternating the order. The peer's attention (eager or sdpa)
    and experts implementation are the fastest measured first in this run, with our allocator
    setting; the headline ratio gives the peer that setting too (as ours has), the stock ratio
    glibc's default. {dtype: {"jobs", "probe", "peer", "same_allocator", "stock"}}."""
    from moe_trainer.bench.headline import pick_fastest, ratio, run_alone
    from moe_trainer.bench.turns import worker_env
    out = {"command": "scripts/bench_train.sh " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for dt in args.dtypes.split(","):
            def ours(turns: str, dt=dt) -> tuple[list[str], dict]:
                return ours_cmd(1, dt, args, Path(tmp), turns), worker_env(args.threads, ROOT)

            def peer(run: str, attn: str, experts: str, dt=dt):
                variant = argparse.Namespace(**{**vars(args), "hf_attn": attn, "hf_experts": experts})
                return lambda turns: (hf_cmd(run, dt, variant, turns), worker_env(args.threads, ROOT))

            candidates = {f"{attn}+{experts}": peer("hfk", attn, experts)
                          for attn in ("eager", "sdpa") for experts in args.hf_experts.split(",")}
            best, probed = pick_fastest(candidates, args.probe_steps or args.steps, args.warmup, cwd=ROOT)
            attn, experts = best.split("+")
            jobs = run_alone({"ours1": ours, "hfk": peer("hfk", attn, experts), "hf": peer("hf", attn, experts)},
                             args.steps, args.warmup, args.rounds, cwd=ROOT)
            timed = all("median_s" in jobs[n] for n in ("ours1", "hfk", "hf"))
            out[dt] = {"jobs": jobs, "probe": probed, "peer": best,
                       "same_allocator": ratio(jobs["ours1"], jobs["hfk"]) if timed else None,
                       "stock": ratio(jobs["ours1"], jobs["hf"]) if timed else None}
    return out


def write_json(result: dict, path: str) -> None:
    import json
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def summary(result: dict, steps: list[dict]) -> dict:
    times = [s["step_s"] for s in steps]
    r = dict(result, steps=steps, median_s=statistics.median(times), min_s=min(times))
    r["tok_s"], r["best_tok_s"] = r["tokens_per_step"] / r["median_s"], r["tokens_per_step"] / r["min_s"]
    if "forward" in steps[0]:
        r["split"] = {k: statistics.median(s[k] for s in steps) for k in ("forward", "backward", "optimizer")}
    return r


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
         "Roofline: best plain matmul TFLOP/s on the model's projection shapes, all cores, fp32 the faster of torch.matmul (MKL sgemm) and oneDNN's matmul, which our fp32 projections use "
         "(metrics.measure_matmul_tflops; the best of 2 measurements, before and after each dtype's steps): "
         + ", ".join(f"{k} {v:.3f}" for k, v in roof.items()) + ".", "",
         f"transformers: experts_implementation={args.hf_experts}, attn_implementation=sdpa, weights from our "
         f"initial model via `hf.to_hf`, same DeepSpeed config (`parallel.zero.deepspeed_config`) and batches. "
         f"Timed: ours (1 rank) and one other run at a time start together and take turns one optimizer "
         f"step at a time (bench/turns.py: while one runs a step, the other sleeps), and each ratio is "
         f"the two medians of that pairing; ours' row pools its steps of every pairing. Median step over the "
         f"{args.steps - args.warmup} steps after {args.warmup} warm-up steps (min in brackets). MFU = "
         f"tokens/s x FLOP/token / roofline (2 ranks: aggregate against the same all-core roofline).", "",
         "Split (ours): median seconds per optimizer step in forward / backward / optimizer, as the "
         "trainer times them (metrics.jsonl's `time.*_s`).", "",
         "| run | dtype | step s median (min) | tokens/s (best) | MFU | ours / this | split fwd / bwd / opt s |",
         "|---|---|---:|---:|---:|---:|---|"]
    for dt in args.dtypes.split(","):
        for run in args.runs.split(","):
            r = results.get((run, dt), {})
            if "tok_s" not in r:
                err = str(r.get("error", "no result")).strip().splitlines()
                L.append(f"| {LABELS[run]} | {dt} | error: {(err[-1] if err else '')[:150]} | | | | |")
                continue
            ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ("1.00x" if run == "ours1" else "n/a")
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
        if "ratio" in hf:  # measured in the phase where ours1 and the peer took turns
            sp = hf["ratio"]
            line += f"; ours / transformers+DeepSpeed = {sp:.2f}x (target 1.5x: {'met' if sp >= 1.5 else 'MISSED'})"
        if "ratio" in o2:
            sc = 1.0 / o2["ratio"]
            line += f"; 2 ranks / 1 rank (all cores) = {sc:.2f}x (target 0.8x: {'met' if sc >= 0.8 else 'MISSED'})"
        L.append(line + ".")
    L += ["", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    main()

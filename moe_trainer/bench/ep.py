"""Expert-parallel throughput: our trainer at world 1/2/4 (fp32, bf16) and DeepSpeed AutoEP as the peer.

    python -m moe_trainer.bench.ep [--steps 40] [--warmup 8] [--worlds 1,2,4] [--out FILE.json]

Each configuration runs under the deepspeed launcher (`--module moe_trainer.bench.ep --worker ...`).
The configurations of one world size and dtype (ours with dedup off and on, the peer with glibc's
allocator and with ours) start together and take turns one optimizer step at a time
(bench/turns.py: while one steps on all its ranks, the others sleep), so a slow spell of the
shared machine costs each of them about the same steps; every column is a median over the timed
steps.
Our worker builds the Trainer exactly as moe_trainer.train does and times `train_step()`:
  compute    = forward + backward - time inside the dispatch/combine all-to-alls (incl. the count exchange)
  all-to-all = CommCounter.seconds of dispatch*/combine* kinds (blocking: includes waiting for peers)
  rest       = step - forward - backward (the optimizer step: gradient norm, AdamW, ZeRO-1's parameter
               all-gather; data; the loss / expert-count all-reduces and the bias update). DeepSpeed
               reduces the gradients at the end of engine.backward, so that is in compute.
Bytes per token: rank 0's forward dispatch + combine bytes sent per local token, against
plan.alltoall_bytes_expected x MoE layers (uniform-routing expectation).
The peer: transformers' DeepseekV3ForCausalLM loaded from our weights (moe_trainer.hf.to_hf) with
DeepSpeed AutoEP (ZeRO-1, torch AdamW from the DS config), the same batches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/moe_tiny.yaml"  # hidden 256, 16 routed experts top-4 (4 groups, top-2 groups), 3 MoE layers
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 256


def overrides(world: int, dtype: str, steps: int, out_dir: str, dedup: bool) -> list[str]:
    return [f"train.seq_len={SEQ}", f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={GLOBAL_BATCH}",
            f"train.max_steps={steps}", "train.eval_every=0", "train.checkpoint_every=0", "train.resume=none",
            "train.log_every=1000", f"train.dtype={dtype}", f"parallel.ep={world}",
            f"parallel.dedup_dispatch={str(dedup).lower()}", f"run.out_dir={out_dir}", "metrics.peak_tflops=1.0"]


# ------------------------------------------------------------------ workers (one per rank, under the launcher)

def _init(world: int):
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from moe_trainer.parallel.launch import init_distributed
    init_distributed(300)  # and unlink DeepSpeed's /dev/shm segment


def medians(steps: list[dict]) -> dict:
    """tokens/s from the median step; compute, all-to-all and rest each their own median (so they
    need not add up exactly). Also tokens/s of each half of the timed steps, and (ours) the mean over
    each half of the most loaded EP rank's rows over the mean: with balancing on, ours should speed up
    as its load evens out; AutoEP never moves its bias."""
    med = {k: statistics.median(t[k] for t in steps) for k in ("step", "compute", "all_to_all", "rest")}
    halves = [steps[:len(steps) // 2], steps[len(steps) // 2:]] if len(steps) > 1 else [steps, steps]
    out = {"steps": len(steps), "tokens_per_s": GLOBAL_BATCH * SEQ / med["step"],
           **{f"{k}_s": v for k, v in med.items()}}
    for name, half in zip(("1st", "2nd"), halves):
        out[f"tokens_per_s_{name}"] = GLOBAL_BATCH * SEQ / statistics.median(t["step"] for t in half)
        loads = [t["rank_load"] for t in half if "rank_load" in t]
        out[f"rank_load_{name}"] = statistics.mean(loads) if loads else float("nan")
    return out


def worker_ours(a) -> None:
    import torch
    import torch.distributed as dist

    from .. import plan
    from .turns import Turns
    from ..config import validate_layout
    from ..resolve import load_config
    from ..expert_load import imbalance_stats
    from ..kernels.cpu.allocator import keep_freed_memory
    from ..parallel.mesh import build_mesh
    from ..trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(CONFIG, overrides(world, a.dtype, a.steps, a.run_dir, a.dedup))
    layout = validate_layout(cfg, world)
    _init(world)
    if cfg.train.keep_freed_memory:  # as moe_trainer.train does on CPU ranks
        keep_freed_memory()
    rank = int(os.environ.get("RANK", "0"))
    trainer = Trainer(cfg, build_mesh(layout, rank), torch.device("cpu"))
    turns = Turns(a.turns)
    for _ in range(a.steps):
        turns.wait()
        r = trainer.train_step()
        trainer.step += 1
        t = r["times"]
        a2a = sum(v for k, v in r["comm"].get("seconds", {}).items() if k.startswith(("dispatch", "combine")))
        rank_load = imbalance_stats(r["expert"]["rank_rows"])["max_over_mean"].mean()
        turns.report({"step": r["step_time"], "compute": t.forward + t.backward - a2a, "all_to_all": a2a,
                      "rest": r["step_time"] - t.forward - t.backward, "rank_load": float(rank_load),
                      "sent": sum(r["comm"]["sent"].get(k, 0) for k in ("dispatch", "combine"))})
    m = cfg.model
    elem = 2 if a.dtype == "bf16" else 4
    n_moe = m.num_hidden_layers - m.first_k_dense_replace
    planned = plan.alltoall_bytes_expected(1, m.num_experts_per_tok, m.hidden_size, layout.ep, elem,
                                           m.n_routed_experts, a.dedup, m.n_group, m.topk_group).sent * n_moe
    turns.close({"impl": "ours", "dtype": a.dtype, "dedup": a.dedup, "ep": layout.ep, "world": world,
                 "local_tokens": GLOBAL_BATCH * SEQ / layout.dp, "planned_bytes_per_token": planned})
    dist.barrier()


def worker_autoep(a) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from .turns import Turns
    from ..resolve import load_config
    from ..data import open_data

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cfg = load_config(CONFIG, overrides(world, a.dtype, a.steps, a.run_dir, False))
    _init(world)
    if a.keep_freed:  # the peer under our trainer's allocator setting, for a same-setting comparison
        from ..kernels.cpu.allocator import keep_freed_memory
        keep_freed_memory()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=dtype)
    model.train()
    accum = GLOBAL_BATCH // (MICRO_BATCH * world)
    t = cfg.train
    ds = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accum,
          "train_batch_size": GLOBAL_BATCH, "gradient_clipping": t.grad_clip, "zero_optimization": {"stage": 1},
          "bf16": {"enabled": a.dtype == "bf16"}, "steps_per_print": 1 << 30,
          "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.adam_eps,
                                                    "weight_decay": t.weight_decay, "torch_adam": True,
                                                    "fused": True}},  # the same AdamW as ours
          "expert_parallel": {"enabled": True, "autoep_size": world, "preset_model": "deepseek_v3"}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    _, train_data, _ = open_data(cfg.data.path, t.seq_len, cfg.run.seed, cfg.model.vocab_size, cfg.data.val_fraction)
    turns = Turns(a.turns)
    for step in range(a.steps):
        turns.wait()
        t0 = time.perf_counter()
        fb = 0.0
        for micro in range(accum):
            batch = train_data.micro_batch(step, micro, GLOBAL_BATCH, MICRO_BATCH, rank, world)
            ta = time.perf_counter()
            # the same seq_len input tokens as ours; HF shifts the labels itself (position t predicts t + 1)
            tokens = batch[:, :-1]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            tb = time.perf_counter()
            engine.step()
            fb += tb - ta
        dt = time.perf_counter() - t0
        turns.report({"step": dt, "compute": fb, "all_to_all": float("nan"), "rest": dt - fb})
    turns.close({"impl": "autoep + allocator" if a.keep_freed else "autoep", "dtype": a.dtype, "dedup": False,
                 "ep": world, "world": world, "planned_bytes_per_token": float("nan")})
    dist.barrier()


# ------------------------------------------------------------------ driver

def worker_cmd(impl: str, world: int, dtype: str, steps: int, run_dir: Path, turns: str, dedup: bool = False,
               hf: str = "", keep_freed: bool = False) -> tuple[list[str], str]:
    """The launcher command of one configuration, and how the results show it."""
    from .turns import free_port
    args = ["--worker", impl, "--dtype", dtype, "--steps", str(steps)] + (["--dedup"] if dedup else []) + \
        (["--keep-freed"] if keep_freed else [])
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
           "--module", "moe_trainer.bench.ep", *args, "--run-dir", str(run_dir), "--turns", turns] + \
        (["--hf", hf] if hf else [])
    shown = f"deepspeed --num_gpus {world} --module moe_trainer.bench.ep {' '.join(args)}" + \
        (" --hf <to_hf export>" if hf else "")
    return cmd, shown


def export_hf(tmp: Path, dtype: str) -> str:
    import torch

    from ..resolve import load_config
    from ..hf import to_hf
    from ..models.registry import build_model
    cfg = load_config(CONFIG, overrides(1, dtype, 1, str(tmp / "export"), False))
    model = build_model(cfg.model, cfg.run.seed)  # the same seeded init every rank of our trainer starts from
    path = tmp / f"hf_{dtype}"
    to_hf(model, path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return str(path)


def _f(x, fmt="{:.0f}"):
    return "n/a" if x is None or x != x else fmt.format(x)


def table(rows: list[dict]) -> str:
    lines = ["| impl | world=ep | dtype | dedup | tokens/s | step s | compute s | all-to-all s | rest s | "
             "a2a bytes/token (fwd, sent) | planner bytes/token | tokens/s 1st / 2nd half | "
             "EP rank load max/mean 1st / 2nd half |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['world']} | {r['dtype']} | {'on' if r['dedup'] else 'off'} | "
                     f"{_f(r['tokens_per_s'])} | {_f(r['step_s'], '{:.3f}')} | {_f(r['compute_s'], '{:.3f}')} | "
                     f"{_f(r['all_to_all_s'], '{:.3f}')} | {_f(r['rest_s'], '{:.3f}')} | "
                     f"{_f(r['bytes_per_token'])} | {_f(r['planned_bytes_per_token'])} | "
                     f"{_f(r['tokens_per_s_1st'])} / {_f(r['tokens_per_s_2nd'])} | "
                     f"{_f(r['rank_load_1st'], '{:.2f}')} / {_f(r['rank_load_2nd'], '{:.2f}')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moe_trainer.bench.ep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["ours", "autoep"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--dedup", action="store_true")
    ap.add_argument("--keep-freed", action="store_true", help=argparse.SUPPRESS)  # AutoEP worker: our allocator
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--turns", default="", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--hf", default="")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--peer-worlds", default="2,4")
    ap.add_argument("--out", default="")
    ap.add_argument("--mode", choices=("turns", "alone"), default="turns",
                    help="turns: one world size's configurations take turns step by step (secondary view); alone: "
                         "the headline, each configuration alone, --rounds rounds alternating the order, AutoEP "
                         "also at world 1 and ours at ep 1 (bench/headline.py)")
    ap.add_argument("--rounds", type=int, default=3, help="--mode alone: rounds per configuration")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        (worker_ours if a.worker == "ours" else worker_autoep)(a)
        return 0
    if not 0 <= a.warmup < a.steps:
        ap.error(f"--warmup must be at least 0 and below --steps ({a.steps}), got {a.warmup}")
    worlds = [int(w) for w in a.worlds.split(",") if w]
    dtypes = [d for d in a.dtypes.split(",") if d]
    peer_worlds = [int(w) for w in a.peer_worlds.split(",") if w]
    if a.mode == "alone":  # AutoEP at every world ours runs, world 1 included
        with tempfile.TemporaryDirectory(prefix="bench_ep_") as d:
            result = headline(a, Path(d), worlds, dtypes, sorted(set(worlds) | set(peer_worlds)))
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
        return 0
    rows, cmds = [], []
    with tempfile.TemporaryDirectory(prefix="bench_ep_") as d:
        tmp = Path(d)
        hf = {dt: export_hf(tmp, dt) for dt in dtypes} if peer_worlds else {}
        for dtype in dtypes:
            for world in sorted(set(worlds) | set(peer_worlds)):
                group = run_group(world, dtype, a, tmp, hf.get(dtype, ""), world in worlds, world in peer_worlds)
                rows += group["rows"]
                cmds += group["commands"]
    md = table(rows)
    ratios = []
    for r in rows:
        if r["impl"].startswith("autoep"):
            for o in rows:
                if o["impl"] == "ours" and o["world"] == r["world"] and o["dtype"] == r["dtype"]:
                    ratios.append(f"- world {r['world']} {r['dtype']}: ours (dedup {'on' if o['dedup'] else 'off'}) "
                                  f"/ {r['impl']} tokens/s = {o['tokens_per_s'] / r['tokens_per_s']:.2f}x")
    print(md)
    print("\n".join(ratios))
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "commands": cmds, "ratios": ratios}, indent=1))
    return 0


def headline(a, tmp: Path, worlds: list[int], dtypes: list[str], peer_worlds: list[int]) -> dict:
    """The headline figures: per dtype and world size, ours (ep = world, so world 1 is ep 1: the
    gain of expert parallelism apart from the kernels') and AutoEP with our allocator setting (the
    headline ratio) and with glibc's (the stock column), each alone, --rounds rounds alternating the
    order (bench/headline.py). {"<dtype> w<world>": {"jobs", "same_allocator", "stock"}}."""
    from .headline import ratio, run_alone
    from .turns import worker_env
    out = {"command": "scripts/bench_ep.sh " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
           "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds}
    for dtype in dtypes:
        hf = export_hf(tmp, dtype)
        for world in sorted(set(worlds) | set(peer_worlds)):
            def job(impl: str, keep_freed: bool = False, world=world, dtype=dtype, hf=hf):
                def factory(turns: str) -> tuple[list[str], dict]:
                    name = f"{impl}_w{world}_{dtype}_{int(keep_freed)}_{time.monotonic_ns()}"
                    cmd, _ = worker_cmd(impl, world, dtype, a.steps, tmp / name, turns, dedup=False,
                                        hf=hf if impl == "autoep" else "", keep_freed=keep_freed)
                    return cmd, worker_env(max(1, (os.cpu_count() or 1) // world), ROOT)
                return factory
            jobs = {"ours": job("ours")} if world in worlds else {}
            if world in peer_worlds:
                jobs.update({"autoep_keep_freed": job("autoep", True), "autoep": job("autoep")})
            res = run_alone(jobs, a.steps, a.warmup, a.rounds, cwd=ROOT, key="step",
                            split=("compute", "all_to_all", "rest"), tokens_per_step=GLOBAL_BATCH * SEQ)
            timed = {n for n, r in res.items() if "median_s" in r}
            out[f"{dtype} w{world}"] = {
                "jobs": res,
                "same_allocator": ratio(res["ours"], res["autoep_keep_freed"])
                if {"ours", "autoep_keep_freed"} <= timed else None,
                "stock": ratio(res["ours"], res["autoep"]) if {"ours", "autoep"} <= timed else None}
    return out


def run_group(world: int, dtype: str, a, tmp: Path, hf: str, ours: bool, peer: bool) -> dict:
    """One world size and dtype: its configurations as jobs stepping in turns -> table rows."""
    from .turns import Referee, worker_env
    jobs = ([("ours", dd) for dd in ([False, True] if world > 1 else [False])] if ours else []) + \
        ([("autoep", kf) for kf in (False, True)] if peer else [])
    referee = Referee()
    commands, out = [], []
    try:
        for impl, flag in jobs:
            name = f"{impl}_w{world}_{dtype}_{int(flag)}"
            cmd, shown = worker_cmd(impl, world, dtype, a.steps, tmp / name, referee.address(name),
                                    dedup=impl == "ours" and flag, hf=hf if impl == "autoep" else "",
                                    keep_freed=impl == "autoep" and flag)
            env = worker_env(max(1, (os.cpu_count() or 1) // world), ROOT)
            referee.start(name, cmd, env, cwd=ROOT)
            commands.append(shown)
        referee.wait_ready()
        steps = referee.take_turns(a.steps)
        for name, result in referee.finish_all().items():
            timed = steps[name][a.warmup:]
            row = {**result, **medians(timed), "bytes_per_token": float("nan")}
            if result["impl"] == "ours":  # rank 0's dispatch + combine bytes sent per local token
                row["bytes_per_token"] = statistics.mean(s["sent"] for s in timed) / result["local_tokens"]
            out.append(row)
            print(json.dumps(row), flush=True)
        for name, err in referee.failures().items():
            print(f"{name} failed:\n{err}", file=sys.stderr, flush=True)
    finally:
        referee.close()
    return {"rows": out, "commands": commands}


if __name__ == "__main__":
    sys.exit(main())

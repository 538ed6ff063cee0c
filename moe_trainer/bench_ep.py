"""Expert-parallel throughput: our trainer at world 1/2/4 (fp32, bf16) and DeepSpeed AutoEP as the peer.

    python -m moe_trainer.bench_ep [--steps 20] [--warmup 3] [--worlds 1,2,4] [--out docs/BENCHMARKS_ep.md]

Each configuration runs under the deepspeed launcher (`--module moe_trainer.bench_ep --worker ...`).
Our worker builds the Trainer exactly as moe_trainer.train does and times `train_step()`:
  compute    = forward + backward - time inside the dispatch/combine all-to-alls (incl. the count exchange)
  all-to-all = CommCounter.seconds of dispatch*/combine* kinds (blocking: includes waiting for peers)
  rest       = step - forward - backward (optimizer step with ZeRO-1 reduction, data, bias update)
Bytes per token: rank 0's forward dispatch + combine bytes sent per local token, against
plan.alltoall_bytes_expected x MoE layers (uniform-routing expectation).
The peer: transformers' DeepseekV3ForCausalLM loaded from our weights (moe_trainer.hf.to_hf) with
DeepSpeed AutoEP (ZeRO-1, torch AdamW from the DS config), the same batches.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def _summary(times: list[dict], world: int) -> dict:
    n = len(times)
    mean = {k: sum(t[k] for t in times) / n for k in times[0]}
    tokens = GLOBAL_BATCH * SEQ
    return {"world": world, "steps": n, "tokens_per_s": tokens / mean["step"], **{f"{k}_s": v for k, v in mean.items()}}


def worker_ours(a) -> None:
    import torch
    import torch.distributed as dist

    from . import plan
    from .config import load_config, validate_layout
    from .parallel.launch import keep_freed_memory
    from .parallel.mesh import build_mesh
    from .trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(CONFIG, overrides(world, a.dtype, a.steps, a.run_dir, a.dedup))
    layout = validate_layout(cfg, world)
    _init(world)
    if cfg.train.keep_freed_memory:  # as moe_trainer.train does on CPU ranks
        keep_freed_memory()
    rank = int(os.environ.get("RANK", "0"))
    trainer = Trainer(cfg, build_mesh(layout, rank), torch.device("cpu"))
    times, sent = [], []
    for step in range(a.steps):
        r = trainer.train_step()
        trainer.step += 1
        if step < a.warmup:
            continue
        t = r["times"]
        a2a = sum(v for k, v in r["comm"].get("seconds", {}).items() if k.startswith(("dispatch", "combine")))
        times.append({"step": r["step_time"], "compute": t.forward + t.backward - a2a, "all_to_all": a2a,
                      "rest": r["step_time"] - t.forward - t.backward})
        sent.append(sum(r["comm"]["sent"].get(k, 0) for k in ("dispatch", "combine")))
    if rank == 0:
        m = cfg.model
        local_tokens = GLOBAL_BATCH * SEQ / layout.dp
        elem = 2 if a.dtype == "bf16" else 4
        n_moe = m.num_hidden_layers - m.first_k_dense_replace
        planned = plan.alltoall_bytes_expected(1, m.num_experts_per_tok, m.hidden_size, layout.ep, elem,
                                               m.n_routed_experts, a.dedup, m.n_group, m.topk_group).sent * n_moe
        out = {"impl": "ours", "dtype": a.dtype, "dedup": a.dedup, "ep": layout.ep, **_summary(times, world),
               "bytes_per_token": sum(sent) / len(sent) / local_tokens, "planned_bytes_per_token": planned}
        Path(a.result).write_text(json.dumps(out))
    dist.barrier()


def worker_autoep(a) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from .config import load_config
    from .data import open_data

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cfg = load_config(CONFIG, overrides(world, a.dtype, a.steps, a.run_dir, False))
    _init(world)
    if a.keep_freed:  # the peer under our trainer's allocator setting, for a same-setting comparison
        from .parallel.launch import keep_freed_memory
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
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        fb = 0.0
        for micro in range(accum):
            batch = train_data.micro_batch(step, micro, GLOBAL_BATCH, MICRO_BATCH, rank, world)
            ta = time.perf_counter()
            # HF shifts labels inside: feed the same seq_len tokens as ours
            loss = engine(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
            engine.backward(loss)
            tb = time.perf_counter()
            engine.step()
            fb += tb - ta
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append({"step": dt, "compute": fb, "all_to_all": float("nan"), "rest": dt - fb})
    if rank == 0:
        out = {"impl": "autoep + allocator" if a.keep_freed else "autoep", "dtype": a.dtype, "dedup": False,
               "ep": world, **_summary(times, world),
               "bytes_per_token": float("nan"), "planned_bytes_per_token": float("nan")}
        Path(a.result).write_text(json.dumps(out))
    dist.barrier()


# ------------------------------------------------------------------ driver

def _env() -> dict:
    e = dict(os.environ)
    e.setdefault("DS_ACCELERATOR", "cpu")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1)))
    return e


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(impl: str, world: int, dtype: str, steps: int, warmup: int, tmp: Path, dedup: bool = False,
            hf: str = "", timeout: int = 900, keep_freed: bool = False) -> tuple[dict | None, str]:
    tag = f"{impl}_w{world}_{dtype}{'_dedup' if dedup else ''}{'_kf' if keep_freed else ''}"
    result = tmp / f"{tag}.json"
    args = ["--worker", impl, "--dtype", dtype, "--steps", str(steps), "--warmup", str(warmup),
            "--result", str(result), "--run-dir", str(tmp / tag)] + (["--dedup"] if dedup else []) + \
        (["--hf", hf] if hf else []) + (["--keep-freed"] if keep_freed else [])
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(world), "--master_port", str(_port()),
           "--module", "moe_trainer.bench_ep", *args]
    env = _env()
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    shown = "deepspeed --num_gpus {} --module moe_trainer.bench_ep {}".format(
        world, " ".join(a for a in args if not a.startswith(str(tmp))))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not result.exists():
        print(f"{tag} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None, shown
    r = json.loads(result.read_text())
    print(json.dumps(r), flush=True)
    return r, shown


def export_hf(tmp: Path, dtype: str) -> str:
    import torch

    from .config import load_config
    from .hf import to_hf
    from .models.registry import build_model
    cfg = load_config(CONFIG, overrides(1, dtype, 1, str(tmp / "export"), False))
    model = build_model(cfg.model, cfg.run.seed)  # the same seeded init every rank of our trainer starts from
    path = tmp / f"hf_{dtype}"
    to_hf(model, path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return str(path)


def _f(x, fmt="{:.0f}"):
    return "n/a" if x is None or x != x else fmt.format(x)


def table(rows: list[dict]) -> str:
    lines = ["| impl | world=ep | dtype | dedup | tokens/s | step s | compute s | all-to-all s | rest s | "
             "a2a bytes/token (fwd, sent) | planner bytes/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['world']} | {r['dtype']} | {'on' if r['dedup'] else 'off'} | "
                     f"{_f(r['tokens_per_s'])} | {_f(r['step_s'], '{:.3f}')} | {_f(r['compute_s'], '{:.3f}')} | "
                     f"{_f(r['all_to_all_s'], '{:.3f}')} | {_f(r['rest_s'], '{:.3f}')} | "
                     f"{_f(r['bytes_per_token'])} | {_f(r['planned_bytes_per_token'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moe_trainer.bench_ep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["ours", "autoep"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--dedup", action="store_true")
    ap.add_argument("--keep-freed", action="store_true", help=argparse.SUPPRESS)  # AutoEP worker: our allocator
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--result", default="")
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--hf", default="")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--peer-worlds", default="2,4")
    ap.add_argument("--out", default="")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        (worker_ours if a.worker == "ours" else worker_autoep)(a)
        return 0
    worlds = [int(w) for w in a.worlds.split(",") if w]
    dtypes = [d for d in a.dtypes.split(",") if d]
    rows, cmds = [], []
    with tempfile.TemporaryDirectory(prefix="bench_ep_") as d:
        tmp = Path(d)
        for dtype in dtypes:
            for world in worlds:
                for dedup in ([False, True] if world > 1 else [False]):
                    r, c = run_one("ours", world, dtype, a.steps, a.warmup, tmp, dedup)
                    cmds.append(c)
                    rows.append(r) if r else None
        peer_worlds = [int(w) for w in a.peer_worlds.split(",") if w]
        for dtype in dtypes:
            hf = export_hf(tmp, dtype) if peer_worlds else ""
            for world, kf in itertools.product(peer_worlds, (False, True)):
                r, c = run_one("autoep", world, dtype, a.steps, a.warmup, tmp, hf=hf, keep_freed=kf)
                cmds.append(c.replace(hf, "<to_hf export>"))
                rows.append(r) if r else None
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


if __name__ == "__main__":
    sys.exit(main())

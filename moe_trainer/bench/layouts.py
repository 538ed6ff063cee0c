"""Layouts side by side: measured memory, traffic and throughput of the real Trainer next to the planner.

`measure_layout` builds the real `Trainer` (exactly as moe_trainer.train does) in spawned gloo ranks on
this machine, with DeepSpeed's comms logger on (`zero.deepspeed_config(comms_logger=True)`), runs a few
optimizer steps and returns per rank: parameters (sum of numel), ZeRO-1 optimizer state (the fp32
partition DeepSpeed keeps plus Adam's exp_avg / exp_avg_sq), the trainer's CommCounter bytes per kind
(all-to-all, TP, CP, pipeline send/recv), DeepSpeed's own collectives per op and message size (gradient
all-reduce, parameter all-gather), the exact all-to-all bytes of the routing the router chose, and
tokens/s. tests/test_plan_honesty.py asserts these against `moe_trainer.plan`; `main` (scripts/
bench_layouts.sh) prints the MoE-vs-dense table of docs/BENCHMARKS_layouts.md.

Traffic is what ONE rank sends per optimizer step, counted as ring algorithms move it (the planner's
convention): all-reduce 2(g-1)/g x size, all-gather and reduce-scatter (g-1)/g x the full size.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from .turns import free_port

ROOT = Path(__file__).resolve().parents[2]

# DeepSpeed callers whose ops are scalars (gradient norms, overflow checks): not planned, reported apart
SCALAR_BYTES = 8


def _optimizer_numels(engine) -> dict:
    """Elements of DeepSpeed ZeRO-1 optimizer state on this rank: the fp32 partition (master copy) and
    Adam's tensors (scalar `step` entries left out), under either optimizer a run selects (ZeRO-1's, or
    the BF16_Optimizer of bf16 runs with fp32 gradient accumulation)."""
    import torch
    from ..parallel.zero import fp32_partitions
    opt, parts = engine.optimizer, fp32_partitions(engine)
    out = {"fp32_partition": sum(t.numel() for t in parts), "groups": len(parts)}
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            for k, v in opt.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.numel() > 1:
                    out[k] = out.get(k, 0) + v.numel()
    return out


def _worker(rank, world, port, config, overrides, out_dir, steps, results):
    os.chdir(ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import deepspeed.comm as ds_comm
    from moe_trainer import plan
    from moe_trainer.config import validate_layout
    from moe_trainer.resolve import load_config
    from moe_trainer.parallel import zero
    from moe_trainer.parallel.mesh import build_mesh
    from moe_trainer.trainer import Trainer
    from moe_trainer.moe.layer import MoE
    zero.deepspeed_config = functools.partial(zero.deepspeed_config, comms_logger=True)
    cfg = load_config(config, list(overrides) + [f"run.out_dir={out_dir}"])
    layout = validate_layout(cfg, world)
    from moe_trainer.parallel.launch import init_distributed
    init_distributed(300)  # and unlink DeepSpeed's /dev/shm segment
    mesh = build_mesh(layout, rank)
    device = torch.device("cpu")
    trainer = Trainer(cfg, mesh, device)
    m = cfg.model
    seen = []
    for mod in trainer.engine.module.modules():
        if isinstance(mod, MoE):
            mod.gate.register_forward_hook(lambda _m, _a, o: seen.append(o.topk_idx.detach().clone()))
    elem = 2 if cfg.train.dtype == "bf16" else 4
    records = []
    for _ in range(steps):
        seen.clear()
        ds_comm.comms_logger.reset_data()
        r = trainer.train_step()
        trainer.step += 1
        exact = 0.0  # this rank's exact all-to-all bytes sent (dispatch + combine, forward + backward)
        if mesh.size("ep") > 1:
            for topk in seen:  # every EP rank runs the same layers and micro-batches in the same order
                routing = [torch.empty_like(topk) for _ in range(mesh.size("ep"))]
                dist.all_gather(routing, topk.contiguous(), group=mesh.group("ep"))
                b = plan.alltoall_bytes_exact(routing, m.n_routed_experts, mesh.size("ep"), mesh.index("ep"),
                                              m.hidden_size, elem, cfg.parallel.dedup_dispatch)
                exact += b.sent + b.received  # forward sends `sent`, backward sends what forward received
        ds_ops = [(name.split(" | ")[0], name.split("Caller Func: ")[-1].rstrip("]"), int(size), v[0])
                  for name, sizes in ds_comm.comms_logger.comms_dict.items() for size, v in sizes.items()]
        records.append({"sent": r["comm"]["sent"], "received": r["comm"]["received"], "step_time": r["step_time"],
                        "alltoall_exact": exact, "ds_ops": ds_ops, "moe_forwards": len(seen)})
    params = list(trainer.engine.module.parameters())
    results[rank] = {
        "rank": rank, "stage": mesh.coord["pp"], "dense_group": mesh.size("dpcp"), "edp": mesh.size("edp"),
        "numel": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "expert_numel": sum(p.numel() for n, p in trainer.engine.module.named_parameters() if ".mlp.experts." in
                            "." + n),
        "optimizer": _optimizer_numels(trainer.engine), "steps": records,
        "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len}
    dist.barrier()
    dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> None:
    import torch.multiprocessing as mp
    mp.spawn(fn, args=args, nprocs=world, join=True)


def measure_layout(config: str, overrides: list[str], world: int, steps: int = 2, out_dir: Optional[str] = None,
                   start: Callable = _spawn) -> list[dict]:
    """Per-rank measurements (see the module docstring) of `steps` real trainer steps on `world` gloo ranks,
    started by `start(fn, world, *args)` (fn(rank, *args) on each; spawned processes by default)."""
    import tempfile
    import torch.multiprocessing as mp
    out_dir = out_dir or tempfile.mkdtemp(prefix="bench_layouts_")
    results = mp.Manager().dict()
    start(_worker, world, world, free_port(), str(ROOT / config), list(overrides), out_dir, steps, results)
    return [results[r] for r in range(world)]


# ----------------------------------------------------------------------------- DeepSpeed's collectives -> ring bytes

def zero_ring_bytes(ds_ops: list, dense_numel: int, expert_numel: int, dense_group: int, expert_group: int,
                    elem: int) -> dict:
    """Bytes one rank sends in DeepSpeed's ZeRO-1 collectives of one step, from the comms logger's
    (op, caller, message bytes, count) rows: the gradient all-reduce (caller allreduce_bucket; one
    message per group, told apart by size: dense * elem or expert * elem) and the parameter all-gather
    (all_gather_into_tensor: the message is this rank's shard, padded by DeepSpeed to an aligned size).
    Scalar ops (gradient norms, overflow) are summed under `scalars`; anything else under `other`."""
    out = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "scalars": 0, "other": [],
           "grad_message_bytes": 0}
    for op, caller, size, count in ds_ops:
        if size <= SCALAR_BYTES:
            out["scalars"] += size * count
        elif op == "all_reduce" and caller == "allreduce_bucket":
            g = dense_group if size == dense_numel * elem else expert_group if size == expert_numel * elem else None
            if g is None:
                out["other"].append((op, caller, size, count))
                continue
            out["grad_message_bytes"] += size * count
            out["all_reduce"] += count * 2 * (g - 1) / g * size
        elif op in ("all_gather_into_tensor", "all_gather"):
            # shards of the dense groups come first; a rank has at most one expert group here
            out["all_gather"] += count * (dense_group - 1) * size if dense_group > 1 else 0.0
        elif op in ("reduce_scatter_tensor", "reduce_scatter"):
            out["reduce_scatter"] += count * size
        else:
            out["other"].append((op, caller, size, count))
    return out


def comm_by_kind(sent: dict) -> dict:
    """The trainer's CommCounter kinds summed into the collective they are."""
    out = {"all_to_all": 0, "tp_all_gather": 0, "tp_reduce_scatter": 0, "tp_all_reduce": 0, "cp": 0, "pp_send": 0}
    for kind, b in sent.items():
        if kind.startswith(("dispatch", "combine")):
            out["all_to_all"] += b
        elif kind.startswith("tp_") and "all_gather" in kind:
            out["tp_all_gather"] += b
        elif kind.startswith("tp_") and "reduce_scatter" in kind:
            out["tp_reduce_scatter"] += b
        elif kind.startswith("tp_"):
            out["tp_all_reduce"] += b
        elif kind.startswith("cp_"):
            out["cp"] += b
        elif kind.startswith("pp_"):
            out["pp_send"] += b
    return out


# ----------------------------------------------------------------------------- the benchmark

MOE_CONFIG, DENSE_CONFIG = "configs/moe_layout_bench.yaml", "configs/dense_layout_bench.yaml"
LAYOUTS = [
    ("MoE", MOE_CONFIG, "ep 4 (dp 4)", ["parallel.ep=4"]),
    ("MoE", MOE_CONFIG, "pp 2 x ep 2 (dp 2)", ["parallel.pp=2", "parallel.ep=2"]),
    ("MoE", MOE_CONFIG, "pp 2 x dp 2", ["parallel.pp=2"]),
    ("dense", DENSE_CONFIG, "tp 2 x dp 2", ["parallel.tp=2"]),
    ("dense", DENSE_CONFIG, "cp 2 x dp 2", ["parallel.cp=2"]),
    ("dense", DENSE_CONFIG, "tp 2 x pp 2", ["parallel.tp=2", "parallel.pp=2"]),
    ("dense", DENSE_CONFIG, "dp 4", []),
]


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def bench_one(model: str, config: str, name: str, overrides: list[str], world: int, steps: int) -> dict:
    from moe_trainer import plan as planner
    from moe_trainer.resolve import load_config
    cfg = load_config(str(ROOT / config), overrides)
    p = planner.make_plan(cfg, world)
    t0 = time.perf_counter()
    ranks = measure_layout(config, overrides, world, steps)
    wall = time.perf_counter() - t0
    elem = 2 if cfg.train.dtype == "bf16" else 4
    last = [r["steps"][-1] for r in ranks]
    step_time = max(s["step_time"] for s in last)  # the pipeline's / slowest rank's pace
    tokens = ranks[0]["tokens_per_step"]

    def worst(get):  # the rank that sends the most, as the planner reports its worst stage
        return max(get(r, s) for r, s in zip(ranks, last))

    def zero_of(r, s):
        expert = r["expert_numel"] if cfg.parallel.ep > 1 else 0  # ep 1: experts are dense to DeepSpeed
        return zero_ring_bytes(s["ds_ops"], r["numel"] - expert, expert, r["dense_group"], r["edp"], elem)

    def kinds(s):
        return comm_by_kind(s["sent"])

    meas = {
        "zero_ar": worst(lambda r, s: zero_of(r, s)["all_reduce"]),
        "zero_ag": worst(lambda r, s: zero_of(r, s)["all_gather"]),
        "zero_dp": worst(lambda r, s: zero_of(r, s)["all_reduce"] + zero_of(r, s)["all_gather"]),
        "tp_ar": worst(lambda r, s: kinds(s)["tp_all_reduce"]),
        "tp_ag": worst(lambda r, s: kinds(s)["tp_all_gather"]),
        "tp_rs": worst(lambda r, s: kinds(s)["tp_reduce_scatter"]),
        "cp": worst(lambda r, s: kinds(s)["cp"]),
        "all_to_all": worst(lambda r, s: kinds(s)["all_to_all"]),
        "send_recv": worst(lambda r, s: kinds(s)["pp_send"]),
        "total": worst(lambda r, s: zero_of(r, s)["all_reduce"] + zero_of(r, s)["all_gather"]
                       + sum(kinds(s).values())),
        "ds_scalars": worst(lambda r, s: zero_of(r, s)["scalars"]),
        "ds_other": [zero_of(r, s)["other"] for r, s in zip(ranks, last)],
        "params": max(r["numel"] for r in ranks),
        "param_opt_bytes": max(r["param_bytes"] + 4 * (r["optimizer"]["fp32_partition"] + r["optimizer"].get(
            "exp_avg", 0) + r["optimizer"].get("exp_avg_sq", 0)) for r in ranks),
    }
    st = p.stages
    planned = {
        "all_reduce": max(s.comm.dense_dp.all_reduce + s.comm.expert_dp.all_reduce for s in st),
        "all_gather": max(s.comm.dense_dp.all_gather + s.comm.expert_dp.all_gather for s in st),
        "all_to_all": max(s.comm.all_to_all for s in st),
        "send_recv": max(s.comm.pipeline for s in st),
        "tensor": max(s.comm.tensor for s in st),
        "context": max(s.comm.context for s in st),
        "zero_dp": max(s.comm.dense_dp.total + s.comm.expert_dp.total for s in st),
        "total": max(s.comm.total for s in st),
        "params": max(s.params.dense + s.params.expert for s in st),
        "param_opt_bytes": max(s.states.params + s.states.optimizer for s in st),
    }
    return {"model": model, "layout": name, "overrides": overrides, "tokens_per_s": tokens / step_time,
            "step_time_s": step_time, "wall_s": wall, "measured": meas, "planned": planned,
            "flops_per_token": None}


def format_table(rows: list[dict]) -> str:
    head = ["model", "layout", "tokens/s", "step s", "params/rank meas / plan", "param+optim MB/rank meas / plan",
            "ZeRO all-reduce + all-gather MB meas / plan", "all-to-all MB meas / plan",
            "TP AR / AG / RS MB meas (plan total)", "CP AG+RS MB meas / plan", "send/recv MB meas / plan",
            "total MB meas / plan"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m, p = r["measured"], r["planned"]
        lines.append("| " + " | ".join([
            r["model"], r["layout"], f"{r['tokens_per_s']:.0f}", f"{r['step_time_s']:.2f}",
            f"{m['params']:,} / {p['params']:,.0f}", f"{_mb(m['param_opt_bytes'])} / {_mb(p['param_opt_bytes'])}",
            f"{_mb(m['zero_ar'])} + {_mb(m['zero_ag'])} / {_mb(p['all_reduce'])} + {_mb(p['all_gather'])}", f"{_mb(m['all_to_all'])} / {_mb(p['all_to_all'])}",
            f"{_mb(m['tp_ar'])} / {_mb(m['tp_ag'])} / {_mb(m['tp_rs'])} ({_mb(p['tensor'])})",
            f"{_mb(m['cp'])} / {_mb(p['context'])}", f"{_mb(m['send_recv'])} / {_mb(p['send_recv'])}",
            f"{_mb(m['total'])} / {_mb(p['total'])}"]) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench_layouts.sh", description="MoE (DeepSeek-V3 style) vs dense "
                                 "(Llama 3) layouts at equal model FLOPs per token on 4 ranks: tokens/s, bytes per "
                                 "step by collective, parameter + optimizer memory per rank, next to tools/plan.py.")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per layout (the last one is reported)")
    ap.add_argument("--only", default="", help="comma-separated substrings of layout names to run")
    ap.add_argument("--json", default="", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    from moe_trainer.resolve import load_config
    from moe_trainer.metrics import train_flops_per_token
    flops = {}
    for cfg_path in (MOE_CONFIG, DENSE_CONFIG):
        cfg = load_config(str(ROOT / cfg_path))
        flops[cfg_path] = train_flops_per_token(cfg.model, cfg.train.seq_len)
    print(f"model FLOPs per token (train, fwd+bwd): MoE {flops[MOE_CONFIG] / 1e6:.2f} M, dense "
          f"{flops[DENSE_CONFIG] / 1e6:.2f} M ({100 * (flops[DENSE_CONFIG] / flops[MOE_CONFIG] - 1):+.1f}%)", flush=True)
    rows = []
    for model, config, name, overrides in LAYOUTS:
        if args.only and not any(k in name or k == model for k in args.only.split(",")):
            continue
        row = bench_one(model, config, name, overrides, args.world, args.steps)
        row["flops_per_token"] = flops[config]
        rows.append(row)
        print(f"{model:5s} {name:20s} {row['tokens_per_s']:8.0f} tokens/s  (wall {row['wall_s']:.0f}s)", flush=True)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

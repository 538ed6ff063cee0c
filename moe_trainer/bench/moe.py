"""Benchmark forward+backward of one MoE layer: ours vs DeepSpeed vs transformers.

Shapes (DeepSeek-V3 style, small): d=512, 64 routed experts, top-6, expert hidden 256,
2 shared experts of hidden 256, 4096 tokens (batch 8 x seq 512), fp32 and bf16.

Each (implementation, dtype) runs in its own subprocess so that its peak RSS
(ru_maxrss) is its own; the parent collects one JSON line from each, measures a
plain torch.matmul roofline, and writes a markdown table (``--out``).

    scripts/bench_moe.sh                      # everything, writes docs/BENCHMARKS_moe.md
    scripts/bench_moe.sh --iters 3 --warmup 1 --impls ours_grouped,deepspeed
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from .turns import free_port

D, E, TOP_K, H, N_SHARED = 512, 64, 6, 256, 2
BATCH, SEQ = 8, 512

IMPLS = ["ours_grouped", "ours_loop", "deepspeed", "hf_grouped_mm", "hf_eager"]
LABELS = {
    "ours_grouped": "ours (impl=grouped, torch._grouped_mm)",
    "ours_loop": "ours (impl=loop, reference)",
    "deepspeed": "DeepSpeed `moe.layer.MoE` + shared SwiGLU",
    "hf_grouped_mm": "transformers `DeepseekV3MoE` (experts_implementation=grouped_mm)",
    "hf_eager": "transformers `DeepseekV3MoE` (eager)",
}


def flops_per_iter(tokens: int) -> float:
    fwd = 2 * 3 * D * H * (TOP_K + N_SHARED) + 2 * D * E
    return 3.0 * fwd * tokens


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# ----------------------------------------------------------------------------- builders

def _start(m, dtype):
    """Every parameter drawn from N(0, 0.02), then cast, in training mode: each layer starts alike."""
    import torch
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m.to(dtype).train()


def _loss_of_first_output(m):
    """step(x) -> mean(out^2) for a layer returning (out, its aux loss)."""
    def step(x):
        return m(x)[0].float().square().mean()
    return step


def _build(impl: str, dtype, n_group: int, topk_group: int):
    """-> (module, step(x) returning a scalar loss)."""
    import torch
    from torch import nn

    if impl.startswith("ours"):
        from moe_trainer.moe.layer import MoE
        m = MoE(D, E, TOP_K, H, N_SHARED, n_group, topk_group, norm_topk_prob=True,
                routed_scaling_factor=2.5, scoring_func="sigmoid",
                impl="grouped" if impl == "ours_grouped" else "loop")
        m = _start(m, dtype)
        return m, _loss_of_first_output(m)

    if impl == "deepspeed":
        import torch.distributed as tdist
        import deepspeed
        from deepspeed.moe.layer import MoE as DSMoE
        from moe_trainer.models.layers import SwiGLU
        if not tdist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
            tdist.init_process_group("gloo", rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend="gloo")

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.moe = DSMoE(hidden_size=D, expert=SwiGLU(D, H), num_experts=E, ep_size=1, k=TOP_K,
                                 drop_tokens=False, use_residual=False)
                self.shared = SwiGLU(D, H * N_SHARED)

            def forward(self, x):
                flat = x.reshape(-1, D)
                out, l_aux, _ = self.moe(flat)
                return out + self.shared(flat), l_aux

        m = _start(Block(), dtype)
        return m, _loss_of_first_output(m)

    if impl.startswith("hf"):
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        cfg = DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=TOP_K,
                               moe_intermediate_size=H, n_shared_experts=N_SHARED, n_group=1, topk_group=1,
                               norm_topk_prob=True, routed_scaling_factor=2.5)
        cfg._experts_implementation = "grouped_mm" if impl == "hf_grouped_mm" else "eager"
        m = DeepseekV3MoE(cfg)
        with torch.no_grad():
            for b in m.buffers():
                if b.is_floating_point():
                    b.zero_()
        m = _start(m, dtype)

        def step(x):
            return m(x).float().square().mean()
        return m, step

    raise ValueError(impl)


def worker(impl: str, dtype_name: str, args) -> dict:
    import torch
    if args.allocator == "keep_freed":  # our trainer's CPU setting, for every implementation alike
        from moe_trainer.kernels.cpu.allocator import keep_freed_memory
        keep_freed_memory()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    m, step = _build(impl, dtype, args.n_group, args.topk_group)
    x = (torch.randn(BATCH, SEQ, D) * 1.0).to(dtype).requires_grad_(True)
    rss0 = _rss_mb()

    def one():
        m.zero_grad(set_to_none=True)
        x.grad = None
        loss = step(x)
        loss.backward()

    for _ in range(args.warmup):
        one()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    res = {"impl": impl, "dtype": dtype_name, "times": times, "median_s": statistics.median(times), "min_s": min(times),
           "rss_before_mb": rss0, "peak_rss_mb": _rss_mb()}
    if args.profile:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one()
        res["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return res


# ----------------------------------------------------------------------------- roofline

def roofline(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    tokens = BATCH * SEQ
    shapes = [(tokens, D, 2 * H * 4), (tokens, 2 * H * 4, D)]  # 4096x512 @ 512x2048 and back
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = []
        for (m_, k_, n_) in shapes:
            a, b = torch.randn(m_, k_, dtype=dt), torch.randn(k_, n_, dtype=dt)
            for _ in range(2):
                torch.matmul(a, b)
            ts = []
            for _ in range(max(3, args.iters)):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                ts.append(time.perf_counter() - t0)
            best.append(2.0 * m_ * k_ * n_ / statistics.median(ts) / 1e9)
        out[name] = max(best)
        out[name + "_shapes"] = {f"{s[0]}x{s[1]}@{s[1]}x{s[2]}": round(g, 1) for s, g in zip(shapes, best)}
    return out


# ----------------------------------------------------------------------------- driver

def _run_child(impl, dtype, argv) -> dict:
    cmd = [sys.executable, "-m", "moe_trainer.bench.moe", "--_worker", f"{impl}:{dtype}"] + argv
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"impl": impl, "dtype": dtype, "error": (p.stderr or p.stdout)[-1500:]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list from {IMPLS}")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-group", type=int, default=1)
    ap.add_argument("--topk-group", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per run")
    ap.add_argument("--allocators", default="stock,keep_freed",
                    help="process settings to run every implementation under: stock (glibc's default) and/or "
                         "keep_freed (train.keep_freed_memory, what our trainer sets on CPU ranks)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run the compared layers (--round-impls) this many times, interleaved, and pool their "
                         "timings, so a slow spell of a shared machine does not land on one layer only")
    ap.add_argument("--round-impls", default="ours_grouped,deepspeed,hf_grouped_mm",
                    help="the layers repeated in every round (the slow references run once)")
    ap.add_argument("--allocator", default="stock", help=argparse.SUPPRESS)  # a child's setting
    ap.add_argument("--out", default="docs/BENCHMARKS_moe.md")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)

    if args._worker:
        impl, dt = args._worker.split(":")
        print("RESULT " + json.dumps(worker(impl, dt, args)), flush=True)
        return

    child_argv = [a for a in raw if not a.startswith("--out")]
    if "--out" in raw:  # drop "--out PATH" pair
        i = raw.index("--out")
        child_argv = raw[:i] + raw[i + 2:]
    t_start = time.time()
    roof = None
    tokens = BATCH * SEQ
    fl = flops_per_iter(tokens)
    runs: dict = {}
    repeated = set(args.round_impls.split(","))
    round_roofs = []
    for rnd in range(args.rounds):
        r_roof = roofline(args)  # per dtype; each run is held against its own round's figure
        round_roofs.append({k: round(r_roof[k], 1) for k in ("fp32", "bf16")})
        roof = roof or dict(r_roof)
        for name in ("fp32", "bf16"):
            if r_roof[name] > roof[name]:
                roof[name], roof[name + "_shapes"] = r_roof[name], r_roof[name + "_shapes"]
        for alloc, dt, impl in itertools.product(args.allocators.split(","), args.dtypes.split(","),
                                                 args.impls.split(",")):
            if rnd and impl not in repeated:
                continue
            r = _run_child(impl, dt, child_argv + ["--allocator", alloc])
            r["round_roof"] = r_roof[dt]
            runs.setdefault((alloc, impl, dt), []).append(r)
            if "error" not in r:
                print(f"round {rnd + 1} {alloc:10s} {impl:14s} {dt}: {statistics.median(r['times'])*1e3:8.1f} ms",
                      flush=True)
    print(f"roofline torch.matmul GFLOP/s: fp32 {roof['fp32']:.1f} {roof['fp32_shapes']}  "
          f"bf16 {roof['bf16']:.1f} {roof['bf16_shapes']}", flush=True)
    results = {}
    for key, rs in runs.items():
        alloc, impl, dt = key
        bad = [r for r in rs if "error" in r]
        if bad:
            results[key] = r = bad[0]
            print(f"{alloc:10s} {impl:14s} {dt}: ERROR {r['error']}", flush=True)
            continue
        times = [t for r in rs for t in r["times"]]
        results[key] = r = {"times": times, "median_s": statistics.median(times), "min_s": min(times),
                            "peak_rss_mb": max(x["peak_rss_mb"] for x in rs),
                            "rss_before_mb": min(x["rss_before_mb"] for x in rs),
                            "profile": "\n".join(x["profile"] for x in rs if x.get("profile"))}
        r["tok_s"] = tokens / r["median_s"]
        r["gflops"] = fl / r["median_s"] / 1e9
        # a shared VM drifts by ~10% over minutes: each round's speed against the roofline measured
        # just before it, the median over rounds; roof_frac_best holds the pooled median against the
        # best round's roofline (lower when the machine slows after that round)
        r["roof_frac"] = statistics.median(fl / statistics.median(x["times"]) / 1e9 / x["round_roof"] for x in rs)
        r["roof_frac_best"] = r["gflops"] / roof[dt]
        print(f"{alloc:10s} {impl:14s} {dt}: {r['median_s']*1e3:8.1f} ms (min {r['min_s']*1e3:.1f})  "
              f"{r['tok_s']:9.0f} tok/s  {r['gflops']:7.1f} GFLOP/s  {100*r['roof_frac']:5.1f}% roof  "
              f"peak RSS {r['peak_rss_mb']:.0f} MB (+{r['peak_rss_mb']-r['rss_before_mb']:.0f} MB in fwd/bwd)",
              flush=True)
        if r.get("profile"):
            print(r["profile"], flush=True)
    elapsed = time.time() - t_start
    roof["rounds"] = round_roofs
    write_md(args, raw, roof, results, fl, elapsed)
    print(f"wrote {args.out} ({elapsed:.0f} s)")


def write_md(args, raw, roof, results, fl, elapsed):
    import platform
    import torch
    cmd = "scripts/bench_moe.sh" + ("" if not raw else " " + " ".join(raw))
    L = ["# MoE layer benchmark (forward + backward)", "",
         f"Command: `{cmd}` (run from the repo root; `DS_ACCELERATOR=cpu` when there is no GPU).", "",
         f"Machine: {platform.machine()}, {os.cpu_count()} CPUs visible, torch.set_num_threads({args.threads}), "
         f"torch {torch.__version__}, CPU only. Wall time of the run: {elapsed:.0f} s.", "",
         f"Shapes: d={D}, {E} routed experts, top-{TOP_K}, expert hidden {H}, {N_SHARED} shared experts of hidden {H} "
         f"(one SwiGLU of hidden {H * N_SHARED}), {BATCH * SEQ} tokens (batch {BATCH} x seq {SEQ}). "
         f"Ours: sigmoid router, n_group={args.n_group}, topk_group={args.topk_group}. "
         f"Loss = mean(out^2); timed = zero_grad + forward + backward; {args.warmup} warm-up iterations then "
         f"{args.iters} timed per process; the layers in {args.round_impls} run in {args.rounds} interleaved rounds "
         f"(one process each per round) and their median and min pool every round's timings.", "",
         f"FLOPs per iteration: 3 x (2*3*d*H*(top_k+n_shared) + 2*d*E) x tokens = {fl/1e9:.1f} GFLOP.", "",
         f"Roofline (plain torch.matmul, best of {list(roof['fp32_shapes'])}), measured before every round: "
         f"{roof['rounds']} GFLOP/s; best round fp32 {roof['fp32']:.1f} {roof['fp32_shapes']}, "
         f"bf16 {roof['bf16']:.1f} {roof['bf16_shapes']}. "
         "% roofline = the median over rounds of (that round's GFLOP/s / the roofline measured just before it), "
         "so a slow spell of the VM lowers both sides alike; the Targets also give the pooled GFLOP/s against "
         "the best round's roofline.", "",
         "Peak RSS = ru_maxrss of the subprocess that ran only that implementation and dtype "
         "(includes the python/torch/library imports); Δ = growth during warm-up + timed iterations.", "",
         "Each implementation runs under two process settings: **stock** (glibc's default malloc, which "
         "unmaps every freed block above 32 MiB so the next iteration page-faults it in again: what a user's "
         "own script gets) and **keep_freed** (`train.keep_freed_memory`, what our trainer sets on CPU ranks: "
         "freed memory is reused). The layers are compared within one setting.", ""]
    allocs = args.allocators.split(",")
    for alloc in allocs:
        L += [f"### {alloc}", "",
              "| impl | dtype | median ms (min) | tokens/s | GFLOP/s | % roofline | peak RSS MB (Δ) | ours_grouped / this |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
        for dt in args.dtypes.split(","):
            ours = results.get((alloc, "ours_grouped", dt), {})
            for impl in args.impls.split(","):
                r = results[(alloc, impl, dt)]
                if "error" in r:
                    L.append(f"| {LABELS[impl]} | {dt} | error: {r['error'].strip().splitlines()[-1][:120]} "
                             "| | | | | |")
                    continue
                ratio = f"{r['median_s'] / ours['median_s']:.2f}x" if "median_s" in ours else "n/a"
                L.append(f"| {LABELS[impl]} | {dt} | {r['median_s']*1e3:.1f} ({r['min_s']*1e3:.1f}) | {r['tok_s']:.0f} "
                         f"| {r['gflops']:.1f} | {100*r['roof_frac']:.1f}% | {r['peak_rss_mb']:.0f} "
                         f"(+{r['peak_rss_mb']-r['rss_before_mb']:.0f}) | {ratio} |")
        L.append("")
    L += ["\"ours_grouped / this\" is the speed of ours relative to that row (time of that row / time of ours; "
          ">1 means ours is faster).", "", "## Targets", ""]
    for alloc in allocs:
        for dt, tgt_ds, tgt_roof in (("bf16", 1.3, 0.65), ("fp32", 1.1, None)):
            o, ds, hf = (results.get((alloc, k, dt), {}) for k in ("ours_grouped", "deepspeed", "hf_grouped_mm"))
            if "median_s" not in o:
                continue
            line = f"- {alloc}, {dt}:"
            if "median_s" in ds:
                sp = ds["median_s"] / o["median_s"]
                line += f" ours/DeepSpeed = {sp:.2f}x (target {tgt_ds}x: {'met' if sp >= tgt_ds else 'MISSED'})"
                line += (f"; peak RSS ours/DeepSpeed {o['peak_rss_mb']:.0f}/{ds['peak_rss_mb']:.0f} MB "
                         f"({'met' if o['peak_rss_mb'] <= ds['peak_rss_mb'] else 'MISSED'})")
            if "median_s" in hf:
                line += f"; ours/transformers(grouped_mm) = {hf['median_s'] / o['median_s']:.2f}x"
            if tgt_roof is not None:
                line += (f"; {100*o['roof_frac']:.1f}% of roofline (target {100*tgt_roof:.0f}%: "
                         f"{'met' if o['roof_frac'] >= tgt_roof else 'MISSED'}; "
                         f"{100*o['roof_frac_best']:.1f}% against the best round's roofline)")
            L.append(line + ".")
    L += ["", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    main()

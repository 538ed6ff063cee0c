"""Start-up memory, checkpoint write/read and export memory per rank, against world size.

    python -m moe_trainer.bench.scale [--ep 2,4,8] [--scale 1,4] [--code DIR] [--out runs/bench_scale]

For each EP degree (world = ep, one rank per EP index) and expert scale (n_routed_experts x
scale), N ranks build this checkout's trainer (or the one under --code, e.g. an older
commit's tree from `git archive`), and each reports its peak RSS after construction, the time
and bytes of its checkpoint write, the time of the read, and its peak RSS at the end. Then
`tools/convert_hf.py export` of that checkpoint runs with a small shard limit and its peak
RSS is measured. The model's routed experts dominate its size. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .turns import free_port

ROOT = Path(__file__).resolve().parents[2]

MODEL = ["model.hidden_size=256", "model.num_hidden_layers=3", "model.num_attention_heads=2",
         "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16",
         "model.v_head_dim=16", "model.intermediate_size=256", "model.num_experts_per_tok=2",
         "model.n_group=1", "model.topk_group=1", "model.moe_intermediate_size=512", "train.seq_len=32",
         "train.micro_batch_size=1", "train.eval_every=0", "train.checkpoint_every=0", "train.resume=none",
         "metrics.peak_tflops=1.0", "parallel.cpu_alltoall=gloo"]

# runs in each rank against whichever moe_trainer is first on PYTHONPATH (this one, or --code's)
WORKER = r"""
import json, os, resource, sys, time
from pathlib import Path
from moe_trainer import checkpoint
from moe_trainer.config import validate_layout
from moe_trainer.resolve import load_config
from moe_trainer.train import make_trainer
args = json.loads(sys.argv[1])
cfg = load_config(args["config"], args["overrides"])
layout = validate_layout(cfg, int(os.environ["WORLD_SIZE"]))
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
t0 = time.perf_counter(); trainer = make_trainer(cfg, layout); build_s = time.perf_counter() - t0
built = rss()
trainer.prepare_run_dir(); trainer.step = 1
trainer.barrier(); t0, c0 = time.perf_counter(), time.process_time(); checkpoint.save(trainer)
save_cpu_s = time.process_time() - c0; trainer.barrier(); save_s = time.perf_counter() - t0; saved = rss()
ckpt = Path(cfg.run.out_dir) / "checkpoints" / "step_1"
mine = sorted(ckpt.glob(f"part-r{trainer.mesh.rank:05d}*")) or sorted(ckpt.glob(f"*pp{trainer.mesh.coord['pp']}*"))
part = sum(f.stat().st_size for f in mine) if (mine and (trainer.mesh.rank == 0 or "part-r" in mine[0].name)) else 0
trainer.barrier(); t0 = time.perf_counter(); checkpoint.load(ckpt, trainer); trainer.barrier(); load_s = time.perf_counter() - t0
out = {"rank": trainer.mesh.rank, "build_s": build_s, "rss_built_mib": built, "save_s": save_s, "load_s": load_s,
       "save_cpu_s": save_cpu_s, "rss_saved_mib": saved,
       "part_bytes": part, "rss_peak_mib": rss()}
(Path(cfg.run.out_dir) / f"rank{trainer.mesh.rank}.json").write_text(json.dumps(out))
"""


def run(world: int, overrides: list[str], out: Path, code: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    args = json.dumps({"config": str(ROOT / "configs" / "moe_tiny.yaml"),
                       "overrides": overrides + [f"run.out_dir={out}"]})
    port, procs = free_port(), []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(code), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, args], cwd=code, env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(out / f"rank{r}.err", "w")))
    for p in procs:
        p.wait(timeout=1800)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)
            if (out / f"rank{r}.json").is_file()]


def export_peak(ckpt: Path, out: Path, code: Path) -> tuple[float, float]:
    """(peak RSS MiB, seconds) of tools/convert_hf.py export with 64 MB shards (where the tool takes a
    shard size), measured in a wrapper process whose only child is the export."""
    cmd = [sys.executable, str(code / "tools" / "convert_hf.py"), "export", "--weights", str(ckpt), str(out),
           "--overwrite"]
    env = dict(os.environ, PYTHONPATH=str(code))
    help_text = subprocess.run(cmd[:3] + ["--help"], capture_output=True, text=True, cwd=code, env=env).stdout
    if "--max-shard-gb" in help_text:
        cmd += ["--max-shard-gb", "0.064"]
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               "r = subprocess.run(sys.argv[1:], capture_output=True).returncode; "
               "print(r, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, time.perf_counter() - t)")
    proc = subprocess.run([sys.executable, "-c", wrapper] + cmd, capture_output=True, text=True, cwd=code, env=env)
    rc, peak, secs = proc.stdout.split()
    return (float(peak), float(secs)) if rc == "0" else (float("nan"), float("nan"))


def _most(ranks: list[dict], key: str, fmt: str) -> str:
    """The ranks' largest `key`, or "-" where the code measured (an older tree's worker) lacks it."""
    values = [r[key] for r in ranks if key in r]
    return format(max(values), fmt) if values else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", default="2,4,8", help="EP degrees (world = ep); default %(default)s")
    ap.add_argument("--scale", default="1,4", help="n_routed_experts = 16 x scale x ...; default %(default)s")
    ap.add_argument("--experts", type=int, default=32, help="routed experts at scale 1 (default %(default)s)")
    ap.add_argument("--code", default=str(ROOT), help="the checkout whose trainer runs (default: this one)")
    ap.add_argument("--label", default="", help="label of this code in the table")
    ap.add_argument("--out", default="runs/bench_scale")
    ap.add_argument("--export", action="store_true", help="also measure export's peak RSS")
    a = ap.parse_args(argv)
    code, out = Path(a.code).resolve(), Path(a.out).resolve()
    print("| code | ep = world | routed experts | expert fp32 MB (all) | peak RSS per rank after build MiB (max) | "
          "after write | end | ckpt write s (max) | write CPU s per rank (max) | ckpt read s (max) | "
          "bytes written per rank (max) |" + (" export peak RSS MiB |" if a.export else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if a.export else ""))
    for ep in [int(x) for x in a.ep.split(",")]:
        for scale in [int(x) for x in a.scale.split(",")]:
            e = a.experts * scale
            over = MODEL + [f"model.n_routed_experts={e}", f"parallel.ep={ep}", f"train.global_batch_size={ep}"]
            run_dir = out / f"{a.label or code.name}_ep{ep}_x{scale}"
            ranks = run(ep, over, run_dir, code)
            if len(ranks) < ep:
                print(f"| {a.label} | {ep} | {e} | failed: see {run_dir}/rank*.err |")
                continue
            expert_mb = 2 * e * 3 * 256 * 512 * 4 / 1e6  # 2 MoE layers x E x (3 x d x H) fp32
            row = (f"| {a.label or code.name} | {ep} | {e} | {expert_mb:.0f} | "
                   f"{max(r['rss_built_mib'] for r in ranks):.0f} | {_most(ranks, 'rss_saved_mib', '.0f')} | "
                   f"{max(r['rss_peak_mib'] for r in ranks):.0f} | {max(r['save_s'] for r in ranks):.2f} | "
                   f"{_most(ranks, 'save_cpu_s', '.2f')} | {max(r['load_s'] for r in ranks):.2f} | "
                   f"{max(r['part_bytes'] for r in ranks) / 1e6:.1f} MB |")
            if a.export:
                peak, secs = export_peak(run_dir / "checkpoints" / "step_1", run_dir / "hf", code)
                row += f" {peak:.0f} ({secs:.1f} s) |"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The expert all-to-alls hidden by parallel.overlap=a2a: step time off vs on at ep 2, with the
emulated link (debug.link_gbps) set so that a step's all-to-all time is a given ratio of its compute.

    python -m moe_trainer.bench.overlap [--ratios 0.5,1,2] [--steps 6] [--warmup 2] [--rounds 3] [--json PATH] [--pp P --v V]

Calibration: one blocking run without a link measures the step's forward + backward compute
(time.compute_s) and the bytes its all-to-alls move (the larger of sent and received per kind, as the
link counts them); for ratio r the link's bandwidth makes those bytes take r x that compute. Then per
round, per setting (no link, then each ratio), the blocking run and the overlapped run, one after
the other (A B A B ...), each a fresh 2-rank launch of the real trainer; figures are medians over
the timed steps of each run, ratios per round, reported as the median over rounds and [min, max].
  speedup = step time off / on
  hidden  = 1 - exposed wait on / exposed wait off (time.exposed_all_to_all_s: the time a rank waited
            for its all-to-alls; blocking, that is their whole time)
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/moe_tiny.yaml"
# micro-batches of 1, 16 per step per rank: 15 overlapped pairs (the first forward and the last backward run
# alone, so at most 15/16 of the all-to-all time can hide; at pp 2 x v 2, of 32 chunk forwards a rank,
# the interleaved warm-up and cool-down leave 27 in pairs on the first rank, 29 on the last)
BASE = ["parallel.ep=2", "train.micro_batch_size=1", "train.global_batch_size=32", "train.eval_every=0",
        "train.checkpoint_every=0", "train.resume=none", "train.log_every=1", "metrics.peak_tflops=1.0",
        "metrics.tensorboard=false", "metrics.noise_scale=false"]
A2A = ("dispatch", "combine")


def run(out: Path, steps: int, overrides: list[str], pp: int = 1, v: int = 1) -> list[dict]:
    """One training run, ep 2 on each of `pp` pipeline stages (2 pp ranks) of `v` chunks each; its
    per-step metrics records (rank 0's: the first stage's at pp > 1)."""
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(2 * pp))}).encode()).decode()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"--config={CONFIG}"] + [a for o in BASE + overrides + [f"parallel.pp={pp}", f"parallel.virtual_stages={v}",
                                                                     f"train.max_steps={steps}",
                                                                     f"run.out_dir={out}"] for a in ("--set", o)]
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
           "--master_addr=127.0.0.1", f"--master_port={port}", "--module", "moe_trainer.train", *args]
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if "step_time_s" in r]


def figures(rows: list[dict], warmup: int) -> dict:
    timed = rows[warmup:]
    med = {k: statistics.median(r[k] for r in timed)
           for k in ("step_time_s", "time.compute_s", "time.all_to_all_s", "time.exposed_all_to_all_s")}
    kinds = {k[len("comm."):-len("_sent_bytes")] for r in timed for k in r
             if k.startswith("comm.") and k.endswith("_sent_bytes") and k[len("comm."):].startswith(A2A)}
    med["a2a_bytes"] = statistics.median(sum(max(r.get(f"comm.{k}_sent_bytes", 0), r.get(f"comm.{k}_received_bytes", 0))
                                             for k in kinds) for r in timed)
    return med


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", default="0.5,1,2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B, each with ep 2: 2 pp ranks a run)")
    ap.add_argument("--v", type=int, default=1, help="chunks per pipeline rank (parallel.virtual_stages; "
                                                     "overlap at pp > 1 needs v >= 2)")
    a = ap.parse_args(argv)
    total = a.steps + a.warmup
    tmp = Path(tempfile.mkdtemp(prefix="bench_overlap_"))
    cal = figures(run(tmp / "calibrate", total, [], a.pp, a.v), a.warmup)
    print(f"calibration (blocking, no link): step {cal['step_time_s']:.3f} s, compute {cal['time.compute_s']:.3f} s, "
          f"all-to-all {cal['time.all_to_all_s']:.3f} s, {cal['a2a_bytes'] / 1e6:.2f} MB a step", flush=True)
    settings = {"no link": []}
    for r in (float(x) for x in a.ratios.split(",")):
        gbps = cal["a2a_bytes"] * 8 / (r * cal["time.compute_s"]) / 1e9
        settings[f"a2a = {r:g} x compute"] = [f"debug.link_gbps={gbps:.6f}"]
    results = {name: {"off": [], "on": []} for name in settings}
    for rnd in range(a.rounds):
        for name, link in settings.items():
            for mode, overlap in (("off", "none"), ("on", "a2a")):
                f = figures(run(tmp / f"{rnd}_{len(results[name][mode])}_{mode}_{name.replace(' ', '_')}", total,
                                link + [f"parallel.overlap={overlap}"], a.pp, a.v), a.warmup)
                results[name][mode].append(f)
                print(f"round {rnd + 1} {name:>18} {mode:>3}: step {f['step_time_s']:.3f} s, exposed all-to-all "
                      f"{f['time.exposed_all_to_all_s']:.3f} s of {f['time.all_to_all_s']:.3f} s", flush=True)
    print("\n| setting | step off (s) | step on (s) | speedup off/on | all-to-all hidden | exposed on (s) |\n"
          "|---|---|---|---|---|---|")
    summary = {}
    for name, res in results.items():
        off, on = res["off"], res["on"]
        speed = [x["step_time_s"] / y["step_time_s"] for x, y in zip(off, on)]
        hidden = [1 - y["time.exposed_all_to_all_s"] / x["time.exposed_all_to_all_s"] for x, y in zip(off, on)]
        summary[name] = {"speedup": speed, "hidden": hidden, "off": off, "on": on}
        print(f"| {name} | {spread([x['step_time_s'] for x in off])} | {spread([y['step_time_s'] for y in on])} | "
              f"{spread(speed)} | {spread(hidden)} | {spread([y['time.exposed_all_to_all_s'] for y in on])} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"calibration": cal, "settings": settings, "results": summary}, indent=1))


if __name__ == "__main__":
    main()

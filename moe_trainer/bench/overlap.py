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

    python -m moe_trainer.bench.overlap --predict docs/bench/overlap_2026-12-06.json [--pp 2 --v 2]

--predict runs nothing of the trainer: it sets the step model's hidden fraction (plan/time.py
stage_a2a_exposure, what `tools/plan.py --time --overlap` uses) beside the measured ones of a saved
--json, for each linked setting: the same shapes (moe_tiny, micro-batches of 1, 16 per step, ep 2; pp
and v from the file, else the flags), the link the run calibrated (its bandwidth and latency), on the
CPU model of this machine (bench.plan_time.cpu_model: the rates measured now, one thread per rank).
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
from typing import Optional

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


def _link(overrides: list[str]) -> tuple[float, float]:
    """(gbps, latency_us) of a setting's overrides."""
    kv = dict(o.split("=", 1) for o in overrides)
    return float(kv.get("debug.link_gbps", 0)), float(kv.get("debug.link_latency_us", 0))


def model_setup(pp: int, v: int):
    """The bench's runs as the planner's Setup and config (2 ep ranks on each of pp stages, one node)."""
    from ..plan.work import setup_from_config
    from ..resolve import load_config
    sets = BASE + [f"parallel.pp={pp}", f"parallel.virtual_stages={v}", "train.dtype=fp32"]
    cfg = load_config(str(ROOT / CONFIG), sets)
    return setup_from_config(cfg, 2 * pp, gpus_per_node=2 * pp), cfg


def predicted_hidden(s, cpu, eff, gbps: float, latency_us: float, stage: int = 0) -> dict:
    """The step model's all-to-all terms for the bench's setup `s` on rank `stage` with the link at `gbps`
    and `latency_us` (the links between the CPU ranks replaced by it), off and on, and the hidden share."""
    import dataclasses
    from ..plan.time import Mechanisms, stage_a2a_exposure
    link = dataclasses.replace(cpu, nvlink_gbs=gbps / 8, net_gbs=gbps / 8)
    eff = dataclasses.replace(eff, a2a=1.0, a2a_latency_us=latency_us)
    off = stage_a2a_exposure(s, stage, link, eff, Mechanisms(host="inline"), 1.0)
    on = stage_a2a_exposure(s, stage, link, eff, Mechanisms(host="inline", a2a_overlap=True, wgrad_split=True), 1.0)
    return {"off": off, "on": on, "hidden": 1 - on["exposed"] / off["exposed"]}


def executor_timeline(fwd: list[float], bwd: list[float], transfer: float, bwd_after: Optional[list[float]] = None) -> float:
    """The wait of one overlapped pair as overlap.StagedPair._run orders it, on one rank's clock: the
    forward's stage k (seconds fwd[k]) and the backward's stages (bwd[k], run from the last) take turns;
    each stage but the last issues an all-to-all of `transfer` seconds that the next stage of the same
    micro-batch waits for. Transfers in flight at once do not slow each other (the emulated link holds
    each to its own deadline; one shared link or NCCL's one stream would serialise them), so a rank
    waiting for one lets the other's run: what the slot model (plan/time.py) does not credit.
    bwd_after[k]: the seconds of backward stage k that run after its transfer is issued (the weight
    gradients held back, kernels/wgrad.py), part of bwd[k]."""
    clock, waited = [0.0], [0.0]

    def run(stages, after):
        done = None
        for k, (sec, post) in enumerate(zip(stages, after)):
            if done is not None:
                waited[0] += max(0.0, done - clock[0])
                clock[0] = max(clock[0], done)
            clock[0] += sec
            done = clock[0] - post + transfer if k < len(stages) - 1 else None
            yield

    from ..parallel.overlap import StagedPair
    # the executor's own turn-taking: the forward first
    StagedPair._run(run(fwd, [0.0] * len(fwd)), run(bwd[::-1], (bwd_after or [0.0] * len(bwd))[::-1]))
    return waited[0]


def timeline_hidden(s, cpu, eff, exposure_off: dict) -> float:
    """The hidden fraction executor_timeline gives for rank 0 of the bench's setup `s` at pp 1: a forward
    of stages (attention side: first MoE block's A with the rest of the micro-batch's compute outside the
    MoE blocks, i.e. the embedding, dense layers and head; then per MoE block B, C + the next A, ..., the
    last C), backward stages twice the forward's, per-block compute and host time from the step model,
    its transfers the blocking run's (`exposure_off`) over the 4 a block makes per micro-batch, the expert
    stages' backward weight gradients after their transfer (held back); micro-batch 0's forward and the
    last backward wait for each of their transfers whole."""
    from ..plan.time import Mechanisms, _moe_block, host_seconds, _moe_launch, stage_compute
    mech = Mechanisms(host="inline", wgrad_split=True)
    n, dev, share, _, held = _moe_block(s, 0, cpu, eff, mech, 1.0)
    host = host_seconds(s, 0, eff, mech)
    block = dev + _moe_launch(host)
    whole = sum(stage_compute(s, 0, cpu, eff, mech, 1.0).values()) + sum(k * t for k, t in host["blocks"].values())
    attn, mlp = block * share / 3, block * (1 - share) / 3  # forward thirds
    fwd = [attn + (whole - n * block) / 3] + [mlp, attn] * (n - 1) + [mlp, attn]
    m = s.micro_batches
    transfer = exposure_off["transfers"] / m / (4 * n)
    held *= block / dev  # with its host time, as the block's
    pair = executor_timeline(fwd, [2 * x for x in fwd], transfer, [0.0] + [held, 0.0] * n)
    alone = 4 * n * transfer  # micro-batch 0's forward and the last backward: 2n transfers each
    on = (m - 1) * pair + alone + exposure_off["split"]
    return 1 - on / exposure_off["exposed"]


def predict_rows(saved: dict, pp: int, v: int, rates: dict) -> list[dict]:
    """For every linked setting of a saved --json (`saved`), the model's hidden fraction on the CPU model
    of `rates` (bench.plan_time's), twice: with the file's link (its bandwidth and latency), and with the
    link set as the bench sets it but on the model's own figures (the model's bytes take the setting's
    ratio x the model's compute), which leaves out the compute model's error; and the measured ones."""
    from ..plan.time import Mechanisms, step_time
    from .plan_time import cpu_from_rates
    pp, v = saved.get("pp", pp), saved.get("v", v)
    s, _ = model_setup(pp, v)
    cpu, eff = cpu_from_rates(rates, 2 * pp)
    blocking = step_time(s, cpu, eff, Mechanisms(host="inline"), 1.0)
    compute = blocking.compute + blocking.host_wait  # a CPU rank's host time is its compute time too
    cal = saved["calibration"]
    rows = []
    for name, overrides in saved["settings"].items():
        gbps, lat = _link(overrides)
        if not gbps and not lat:
            continue
        ratio = cal["a2a_bytes"] * 8 / (gbps * 1e9) / cal["time.compute_s"] if gbps else 0.0
        own = predicted_hidden(s, cpu, eff, gbps, lat)
        model_bytes = own["off"]["transfers"] * gbps * 1e9 / 8  # at no latency: bytes over the link's rate
        at_ratio = predicted_hidden(s, cpu, eff, model_bytes * 8 / (ratio * compute) / 1e9, lat) if ratio else own
        timeline = timeline_hidden(s, cpu, eff, at_ratio["off"]) if pp == 1 else None
        rows.append({"setting": name, "ratio": ratio, "file_link": own, "at_ratio": at_ratio, "timeline": timeline,
                     "model_ratio": own["off"]["transfers"] / compute, "compute": compute,
                     "measured": saved["results"][name]["hidden"]})
    return rows


def predict_table(path: str, pp: int, v: int, measure: bool) -> list[dict]:
    """predict_rows on the rates measured now (measure) or the documented 2-rank ones, printed."""
    from .plan_time import RATES_2026_12_06, cpu_model
    saved = json.loads(Path(path).read_text())
    rates = RATES_2026_12_06
    if measure:  # the rates at the bench's shapes on one rank's model (the parallel layout at its defaults)
        from ..resolve import load_config
        one = load_config(str(ROOT / CONFIG), [o for o in BASE if not o.startswith("parallel.")] + ["train.dtype=fp32"])
        rates = cpu_model(one, 2 * saved.get("pp", pp), 1)[2]
    rows = predict_rows(saved, pp, v, rates)
    print(f"CPU model: matmul {rates['matmul_tflops']:.3f} TFLOP/s, copy {rates['copy_gbs']:.1f} GB/s, host "
          f"{rates['host_us_per_kernel']:.1f} us per kernel, {', '.join(f'{k} {x:.2f}' for k, x in rates['efficiency'].items())}"
          f"; predicted compute {rows[0]['compute']:.2f} s a step (measured {saved['calibration']['time.compute_s']:.2f})"
          if rows else "no linked setting in the file")
    print("\n| setting | predicted hidden (bench's ratio) | exposed on: paired / unpaired / split (s) | predicted "
          "hidden (file's link; model's a2a / compute) | executor timeline, concurrent transfers | measured hidden |"
          "\n|---|---|---|---|---|---|")
    for r in rows:
        on = r["at_ratio"]["on"]
        line = "-" if r["timeline"] is None else f"{r['timeline']:.2f}"
        print(f"| {r['setting']} | {r['at_ratio']['hidden']:.2f} | {on['paired']:.2f} / {on['unpaired']:.2f} / "
              f"{on['split']:.3f} | {r['file_link']['hidden']:.2f} ({r['model_ratio']:.2f}) | {line} | "
              f"{spread(r['measured'])} |")
    return rows


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", default="0.5,1,2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--predict", default=None, metavar="JSON",
                    help="run nothing: the planner's hidden fraction beside a saved --json's measured ones")
    ap.add_argument("--measure-rates", action="store_true",
                    help="with --predict: measure this machine's rates now (bench.plan_time.cpu_model, minutes "
                         "under load) instead of the 2026-12-06 2-rank figures")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B, each with ep 2: 2 pp ranks a run)")
    ap.add_argument("--v", type=int, default=1, help="chunks per pipeline rank (parallel.virtual_stages; "
                                                     "overlap at pp > 1 needs v >= 2)")
    a = ap.parse_args(argv)
    if a.predict:
        predict_table(a.predict, a.pp, a.v, a.measure_rates)
        return
    total = a.steps + a.warmup
    tmp = Path(tempfile.mkdtemp(prefix="bench_overlap_"))
    cal = figures(run(tmp / "calibrate", total, ["parallel.overlap=none"], a.pp, a.v), a.warmup)
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
        Path(a.json).write_text(json.dumps({"pp": a.pp, "v": a.v, "calibration": cal, "settings": settings, "results": summary}, indent=1))


if __name__ == "__main__":
    main()

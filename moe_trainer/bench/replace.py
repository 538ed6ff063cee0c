"""Online expert re-placement (parallel.replace_every) under skewed routing: step time with it on and off.

    python -m moe_trainer.bench.replace [--rounds 3] [--steps 24] [--every 8] [--skew 0.3] [--world 2]
                                        [--redundant R] [--topk K] [--set KEY=VALUE ...] [--predict]
                                        [--out FILE.json]

moe_tiny (16 routed experts, top-4 of 4 groups, 3 MoE layers) at ep = world (2 CPU ranks by default),
fp32, its balancing biases skewed on purpose (debug.route_skew, expert 0 favoured most, bias updates
off), so at home EP rank 0's experts take most of the routed rows. Each round trains the same run
twice, off (replace_every=0) then on (replace_every=--every, policy auto), one after the other (A B A
B ...), so a slow spell of the shared machine costs both about the same. Per run: the median step time
of the steps after the first re-placement decision (steps > every + 1: both runs timed on the same
steps), the mean measured share of the busiest EP rank (expert.rank_max_over_mean) over those steps,
and for `on` every `event: replace` row (decision, bytes moved, wall time). Printed: per round the
off/on step-time ratio, and their median with min-max; the bytes and wall time of a re-placement and
its wall time amortised over `every` steps as a share of the `on` step time. With --redundant R a
third run per round, `copies` (on, plus R redundant slots a rank: parallel.redundant_slots), follows
`on`, and its off/copies ratio, busiest share and the copies' per-step traffic (refresh and gradients,
comm.expert_copies*) are printed too. --topk K routes each token to K experts (model.num_experts_per_tok;
the config's 4 groups, 2 of them chosen, supply up to 8): with K = 1 and a strong skew one expert takes more
than an EP rank's fair share, which no permutation of the owned slots can balance and a copy can. Per
configuration the busiest rank's share the search predicted (`event: replace`'s
predicted_rank_max_over_mean_after, of the decisions applied) is printed beside the measured one.
--predict sets the step model against the runs (`predict`): this machine's rates measured after them
(bench.plan_time's, one thread a rank), the first `off` run's expert load replayed by the planner at
each configuration (plan/replacement.py), each run's predicted step beside its measured median and the
predicted off/on and off/copies beside the measured ones.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .turns import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/moe_tiny.yaml"


def _model_sets(topk: int, extra: tuple) -> list[str]:
    """The overrides that shape the model (the same in every run and in the prediction)."""
    return list(extra) + ([f"model.num_experts_per_tok={topk}"] if topk else []) + ["train.dtype=fp32"]


def run(world: int, out: Path, steps: int, every: int, skew: float, redundant: int = 0, topk: int = 0,
        extra: tuple = ()) -> list[dict]:
    sets = _model_sets(topk, extra)
    sets += [f"parallel.redundant_slots={redundant}", f"train.max_steps={steps}", "train.eval_every=0", "train.checkpoint_every=0", "train.resume=none",
            "train.log_every=1", f"parallel.ep={world}", f"debug.route_skew={skew}",
            "model.bias_update_speed=0", f"parallel.replace_every={every}", f"run.out_dir={out}",
            "metrics.peak_tflops=1.0"]
    args = [f"--config={CONFIG}"] + [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc-per-node={world}", f"--master-port={free_port()}",
           "-m", "moe_trainer.train", *args] if world > 1 else [sys.executable, "-m", "moe_trainer.train", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"run {out} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def predict(world: int, load_dir: Path, every: int, redundant: int, topk: int, extra: tuple) -> dict:
    """The step model's step for off, on and copies (plan/time.py on this machine's rates, measured as
    bench.plan_time measures them at one thread a rank, as the runs have), each at the busiest EP rank's
    share the planner replays from the `off` run's expert load (plan/replacement.py), with the moves'
    and copies' traffic it charges."""
    from ..plan import replacement
    from ..plan.time import Mechanisms, step_time
    from ..plan.work import setup_from_config
    from ..resolve import load_config
    from .plan_time import cpu_model
    sets = _model_sets(topk, extra)
    base = load_config(str(ROOT / CONFIG), sets)
    cpu, eff, rates = cpu_model(base, world, 1)
    load = replacement.read_load(str(load_dir))
    out = {"rates": rates, "experts": _experts_cost(base.model, base.train, load, world)}
    for name, ev, r in (("off", 0, 0), ("on", every, 0), ("copies", every, redundant)):
        if name == "copies" and not redundant:
            continue
        cfg = load_config(str(ROOT / CONFIG), sets + [f"parallel.ep={world}", f"parallel.replace_every={ev}",
                                                      f"parallel.redundant_slots={r}"])
        s, mech = setup_from_config(cfg, world, gpus_per_node=world), Mechanisms(host="inline")
        share, rep, _ = replacement.at_layout(load, world, ev, r, replacement.paying(s, cpu, eff, mech))
        t = step_time(s, cpu, eff, mech, share, rep)
        out[name] = {"step_s": t.step, "share": share, "moves_s": t.totals["replacement.moves"],
                     "copies_s": t.totals["replacement.copies"]}
    return out


def _experts_cost(m, t, load, world: int) -> dict:
    """What the busiest rank's share costs the experts module on this machine: its forward + backward on a
    rank's mean routed rows of a micro-batch spread evenly over the rank's experts, and on the busiest
    home rank's rows as the load's first file routes them to its experts (first MoE layer); the step
    model charges the share itself."""
    from .plan_time import experts_seconds
    local = m.n_routed_experts // world
    rows = t.micro_batch_size * t.seq_len * m.num_experts_per_tok  # a rank's routed rows per micro-batch
    counts = load.records[0][1][0].view(world, local)  # (ep, local experts), at home
    busiest = counts[counts.sum(1).argmax()]
    as_routed = [round(float(c)) for c in busiest / counts.sum() * rows * world]
    even = [rows // local] * local
    even[-1] += rows - sum(even)
    return {"even_s": experts_seconds(m, even), "busiest_s": experts_seconds(m, as_routed),
            "share": sum(as_routed) / rows}


def _prediction_lines(pred: dict, results: list[dict], every: int) -> list[str]:
    """Predicted against measured: each run's step without the moves (the median leaves the steps that move
    out), the moves amortised, and the ratios off/on and off/copies."""
    names = [n for n in ("off", "on", "copies") if n in pred]
    measured = {n: statistics.median(r[n]["step_s"] for r in results) for n in names}
    lines = []
    for n in names:
        p = pred[n]
        lines.append(f"  {n}: busiest rank {p['share']:.2f}x mean; step {(p['step_s'] - p['moves_s']) * 1e3:.0f} ms "
                     f"(copies' traffic {p['copies_s'] * 1e3:.1f}) against {measured[n] * 1e3:.0f} ms measured: "
                     f"predicted / measured {(p['step_s'] - p['moves_s']) / measured[n]:.2f}; the moves amortised "
                     f"over {every} steps {p['moves_s'] * 1e3:.2f} ms")
    x = pred["experts"]
    lines.append(f"  the experts' forward + backward here: {x['even_s'] * 1e3:.1f} ms on a rank's mean rows spread "
                 f"evenly, {x['busiest_s'] * 1e3:.1f} ms on the busiest rank's ({x['share']:.2f}x as many, as routed): "
                 f"{x['busiest_s'] / x['even_s']:.2f}x, where the model charges {x['share']:.2f}x")
    for n in names[1:]:
        got = [r["off"]["step_s"] / r[n]["step_s"] for r in results]
        lines.append(f"  off/{n}: predicted {pred['off']['step_s'] / pred[n]['step_s']:.3f}, measured median "
                     f"{statistics.median(got):.3f} (min {min(got):.3f}, max {max(got):.3f})")
    return lines


def summary(rows: list[dict], every: int) -> dict:
    timed = [r for r in rows if "loss" in r and r["step"] > every + 1]
    return {"step_s": statistics.median(r["step_time_last_s"] for r in timed),
            "share": statistics.mean(r["expert.rank_max_over_mean"] for r in timed),
            "copies_s": statistics.median(r.get("comm.expert_copies_s", 0.0) + r.get("comm.expert_copies_grad_s", 0.0)
                                          for r in timed),
            "copies_bytes": statistics.median(r.get("comm.expert_copies_sent_bytes", 0) +
                                              r.get("comm.expert_copies_grad_sent_bytes", 0) for r in timed),
            "events": [r for r in rows if r.get("event") == "replace"],
            "predicted": [r["predicted_rank_max_over_mean_after"] for r in rows
                          if r.get("event") == "replace" and r["decision"] == "apply"]}


def _predicted(results: list[dict], key: str) -> str:
    """The busiest rank's shares the search predicted for the re-placements it applied, over the rounds."""
    vals = [v for r in results for v in r[key]["predicted"]]
    return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "none applied"


def _copies_placed(results: list[dict]) -> str:
    """Copies held after each applied decision of the `copies` runs (all layers and ranks), over the rounds."""
    vals = [e["copies"] for r in results for e in r["copies"]["events"] if e["decision"] == "apply"]
    return "/".join(str(v) for v in vals) if vals else "none"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--redundant", type=int, default=0)
    ap.add_argument("--topk", type=int, default=0, help="model.num_experts_per_tok (0: the config's)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="another config override for every run (e.g. model.moe_intermediate_size=512)")
    ap.add_argument("--predict", action="store_true", help="also the step model's prediction of each run, from "
                    "this machine's measured rates and the first off run's expert load")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    results, pred = [], None
    with tempfile.TemporaryDirectory(prefix="bench_replace_") as tmp:
        for i in range(a.rounds):
            off = summary(run(a.world, Path(tmp) / f"off{i}", a.steps, 0, a.skew, topk=a.topk, extra=a.sets), a.every)
            on = summary(run(a.world, Path(tmp) / f"on{i}", a.steps, a.every, a.skew, topk=a.topk, extra=a.sets),
                         a.every)
            results.append({"off": off, "on": on, "ratio": off["step_s"] / on["step_s"]})
            line = (f"round {i + 1}: off {off['step_s'] * 1e3:.0f} ms (busiest rank {off['share']:.2f}x mean), "
                    f"on {on['step_s'] * 1e3:.0f} ms ({on['share']:.2f}x), off/on {results[-1]['ratio']:.3f}")
            if a.redundant:
                copies = summary(run(a.world, Path(tmp) / f"copies{i}", a.steps, a.every, a.skew, a.redundant,
                                     a.topk, a.sets), a.every)
                results[-1].update(copies=copies, copies_ratio=off["step_s"] / copies["step_s"])
                line += (f", copies {copies['step_s'] * 1e3:.0f} ms ({copies['share']:.2f}x), "
                         f"off/copies {results[-1]['copies_ratio']:.3f}")
            print(line, flush=True)
        if a.predict:  # after the runs: the rates are measured on an idle machine
            pred = predict(a.world, Path(tmp) / "off0", a.every, a.redundant, a.topk, tuple(a.sets))
    ratios = [r["ratio"] for r in results]
    applied = [e for r in results for e in r["on"]["events"] if e["decision"] == "apply"]
    kept = [e for r in results for e in r["on"]["events"] if e["decision"] == "keep"]
    on_step = statistics.median(r["on"]["step_s"] for r in results)
    wall = statistics.median(e["wall_s"] for e in applied) if applied else 0.0
    moved = statistics.median(e["moved_bytes"] for e in applied) if applied else 0
    decide = statistics.median(e["wall_s"] for e in kept) if kept else 0.0
    print(f"\nstep time off/on: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
          f"over {len(ratios)} rounds")
    print(f"busiest EP rank / mean: off {statistics.mean(r['off']['share'] for r in results):.2f}, "
          f"on {statistics.mean(r['on']['share'] for r in results):.2f} (predicted {_predicted(results, 'on')})")
    print(f"re-placements applied: {len(applied)} (kept: {len(kept)}); per applied one: {moved / 2 ** 20:.2f} MiB "
          f"moved over all EP ranks, {wall * 1e3:.1f} ms wall; amortised over {a.every} steps "
          f"{100 * wall / (a.every * on_step):.2f}% of the on step time; a decision that keeps: {decide * 1e3:.1f} ms "
          f"({100 * decide / (a.every * on_step):.2f}%)")
    if a.redundant:
        cr = [r["copies_ratio"] for r in results]
        c_step = statistics.median(r["copies"]["step_s"] for r in results)
        c_s = statistics.median(r["copies"]["copies_s"] for r in results)
        c_b = statistics.median(r["copies"]["copies_bytes"] for r in results)
        print(f"with {a.redundant} redundant slot(s) a rank: step time off/copies median {statistics.median(cr):.3f} "
              f"(min {min(cr):.3f}, max {max(cr):.3f}); busiest EP rank / mean "
              f"{statistics.mean(r['copies']['share'] for r in results):.2f} "
              f"(predicted {_predicted(results, 'copies')}); "
              f"copies placed {_copies_placed(results)}; the copies' refresh and gradients "
              f"{c_b / 2 ** 10:.0f} KiB sent a rank a step, {c_s * 1e3:.1f} ms ({100 * c_s / c_step:.2f}% of the step)")
    if pred:
        print("the step model (plan/time.py) on this machine's measured rates, each run at the share the planner "
              "replays from the first off run's load (plan/replacement.py):")
        print("\n".join(_prediction_lines(pred, results, a.every)))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rounds": results, "predicted": pred}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

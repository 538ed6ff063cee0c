"""What the fault handling costs when no fault happens (scripts/bench_faults.sh).

The same training job run alone, in alternating rounds, with the checks off (train.replica_check_every=0,
train.spike_guard=false) and on with the replica check at every step (replica_check_every=1): the
difference of the median step times is one check's cost plus the spike guard's and the straggler
gather's per-step cost; at the default (a check every 100 steps) the overhead is
(guard + gather) + check / 100.

    python -m moe_trainer.bench.faults [--ranks 2] [--steps 12] [--rounds 3] [--config configs/moe_bench.yaml]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .turns import free_port

ROOT = Path(__file__).resolve().parents[2]
OFF = ["train.replica_check_every=0", "train.spike_guard=false"]
EVERY_STEP = ["train.replica_check_every=1", "train.spike_guard=true"]
GUARD_ONLY = ["train.replica_check_every=0", "train.spike_guard=true"]


def _job(config: str, ranks: int, steps: int, sets: list[str], out: Path) -> list[float]:
    """The step times of one job's steps after the first two (compile, allocator warm-up)."""
    args = ["--config", config] + [a for o in sets + [f"train.max_steps={steps}", "train.log_every=1",
                                                      "train.eval_every=0", "train.checkpoint_every=0",
                                                      "train.resume=none", f"run.out_dir={out}"]
                                   for a in ("--set", o)]
    if ranks == 1:
        cmd = [sys.executable, "-m", "moe_trainer.train", *args]
    else:
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
               str(free_port()), "--module", "moe_trainer.train", *args]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/moe_bench.yaml")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {"off": [], "guard": [], "every_step": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # alternating, each job alone
            for name, sets in (("off", OFF), ("guard", GUARD_ONLY), ("every_step", EVERY_STEP)):
                step = statistics.median(_job(args.config, args.ranks, args.steps, sets, Path(tmp) / f"{name}{r}"))
                times[name].append(step)
                print(f"round {r + 1}: {name}: median step {step * 1e3:.1f} ms", flush=True)
    off, guard, every = (statistics.median(times[k]) for k in ("off", "guard", "every_step"))
    check = every - guard
    default = (guard - off) + check / 100
    spread = (min(times["off"]), max(times["off"]))
    print(f"\n{args.config} on {args.ranks} rank(s), {args.rounds} alternating rounds of {args.steps} steps:")
    print(f"  checks off:                 {off * 1e3:.1f} ms per step (rounds {spread[0] * 1e3:.1f}-"
          f"{spread[1] * 1e3:.1f})")
    print(f"  spike guard + straggler:    {(guard - off) * 1e3:+.2f} ms per step ({100 * (guard - off) / off:+.2f}%)")
    print(f"  one replica check:          {check * 1e3:+.2f} ms ({100 * check / off:+.2f}% of a step)")
    print(f"  at the defaults (check every 100 steps): {100 * default / off:+.2f}% of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

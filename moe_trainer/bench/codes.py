"""The same training jobs on two code trees: did a change make the trainer slower on CPU ranks?

    python -m moe_trainer.bench.codes --code before=/tmp/old --code after=. [--jobs e2e,ep2]
                                      [--steps 10] [--warmup 3] [--rounds 3] [--json PATH]
                                      [--code-set after=parallel.overlap=a2a ...]

Each job is the real command line (`deepspeed --num_gpus N --module moe_trainer.train`) run with
one tree's package first on PYTHONPATH and that tree as working directory, so everything between
the launcher and metrics.jsonl is the tree's own code. The steps' `step_time_s` come from the
run's metrics.jsonl (every step logged). Jobs run alone, in rounds that alternate which tree goes
first (headline.py's rule), after one short unmeasured run per tree that builds its C++ kernels
and data cache. Per job: each tree's median step over the rounds' medians, its spread, and the
after/before speed ratio with the spread that pairs the extremes.

`--code-set NAME=KEY=VALUE` (repeatable) adds `--set KEY=VALUE` to that tree's measured jobs only
(not its warm-up run), for a setting only one tree knows: the after tree with a new option on while
the before tree, which would refuse the key, runs its default.

Jobs (the settings every tree understands, pinned so both train the same thing):
  e2e   configs/moe_bench.yaml, 1 rank with all the cores, fp32 (bench_train's "ours1")
  ep2   configs/moe_tiny.yaml, 2 ranks, ep 2, one core each, fp32, bench_ep's batch (2 micro-batches
        of 2 a step per rank)
  ep2_gas4  ep2 with a global batch of 16: 4 micro-batches a step per rank (3 overlapped pairs
        under parallel.overlap=a2a, where ep2 has 1)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .headline import over_rounds, ratio, round_summary
from .turns import free_port, worker_env

COMMON = ["train.dtype=fp32", "train.eval_every=0", "train.checkpoint_every=0", "train.resume=none",
          "train.log_every=1", "metrics.peak_tflops=1.0", "metrics.tensorboard=false"]
JOBS = {
    "e2e": {"config": "configs/moe_bench.yaml", "ranks": 1, "sets": []},
    "ep2": {"config": "configs/moe_tiny.yaml", "ranks": 2,
            "sets": ["model.vocab_size=320", "train.seq_len=256", "train.micro_batch_size=2",
                     "train.global_batch_size=8", "parallel.ep=2", "parallel.dedup_dispatch=false"]},
}
JOBS["ep2_gas4"] = {**JOBS["ep2"], "sets": [s.replace("global_batch_size=8", "global_batch_size=16")
                                            for s in JOBS["ep2"]["sets"]]}


def run_job(tree: Path, job: dict, steps: int, out: Path, threads: int,
            extra: tuple[str, ...] = ()) -> tuple[list[float], float]:
    """One run of `job` on `tree` (plus the `extra` --set overrides): the step times of its metrics.jsonl
    and the tokens of a step. Raises RuntimeError with the log's tail when the run fails."""
    shutil.rmtree(out, ignore_errors=True)
    sets = [*COMMON, *job["sets"], *extra, f"train.max_steps={steps}", f"run.out_dir={out}"]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(job["ranks"]), "--master_port",
           str(free_port()), "--module", "moe_trainer.train", "--config", job["config"],
           *[a for s in sets for a in ("--set", s)]]
    env = worker_env(max(1, threads // job["ranks"]), tree)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    timed = [r for r in records if "step_time_s" in r]
    if proc.returncode != 0 or len(timed) < steps:
        raise RuntimeError(f"{tree} failed (exit {proc.returncode}, {len(timed)} of {steps} steps):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return [r["step_time_s"] for r in timed], timed[-1]["tokens_per_s"] * timed[-1]["step_time_s"]


def compare(codes: dict[str, Path], jobs: list[str], steps: int, warmup: int, rounds: int, threads: int,
            log=print, code_sets: dict[str, list[str]] | None = None) -> dict:
    """{job: {code: over_rounds(...), "ratio": after over before}} (the first code is the baseline);
    code_sets: a code's extra --set overrides for its measured jobs."""
    names, code_sets = list(codes), code_sets or {}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_codes-") as tmp:
        for name in names:  # build each tree's kernels and data cache, unmeasured
            run_job(codes[name], JOBS["e2e"], 1, Path(tmp) / f"warm_{name}", threads)
        for job_name in jobs:
            job = JOBS[job_name]
            per, tokens = {n: [] for n in names}, 0.0
            for r in range(rounds):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    times, tokens = run_job(codes[name], job, steps, Path(tmp) / f"{job_name}_{name}", threads,
                                            tuple(code_sets.get(name, ())))
                    per[name].append(round_summary([{"step_s": t} for t in times], warmup, split=()))
                    if log:
                        log(f"{job_name} round {r + 1}/{rounds} {name}: median step {per[name][-1]['median_s']:.3f} s")
            results[job_name] = {n: over_rounds(per[n], tokens, ()) for n in names}
            results[job_name]["ratio"] = ratio(results[job_name][names[-1]], results[job_name][names[0]])
    return results


def table(results: dict, names: list[str]) -> str:
    base, new = names[0], names[-1]
    lines = [f"| job | {base} tokens/s (rounds' range) | {new} tokens/s (rounds' range) | {new} / {base} speed |",
             "|---|---|---|---|"]
    for job, res in results.items():
        cells = []
        for n in (base, new):
            r = res[n]
            cells.append(f"{r['tok_s']:,.0f} ({r['tokens_per_step'] / r['slowest_s']:,.0f}-"
                         f"{r['tokens_per_step'] / r['fastest_s']:,.0f})")
        q = res["ratio"]
        lines.append(f"| {job} | {cells[0]} | {cells[1]} | **{q['ratio']:.2f}x** ({q['low']:.2f}-{q['high']:.2f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                    help="a code tree (twice: the baseline first)")
    ap.add_argument("--jobs", default="e2e,ep2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--code-set", action="append", default=[], metavar="NAME=KEY=VALUE",
                    help="an extra --set for one code's measured jobs only (repeatable)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    codes, code_sets = {}, {}
    for spec in a.code:
        name, _, path = spec.partition("=")
        if not path or not (Path(path) / "moe_trainer").is_dir():
            ap.error(f"--code {spec}: expected NAME=DIR with DIR a checkout holding moe_trainer/")
        codes[name] = Path(path).resolve()
    for spec in a.code_set:
        name, _, override = spec.partition("=")
        if name not in codes or "=" not in override:
            ap.error(f"--code-set {spec}: expected NAME=KEY=VALUE with NAME one of the codes {sorted(codes)}")
        code_sets.setdefault(name, []).append(override)
    jobs = a.jobs.split(",")
    if len(codes) != 2 or any(j not in JOBS for j in jobs) or a.steps <= a.warmup:
        ap.error(f"give two --code trees, --jobs from {sorted(JOBS)}, and --steps above --warmup")
    results = compare(codes, jobs, a.steps, a.warmup, a.rounds, a.threads, code_sets=code_sets)
    print(table(results, list(codes)))
    if a.json:
        Path(a.json).write_text(json.dumps({"codes": {n: str(p) for n, p in codes.items()}, "code_sets": code_sets,
                                            "results": results},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Headline figures: every job alone, several rounds alternating the order.

Turn-taking (turns.py) keeps a slow minute of a shared machine from landing on one job, but
every step then starts cold: the other job has just run and evicted the caches, and the
figure is not what a user running ours alone would see (docs/BENCHMARKS_ep.md: world 4 bf16
alone 1.33-1.40x against 1.69x in turns). Here each job runs alone, its steps back to back,
and the machine's drift is handled by rounds instead: round r runs the jobs one after the
other starting with job r mod n, so ours and the peer alternate in going first. Per job and
round: the median step time over the steps after warm-up; per job: the median over rounds
and the spread (fastest and slowest round). A ratio's spread pairs the extremes of both.

    results = run_alone({"ours": make_ours, "peer": make_peer}, steps=10, warmup=3, rounds=3)

`make_*(turns_address) -> (cmd, env)`: the same workers the turn-taking benchmarks start, driven
through a Referee that holds only that job (so nothing else runs while it steps).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Optional

from .turns import Referee

JobFactory = Callable[[str], tuple[list[str], dict]]  # turns address -> (command, environment)


def run_one_alone(name: str, factory: JobFactory, steps: int, cwd=None) -> tuple[list[dict], dict]:
    """Start one job with no other job running, step it `steps` times back to back: (its step
    reports, its closing result). Raises RuntimeError with the job's log tail if it fails."""
    referee = Referee()
    try:
        cmd, env = factory(referee.address(name))
        referee.start(name, cmd, env, cwd=cwd)
        referee.wait_ready()
        reports = referee.take_turns(steps)[name]
        result = referee.finish_all().get(name)
        if result is None or len(reports) < steps:
            raise RuntimeError(f"{name} failed: {referee.failures().get(name, 'no result')}")
        return reports, result
    finally:
        referee.close()


SPLIT = ("forward", "backward", "optimizer")  # bench_train's step split; bench_ep's is compute, all_to_all, rest


def round_summary(reports: list[dict], warmup: int, key: str = "step_s", split: tuple = SPLIT) -> dict:
    """One round of one job: the median step time (`key` of each report) and of each part of the
    split, over the steps after warm-up."""
    timed = reports[warmup:]
    if not timed:
        raise ValueError(f"no timed steps: {len(reports)} steps with warm-up {warmup}")
    out = {"median_s": statistics.median(s[key] for s in timed), "steps": len(timed)}
    for part in split:
        if part in timed[0]:
            out[part] = statistics.median(s[part] for s in timed)
    return out


def over_rounds(rounds: list[dict], tokens_per_step: float, split: tuple = SPLIT) -> dict:
    """A job over its rounds: median of the round medians, spread (fastest, slowest round),
    tokens/s at the median, and the step-time split (medians over rounds)."""
    medians = [r["median_s"] for r in rounds]
    out = {"median_s": statistics.median(medians), "fastest_s": min(medians), "slowest_s": max(medians),
           "rounds": medians, "tokens_per_step": tokens_per_step}
    out["tok_s"] = tokens_per_step / out["median_s"]
    parts = {k: statistics.median(r[k] for r in rounds) for k in split if all(k in r for r in rounds)}
    if parts:
        out["split"] = parts
    return out


def ratio(ours: dict, peer: dict) -> dict:
    """Speed of ours over the peer (peer step time / ours) at the medians, and its spread: the
    slowest peer round over the fastest of ours, and the other way round."""
    return {"ratio": peer["median_s"] / ours["median_s"], "low": peer["fastest_s"] / ours["slowest_s"],
            "high": peer["slowest_s"] / ours["fastest_s"]}


def run_alone(jobs: dict[str, JobFactory], steps: int, warmup: int, rounds: int, cwd=None,
              log: Optional[Callable[[str], None]] = print, key: str = "step_s", split: tuple = SPLIT,
              tokens_per_step: Optional[float] = None) -> dict[str, dict]:
    """Every job alone, `rounds` rounds, round r starting with job r mod n: {job: over_rounds(...)}
    or {job: {"error": ...}} for a job that failed (it is not run again)."""
    names, per_round, tokens, errors = list(jobs), {n: [] for n in jobs}, {}, {}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if name in errors:
                continue
            try:
                reports, result = run_one_alone(name, jobs[name], steps, cwd)
            except RuntimeError as e:
                errors[name] = str(e)[-3000:]
                continue
            tokens[name] = tokens_per_step or result.get("tokens_per_step", 0)
            per_round[name].append(round_summary(reports, warmup, key, split))
            if log:
                log(f"round {r + 1}/{rounds} {name}: median step {per_round[name][-1]['median_s']:.3f} s")
    out = {n: {"error": errors[n]} for n in errors}
    out.update({n: over_rounds(rs, tokens[n], split) for n, rs in per_round.items() if rs and n not in errors})
    return out


def pick_fastest(candidates: dict[str, JobFactory], steps: int, warmup: int, cwd=None,
                 log: Optional[Callable[[str], None]] = print) -> tuple[str, dict]:
    """Measure each candidate (one round alone each) and return (the fastest's name, every
    candidate's result): how a peer's implementation choice is made in the same run."""
    probed = run_alone(candidates, steps, warmup, rounds=1, cwd=cwd, log=log)
    timed = {n: r for n, r in probed.items() if "median_s" in r}
    if not timed:
        raise RuntimeError("every candidate failed: " + "; ".join(f"{n}: {r['error'][-300:]}" for n, r in probed.items()))
    return min(timed, key=lambda n: timed[n]["median_s"]), probed


def plot_tokens_per_s(rows: list[tuple[str, dict]], path: Path, title: str) -> None:
    """Bars of tokens/s per configuration, the whiskers the spread over rounds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [(label, r) for label, r in rows if "tok_s" in r]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows)), 3.6))
    x = range(len(rows))
    tok = [r["tok_s"] for _, r in rows]
    lo = [max(0.0, t - r["tokens_per_step"] / r["slowest_s"]) for t, (_, r) in zip(tok, rows)]
    hi = [max(0.0, r["tokens_per_step"] / r["fastest_s"] - t) for t, (_, r) in zip(tok, rows)]
    ax.bar(x, tok, yerr=[lo, hi], capsize=4, color="tab:blue")
    ax.set_xticks(list(x), [label for label, _ in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (median over rounds)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def plot_split(rows: list[tuple[str, dict]], path: Path, title: str) -> None:
    """Stacked bars of the step-time split (its parts in order, the rest as "other") per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [(label, r) for label, r in rows if "split" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows)), 3.6))
    bottom = [0.0] * len(rows)
    parts = list(dict.fromkeys(k for _, r in rows for k in r["split"]))
    for part, color in zip(parts, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        vals = [r["split"].get(part, 0.0) for _, r in rows]
        vals = [v if v == v else 0.0 for v in vals]  # NaN: a part the job does not measure (AutoEP's all-to-all)
        ax.bar(range(len(rows)), vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    rest = [r["median_s"] - b for (_, r), b in zip(rows, bottom)]
    ax.bar(range(len(rows)), [max(v, 0.0) for v in rest], bottom=bottom, label="other", color="tab:gray")
    ax.set_xticks(list(range(len(rows))), [label for label, _ in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

"""Time to the first step against the token set's size: the same small token directory, its train
shard grown by a hole to 1 GB and to 100 GB (a sparse file: the index lists the shard's token count
and largest id, which the preparation would have checked), each trained for one step by the real
entry point (`python -m moe_trainer.train`, one rank), in alternating rounds, each run alone.

  python -m moe_trainer.data.bench_start [--sizes-gb 1 100] [--rounds 3] [--dir DIR]

Prints per size the seconds from the command's start to its first metrics row (the row's
`wall_time` against the launch time), then the ratio of the largest to the smallest with its spread over the rounds. Nothing scans the
tokens at start (formats.open_token_dir: a stat per shard, ids from the index) and the window
order is a keyed bijection (sampling.WindowOrder, O(1) memory), so the ratio should be 1."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def sparse_token_set(out: Path, gigabytes: float) -> dict:
    """A token directory whose train shard is `gigabytes` GB: a few real documents, then a hole (ids 0)."""
    from .prepare import write_token_dir
    from .tokenizer import BYTE_TOKENIZER, BYTE_VOCAB_PADDED, EOS_ID, byte_tokenizer_files
    if out.exists():
        shutil.rmtree(out)
    rng = np.random.default_rng(0)
    docs = ((f"doc{i}", rng.integers(0, 256, 4096, dtype=np.int64)) for i in range(64))
    index = write_token_dir(out, docs, BYTE_VOCAB_PADDED, EOS_ID, 0.1, BYTE_TOKENIZER, byte_tokenizer_files())
    shard = index["splits"]["train"]["shards"][-1]
    itemsize = np.dtype(index["dtype"]).itemsize
    tokens = int(gigabytes * 1e9) // itemsize
    grow = tokens - index["splits"]["train"]["num_tokens"]
    with open(out / shard["file"], "r+b") as f:
        f.truncate((shard["num_tokens"] + grow) * itemsize)
    shard["num_tokens"] += grow
    index["splits"]["train"]["num_tokens"] += grow
    (out / "index.json").write_text(json.dumps(index, indent=1))
    return index


def first_step(data: Path, out: Path) -> dict:
    """One step of the tiny MoE on `data` through the real entry point: seconds from the command's
    start to its first metrics row (the row's wall_time), and to the command's end."""
    if out.exists():
        shutil.rmtree(out)
    sets = ["train.max_steps=1", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
            "train.resume=none", f"data.path={data}", f"run.out_dir={out}"]
    cmd = [sys.executable, "-m", "moe_trainer.train", "--config", str(ROOT / "configs" / "moe_tiny.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the run on {data} failed:\n{output[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    return {"to_first_step_s": first["wall_time"] - t0, "total_s": time.time() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[1.0, 100.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/moe_trainer_bench_start")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    sets = {}
    for gb in args.sizes_gb:
        index = sparse_token_set(d / f"tokens_{gb:g}gb", gb)
        sets[gb] = index["splits"]["train"]["num_tokens"]
    times: dict[float, list[float]] = {gb: [] for gb in args.sizes_gb}
    for r in range(args.rounds):
        order = args.sizes_gb if r % 2 == 0 else list(reversed(args.sizes_gb))
        for gb in order:
            res = first_step(d / f"tokens_{gb:g}gb", d / "run")
            times[gb].append(res["to_first_step_s"])
            print(f"round {r + 1}: {gb:g} GB ({sets[gb]:,} tokens): {times[gb][-1]:.1f} s", flush=True)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| token set | train tokens | seconds to the first step (median; each round) |")
    print("|---|---|---|")
    for gb in args.sizes_gb:
        ts = sorted(times[gb])
        print(f"| {gb:g} GB (sparse) | {sets[gb]:,} | {ts[len(ts) // 2]:.1f} ({', '.join(f'{t:.1f}' for t in times[gb])}) |")
    small, big = min(args.sizes_gb), max(args.sizes_gb)
    ratios = sorted(b / s for b, s in zip(times[big], times[small]))
    print(f"ratio {big:g} GB / {small:g} GB per round: median {ratios[len(ratios) // 2]:.2f}x "
          f"(range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The headline benchmarks in one command (`scripts/bench_all.sh`), within about 30 minutes on 2 cores.

Runs, each job alone in rounds that alternate the order (bench/headline.py):
- end to end (`bench.train --mode alone`): ours on 1 rank against transformers' DeepseekV3ForCausalLM
  + DeepSpeed ZeRO-1 at its best (eager or sdpa attention, measured in the run);
- expert parallelism (`bench.ep --mode alone`): ours at ep = world 1 and 2 against DeepSpeed AutoEP
  at the same worlds.
The dtype (`--dtype`) is bf16 where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX, what
oneDNN reports) and fp32 elsewhere: on an AVX2-only CPU bf16 GEMMs are emulated, several times
slower than fp32, and a bf16 headline would time the emulation, not the trainers.
Then it writes each benchmark's JSON and PNGs (tokens/s per configuration with the spread over
rounds, the step-time split) to docs/bench/, and rewrites the table between the `bench_all` markers
of docs/BENCHMARKS.md, every row with its command and date. The headline ratio gives the peer the
same allocator setting as ours; the stock column gives it glibc's default.

    scripts/bench_all.sh                      # the headline set, rewrites docs/BENCHMARKS.md
    scripts/bench_all.sh --smoke              # a tiny model and 3 steps: proves the pipeline works
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .headline import plot_split, plot_tokens_per_s

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench_all:begin -->", "<!-- bench_all:end -->"
# --smoke: a model that steps in well under a second (the figures mean nothing)
SMOKE_SETS = ["model.hidden_size=64", "model.num_attention_heads=2", "model.intermediate_size=128",
              "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16",
              "model.v_head_dim=16", "model.n_routed_experts=8", "model.num_experts_per_tok=2",
              "model.moe_intermediate_size=32", "model.num_hidden_layers=2", "train.seq_len=32",
              "train.micro_batch_size=2", "train.global_batch_size=4"]


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's own check: AVX-512 BF16 or AMX)."""
    import torch
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def train_cmd(out: Path, smoke: bool, dtype: str) -> list[str]:
    if smoke:
        sets = [a for kv in SMOKE_SETS for a in ("--set", kv)]
        return [sys.executable, "-m", "moe_trainer.bench.train", "--mode", "alone", "--dtypes", dtype, "--steps", "3",
                "--warmup", "1", "--rounds", "2", "--out", str(out), *sets]
    return [sys.executable, "-m", "moe_trainer.bench.train", "--mode", "alone", "--dtypes", dtype, "--steps", "8",
            "--warmup", "3", "--rounds", "3", "--out", str(out)]


def ep_cmd(out: Path, smoke: bool, dtype: str) -> list[str]:
    steps = ["--steps", "3", "--warmup", "1", "--rounds", "1", "--worlds", "1"] if smoke else \
        ["--steps", "20", "--warmup", "5", "--rounds", "2", "--worlds", "1,2"]
    return [sys.executable, "-m", "moe_trainer.bench.ep", "--mode", "alone", "--dtypes", dtype,
            "--peer-worlds", steps[steps.index("--worlds") + 1], *steps, "--out", str(out)]


def _spread(r: dict) -> str:
    return f"{r['tok_s']:,.0f} ({r['tokens_per_step'] / r['slowest_s']:,.0f}-{r['tokens_per_step'] / r['fastest_s']:,.0f})"


def _ratio(x) -> str:
    return "n/a" if not x else f"**{x['ratio']:.2f}x** ({x['low']:.2f}-{x['high']:.2f})"


def table_rows(train: dict | None, ep: dict | None) -> list[list[str]]:
    """One row per headline figure: what, ours tokens/s, the peer's, the two ratios, command, date."""
    rows = []
    for dt, r in (train or {}).items():
        if not isinstance(r, dict) or "jobs" not in r:
            continue
        jobs = r["jobs"]
        if "tok_s" not in jobs.get("ours1", {}) or "tok_s" not in jobs.get("hfk", {}):
            rows.append([f"end to end, moe_bench, 1 rank, {dt}", "failed", "", "", "", train["command"], train["date"]])
            continue
        rows.append([f"end to end, moe_bench, 1 rank, {dt}; peer transformers ({r['peer']})",
                     _spread(jobs["ours1"]), _spread(jobs["hfk"]), _ratio(r["same_allocator"]), _ratio(r["stock"]),
                     f"`{train['command']}`", train["date"]])
    for key, r in (ep or {}).items():
        if not isinstance(r, dict) or "jobs" not in r:
            continue
        jobs = r["jobs"]
        peer = jobs.get("autoep_keep_freed", {})
        rows.append([f"expert parallelism, moe_tiny, ep = world {key.split(' w')[1]}, {key.split()[0]}; peer AutoEP",
                     _spread(jobs["ours"]) if "tok_s" in jobs.get("ours", {}) else "failed",
                     _spread(peer) if "tok_s" in peer else "failed", _ratio(r["same_allocator"]), _ratio(r["stock"]),
                     f"`{ep['command']}`", ep["date"]])
    return rows


def render(rows: list[list[str]], smoke: bool) -> str:
    head = ["figure", "ours tokens/s (spread over rounds)", "peer tokens/s, our allocator setting",
            "ours / peer, same allocator", "ours / peer, peer on glibc's default", "command", "date"]
    lines = [BEGIN, "", "Headline figures (`scripts/bench_all.sh`): each job alone, rounds alternating the order, "
             "median step over the steps after warm-up, the spread (in brackets) over rounds"
             + (" -- SMOKE RUN: a tiny model and 3 steps, these numbers mean nothing" if smoke else "") + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Pictures: `docs/bench/train_tokens_per_s.png`, `docs/bench/train_split.png`, "
              "`docs/bench/ep_tokens_per_s.png`, `docs/bench/ep_split.png`.", "", END]
    return "\n".join(lines)


def rewrite_doc(doc: Path, block: str) -> None:
    """Replace the text between the markers (or add the block after the first heading), atomically."""
    text = doc.read_text()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        first = text.index("\n") + 1
        text = text[:first] + "\n" + block + "\n" + text[first:]
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(doc)


def plots(train: dict | None, ep: dict | None, out: Path) -> None:
    labels = {"ours1": "ours, 1 rank", "hfk": "transformers, our allocator", "hf": "transformers, glibc default"}
    rows = [(f"{labels[n]} {dt}", r["jobs"][n]) for dt, r in (train or {}).items()
            if isinstance(r, dict) and "jobs" in r for n in labels if n in r["jobs"]]
    if rows:
        plot_tokens_per_s(rows, out / "train_tokens_per_s.png", "end to end, each job alone (median, spread)")
        plot_split(rows, out / "train_split.png", "end to end: step-time split")
    rows = [(f"{n} {key}", r["jobs"][n]) for key, r in (ep or {}).items()
            if isinstance(r, dict) and "jobs" in r for n in ("ours", "autoep_keep_freed", "autoep") if n in r["jobs"]]
    if rows:
        plot_tokens_per_s(rows, out / "ep_tokens_per_s.png", "expert parallelism, each job alone (median, spread)")
        plot_split(rows, out / "ep_split.png", "expert parallelism: step-time split")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench_all.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and 3 steps (proves the pipeline; the "
                    "figures mean nothing)")
    ap.add_argument("--only", default="train,ep", help="comma list of benchmarks to run (train, ep)")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "bench"), help="JSON and PNGs")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="the document whose table is rewritten")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="auto: bf16 where the CPU has native bf16 GEMMs, else fp32")
    a = ap.parse_args(argv)
    dtype = a.dtype if a.dtype != "auto" else ("bf16" if native_bf16() else "fp32")
    print(f"dtype {dtype}" + (" (this CPU has no native bf16 GEMMs)" if a.dtype == "auto" and dtype == "fp32" else ""),
          flush=True)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, t0 = {}, time.time()
    for name, make in (("train", train_cmd), ("ep", ep_cmd)):
        if name not in a.only.split(","):
            continue
        path = out / f"{name}_headline.json"
        cmd = make(path, a.smoke, dtype)
        print("running:", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0 or not path.exists():
            print(f"{name} failed (exit {proc.returncode}); its rows are left out", file=sys.stderr)
            continue
        results[name] = json.loads(path.read_text())
    plots(results.get("train"), results.get("ep"), out)
    rewrite_doc(Path(a.doc), render(table_rows(results.get("train"), results.get("ep")), a.smoke))
    print(f"rewrote the headline table of {a.doc} in {(time.time() - t0) / 60:.1f} min; PNGs in {out}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())

"""Fault drill: run a short job, kill a random rank several times, restart with
resume=auto, and report the steps lost and the time to recover each time.

    python -m moe_trainer.fault_drill [--ranks 2] [--kills 3] [--steps 40] [--out runs/fault_drill]
    python -m moe_trainer.fault_drill --faults all [--steps 12]   # each fault kind of debug.faults

--faults injects each kind (bitflip, spike, nan, slow, hang, kill) once, at a random step and rank,
into its own job under the restart wrapper, and reports per fault: detected or not and how, the
time to detect, the steps lost, and whether the final weights equal a clean run's (they should
after a bit flip, a hang and a kill: repaired, or resumed from a checkpoint; not after a spike,
whose batches are skipped, or a NaN, whose step is skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=3", "model.num_attention_heads=2",
         "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.n_routed_experts=8", "model.num_experts_per_tok=2",
         "model.n_group=2", "model.topk_group=1", "model.moe_intermediate_size=32", "model.intermediate_size=128",
         "train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_every=1",
         "train.eval_every=0", "train.checkpoint_every=5", "train.keep_checkpoints=2", "train.resume=auto",
         "parallel.timeout_s=60"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logged_steps(out: Path) -> int:
    f = out / "metrics.jsonl"
    if not f.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in f.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def _rank_pids(out: Path) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if str(out).encode() in cmd and b"moe_trainer.train" in cmd and b"--local_rank" in cmd:
                pids.append(int(d.name))
    return pids


def _latest(out: Path) -> int:
    f = out / "checkpoints" / "latest"
    return int(f.read_text().strip().split("_")[1]) if f.is_file() else 0


def _launch(args, out: Path) -> subprocess.Popen:
    sets = [a for o in SMALL + [f"train.max_steps={args.steps}", f"run.out_dir={out}"] for a in ("--set", o)]
    cmd = [shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed"), "--num_gpus",
           str(args.ranks), "--master_port", str(_free_port()), "--module", "moe_trainer.train",
           "--config", args.config, *sets]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_step(out: Path, above: int, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until this process logs a step > `above` (a restarted run first
    truncates what the killed one logged after its checkpoint)."""
    t0 = time.time()
    f = out / "metrics.jsonl"
    while time.time() - t0 < timeout and proc.poll() is None:
        if f.is_file() and f.stat().st_mtime > t0 and _logged_steps(out) > above:
            return time.time() - t0
        time.sleep(0.1)
    return float("nan")


FAULT_KINDS = ("bitflip", "spike", "nan", "slow", "hang", "kill")
SHOULD_EQUAL_CLEAN = {"bitflip", "hang", "kill", "slow"}
DRILL = ["train.checkpoint_every=2", "train.keep_checkpoints=8", "train.replica_check_every=1",
         "parallel.timeout_s=20"]


def _rows(out: Path, name: str) -> list[dict]:
    f = out / name
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


def _fault_job(args, out: Path, extra: list[str]) -> int:
    sets = [a for o in SMALL + DRILL + [f"train.max_steps={args.steps}", f"run.out_dir={out}"] + extra
            for a in ("--set", o)]
    cmd = [sys.executable, "-m", "moe_trainer.restart", "--max-restarts", "1", "--",
           shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(args.ranks),
           "--master_port", str(_free_port()), "--module", "moe_trainer.train", "--config", args.config, *sets]
    return subprocess.call(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _final_weights_equal(a: Path, b: Path, step: int) -> bool:
    from .checkpoint import read_full
    x, y = read_full(a / "checkpoints" / f"step_{step}"), read_full(b / "checkpoints" / f"step_{step}")
    return x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x)


def _detection(kind: str, spec: str, out: Path) -> dict:
    """What the run directory says of one injected fault: how it was seen, when, and what it cost."""
    fired = next((r for r in _rows(out, "faults.jsonl") if r["fault"] == spec), None)
    rows = _rows(out, "metrics.jsonl")
    step = int(spec.split("@")[1].split(":")[0])
    events = {"bitflip": ("replica_mismatch", "replica check: checksums differ, repaired from owners"),
              "spike": ("rollback", "spike guard: rolled back, batches skipped"),
              "slow": ("straggler", "straggler named at a log step"),
              "hang": ("restart", "collective timeout, job ended and restarted"),
              "kill": ("restart", "job ended, restarted from the last checkpoint")}
    if kind == "nan":
        seen = next((r for r in rows if r.get("skipped") and r.get("step") == step), None)
        how, lost = "non-finite loss: step skipped", 1
    else:
        name, how = events[kind]
        rank = int(spec.split(":")[1]) if ":" in spec else None
        after = fired["time"] - 1.0 if fired else float("inf")  # the drill's jobs share this machine's clock
        seen = next((r for r in rows if r.get("event") == name and r.get("wall_time", 0) >= after
                     and (kind != "slow" or r.get("rank") == rank)), None)  # not an earlier step's noise
        lost = 0
        if seen and kind == "spike":
            lost = seen["step"] - seen["to"]
        elif seen and kind in ("hang", "kill"):
            lost = step - 1 - seen["step"]  # steps done after the checkpoint it resumed from
    seconds = seen["wall_time"] - fired["time"] if seen and fired and "wall_time" in seen else float("nan")
    return {"detected": seen is not None, "how": how if seen else "-", "detect_s": round(seconds, 1),
            "steps_lost": lost if seen else None}


def drill_faults(args, kinds: list[str]) -> int:
    from .faults import SpikeRule
    rng = random.Random(args.seed)
    root = Path(args.out).resolve()
    shutil.rmtree(root, ignore_errors=True)
    clean = root / "clean"
    if _fault_job(args, clean, []) != 0:
        print("the clean run failed; see its run directory", clean, file=sys.stderr)
        return 1
    rows = []
    for kind in kinds:
        # a spike needs the guard's history first (SpikeRule.min_history steps)
        first = SpikeRule().min_history + 1 if kind == "spike" else 3
        step = rng.randint(first, max(first, args.steps - 4))
        spec = f"{kind}@{step}" + (f":{rng.randrange(args.ranks)}" if kind in ("bitflip", "slow", "hang", "kill")
                                    else "")
        out = root / kind
        t0 = time.time()
        rc = _fault_job(args, out, [f"debug.faults=[{spec}]"])
        row = {"fault": spec, "exit": rc, "wall_s": round(time.time() - t0, 1), **_detection(kind, spec, out)}
        equal = rc == 0 and _final_weights_equal(clean, out, args.steps)
        row["final_equal_clean"] = equal
        row["expected_equal"] = kind in SHOULD_EQUAL_CLEAN
        rows.append(row)
        print(f"{spec}: {'detected' if row['detected'] else 'NOT detected'} ({row['how']}) in {row['detect_s']} s, "
              f"{row['steps_lost']} step(s) lost; final weights {'equal' if equal else 'differ from'} the clean "
              f"run's ({'as they should' if equal == row['expected_equal'] else 'NOT as expected'}); exit {rc}",
              flush=True)
    (root / "fault_drill.json").write_text(json.dumps(rows, indent=1))
    print("\n| fault | detected | how | time to detect (s) | steps lost | final weights = clean |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {'yes' if r['detected'] else 'no'} | {r['how']} | {r['detect_s']} | "
              f"{r['steps_lost']} | {'yes' if r['final_equal_clean'] else 'no'}"
              f"{'' if r['final_equal_clean'] == r['expected_equal'] else ' (unexpected)'} |")
    ok = all(r["detected"] and r["exit"] == 0 and r["final_equal_clean"] == r["expected_equal"] for r in rows)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=None, help="all, or kinds separated by commas: " + ", ".join(FAULT_KINDS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--config", default="configs/moe_tiny.yaml")
    ap.add_argument("--out", default="runs/fault_drill")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.faults:
        kinds = list(FAULT_KINDS) if args.faults == "all" else args.faults.split(",")
        unknown = [k for k in kinds if k not in FAULT_KINDS]
        if unknown:
            ap.error(f"--faults: unknown kind(s) {', '.join(unknown)}; choose all or from {', '.join(FAULT_KINDS)}")
        if args.steps < 14:
            ap.error(f"--faults needs --steps 14 or more (a spike comes after the guard's 8 steps of history, "
                     f"and every fault needs steps after it), got {args.steps}")
        return drill_faults(args, kinds)
    rng = random.Random(args.seed)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    rows = []
    proc = _launch(args, out)
    for k in range(args.kills):
        _wait_step(out, _logged_steps(out) + rng.randint(3, 8), proc, timeout=300)
        pids = _rank_pids(out)
        if proc.poll() is not None or not pids:
            break
        victim = rng.choice(sorted(pids))
        reached = _logged_steps(out)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=180)
        exit_s = time.time() - t_kill
        resumed = _latest(out)
        proc = _launch(args, out)
        recover_s = _wait_step(out, resumed, proc, timeout=300)
        rows.append({"kill": k + 1, "step_reached": reached, "resumed_from": resumed, "lost_steps": reached - resumed,
                     "job_exit_s": round(exit_s, 1), "time_to_first_new_step_s": round(recover_s, 1)})
        print(f"kill {k + 1}: rank pid {victim} at step {reached}; job ended in {exit_s:.1f} s; resumed from step "
              f"{resumed} ({reached - resumed} steps lost); first new step {rows[-1]['time_to_first_new_step_s']} s "
              f"after restart", flush=True)
    rc = proc.wait(timeout=1800)
    final = _logged_steps(out)
    print(f"finished: exit {rc}, {final}/{args.steps} steps; mean steps lost "
          f"{sum(r['lost_steps'] for r in rows) / max(len(rows), 1):.1f}, mean time to first new step "
          f"{sum(r['time_to_first_new_step_s'] for r in rows) / max(len(rows), 1):.1f} s")
    (out / "fault_drill.json").write_text(json.dumps({"kills": rows, "exit": rc, "final_step": final}, indent=1))
    return 0 if rc == 0 and final == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())

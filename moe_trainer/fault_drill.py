"""Fault drill: run a short job, kill a random rank several times, restart with
resume=auto, and report the steps lost and the time to recover each time.

    python -m moe_trainer.fault_drill [--ranks 2] [--kills 3] [--steps 40] [--out runs/fault_drill]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--config", default="configs/moe_tiny.yaml")
    ap.add_argument("--out", default="runs/fault_drill")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
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

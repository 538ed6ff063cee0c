"""Restart a failed training job, as torchrun's --max-restarts does, resuming from its last good checkpoint.

    python -m moe_trainer.restart --max-restarts 3 -- deepspeed --num_gpus 8 --module moe_trainer.train ...

The command runs as given; if it fails, it runs again (train.resume=auto, the default, resumes from
the newest complete checkpoint), up to K more times. Not restarted: success (exit 0), bad input
(exit 2: the same command would fail the same way) and a stop by policy (exit 3: repeated non-finite
losses or loss spikes, which need a person). Each restart is recorded by the trainer as a
`{"event": "restart"}` row of metrics.jsonl (it reads RESTART_ENV at start).

When the command runs moe_trainer.train (`--module moe_trainer.train`), the wrapper first plans
the start its ranks would make: a run that already reached train.max_steps says so and exits 0
before any launcher starts. DeepSpeed's INFO lines (the launcher's and the ranks', on stdout) go to
RUN_DIR/deepspeed.log; its warnings and everything else stay on the console.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from .run_dir import RESTART_ENV  # the trainer reads it from there: restart -> train -> trainer is a line

NOT_RESTARTED = {0: "finished", 2: "bad input", 3: "stopped by policy"}
# DeepSpeed's logger format: "[2026-12-03 06:18:36,440] [INFO] [launch.py:152:main] ..."
DEEPSPEED_INFO = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] \[(INFO|DEBUG)\] ")
DEEPSPEED_LOG = "deepspeed.log"


def trainer_args(cmd: list[str]) -> Optional[list[str]]:
    """The trainer's arguments in a launcher command (what follows `--module moe_trainer.train` or
    `-m moe_trainer.train`), None if the command runs something else."""
    for i in range(1, len(cmd)):
        if cmd[i] == "moe_trainer.train" and cmd[i - 1] in ("--module", "-m"):
            return cmd[i + 1:]
    return None


def run_filtered(cmd: list[str], env: dict, info_log: Optional[Path]) -> int:
    """Run the command; with `info_log`, the DeepSpeed INFO lines of its stdout are appended
    there instead of the console (every other line passes at once, in order)."""
    if info_log is None:
        return subprocess.call(cmd, env=env)
    info_log.parent.mkdir(parents=True, exist_ok=True)
    with open(info_log, "a") as sink, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                                       errors="replace", bufsize=1) as proc:
        for line in proc.stdout:
            if DEEPSPEED_INFO.match(line):
                sink.write(line)
                sink.flush()
            else:
                sys.stdout.write(line)
                sys.stdout.flush()
        return proc.wait()


def run_with_restarts(cmd: list[str], max_restarts: int, log=print, info_log: Optional[Path] = None) -> int:
    """The command's exit code, after up to `max_restarts` restarts of a failed run."""
    env = dict(os.environ)
    env.pop(RESTART_ENV, None)
    attempt = 0
    while True:
        started = time.time()
        code = run_filtered(cmd, env, info_log)
        if code in NOT_RESTARTED or attempt >= max_restarts:
            if code not in NOT_RESTARTED:
                log(f"restart: the job failed (exit {code}) and the {max_restarts} restart(s) of --max-restarts "
                    f"are used up.")
            return code
        attempt += 1
        log(f"restart: the job failed (exit {code}) after {time.time() - started:.0f} s; restarting "
            f"({attempt} of {max_restarts}), resuming from the last good checkpoint.")
        env[RESTART_ENV] = f"{attempt}:{code}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_trainer.restart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-restarts", type=int, default=3, help="restarts after a failure (default %(default)s)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the launcher command, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the launcher command after --")
    if args.max_restarts < 0:
        ap.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    info_log = before = None
    if trainer_args(cmd) is not None:
        from . import run_dir
        from .train import keep_build_cache_per_environment, plan_command, use_this_environments_ninja
        keep_build_cache_per_environment()  # the launcher's ranks inherit it
        use_this_environments_ninja()
        start = plan_command(trainer_args(cmd))
        if start is not None:
            done = run_dir.nothing_left(start)
            if done:
                print(done, flush=True)
                return 0
            info_log = Path(start.cfg.run.out_dir) / DEEPSPEED_LOG
            before = run_dir.before_launch(info_log.parent)
        print(f"starting {Path(cmd[0]).name}: the ranks set up the process group, the model and the engine "
              f"before the first step{f'; DeepSpeed INFO lines go to {info_log}' if info_log else ''}", flush=True)
    code = run_with_restarts(cmd, args.max_restarts, log=lambda m: print(m, file=sys.stderr, flush=True),
                             info_log=info_log)
    if code == 2 and before is not None:  # refused as bad input: no run directory holding only our log
        from .run_dir import undo_refused_start
        undo_refused_start(info_log.parent, before, ours=(DEEPSPEED_LOG,))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Restart a failed training job, as torchrun's --max-restarts does, resuming from its last good checkpoint.

    python -m moe_trainer.restart --max-restarts 3 -- deepspeed --num_gpus 8 --module moe_trainer.train ...

The command runs as given; if it fails, it runs again (train.resume=auto, the default, resumes from
the newest complete checkpoint), up to K more times. Not restarted: success (exit 0), bad input
(exit 2: the same command would fail the same way) and a stop by policy (exit 3: repeated non-finite
losses or loss spikes, which need a person). Each restart is recorded by the trainer as a
`{"event": "restart"}` row of metrics.jsonl (it reads RESTART_ENV at start).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

RESTART_ENV = "MOE_TRAINER_RESTART"  # "<attempt>:<previous exit code>", set for restarted attempts
NOT_RESTARTED = {0: "finished", 2: "bad input", 3: "stopped by policy"}


def run_with_restarts(cmd: list[str], max_restarts: int, log=print) -> int:
    """The command's exit code, after up to `max_restarts` restarts of a failed run."""
    env = dict(os.environ)
    env.pop(RESTART_ENV, None)
    attempt = 0
    while True:
        started = time.time()
        code = subprocess.call(cmd, env=env)
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
    return run_with_restarts(cmd, args.max_restarts, log=lambda m: print(m, file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main())

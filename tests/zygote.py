"""A warm process that starts the tests' training jobs by fork, for tests/conftest.py's `launch`.

Every rank of a launched job spends ~8 s of one core before its first step on imports alone (torch,
torch._dynamo, which torch's optimizers import at their first param group, DeepSpeed, the Muon
optimizer DeepSpeed's ZeRO code imports, the trainer), and DeepSpeed's launcher process 3 s more:
most of what the suite's hundreds of short jobs cost. This process imports all of that once per
pytest worker and then runs each job as fork()ed processes, which start with it already imported:

- a job is a process of its own session (so a timeout ends the whole job) that forks the ranks;
- a rank gets the environment DeepSpeed's launcher (deepspeed/launcher/launch.py) gives it: RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT, CROSS_RANK, CROSS_SIZE, and
  `--local_rank=R` before the script's arguments; then runs the module as `python -u -m` would, as
  __main__, with unbuffered output, non-daemon threads joined and atexit handlers run at its end;
- when a rank exits non-zero, the job ends the others (SIGTERM, then SIGKILL after a grace period)
  and exits with that rank's code, as DeepSpeed's launcher does;
- a one-process job (launcher "python") runs the module in the job process itself, with no rank
  variables, as `python -m` does.

The job sees exactly the environment the test asked for. The warm process is started with the tests'
environment (conftest.env()); a launch whose environment differs from it is started the ordinary way,
since what was read at import time would not be that environment's. Nothing here runs in a product
path: it replaces the cost of starting processes, not what they do. DeepSpeed's own launcher, torchrun
and the `deepspeed` command stay covered by the tests that name them (launcher="deepspeed-cli",
"torchrun", and `launch(..., real=True)`).

Protocol on stdin/stdout, one JSON object a line: the client sends {"module", "args", "n", "port",
"stdout", "stderr", "env"}; the zygote answers {"pid": job pid} at the start and {"rc": exit code}
at the end."""
from __future__ import annotations

import importlib
import io
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

GRACE_S = 5.0


# what every rank imports on its way to the first step (conftest.start_ranks's fork server imports the same)
WARM = ("torch",
        "torch._dynamo",  # torch.optim's first add_param_group imports it
        "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
        "deepspeed.runtime.zero.muon.muon_optimizer",  # ZeRO's sanity check and reduction import it
        "deepspeed.runtime.bf16_optimizer", "safetensors.torch", "torch.utils.tensorboard",
        "moe_trainer.train", "moe_trainer.trainer", "nccl_p2p_rule")


def warm() -> None:
    """Import WARM."""
    for module in WARM:
        importlib.import_module(module)


def _unbuffered() -> None:
    """fds 1 and 2 as `python -u` has them: every write reaches the file at once."""
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)


def _run_module(module: str, argv: list[str]) -> int:
    """`python -u -m module argv...` in this (forked) process; returns its exit code."""
    sys.argv = [module] + argv
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (an uncaught exception: what the interpreter prints, exit 1)
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads at exit
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's 128 + signal


def _job(req: dict) -> None:
    """The job process: its own session, output to the request's files; never returns."""
    code = 1
    try:
        os.setsid()
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        _unbuffered()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        n = req["n"]
        if n == 0:  # one process, no rank variables: `python -m module args`
            code = _run_module(req["module"], req["args"])
        else:
            code = _ranks(req, n)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(code)


def _ranks(req: dict, n: int) -> int:
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(req["port"]), WORLD_SIZE=str(n),
                CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(n))
    pids = {}
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.clear()
                os.environ.update(base, RANK=str(r), LOCAL_RANK=str(r))
                code = _run_module(req["module"], [f"--local_rank={r}"] + req["args"])
            finally:
                os._exit(code)
        pids[pid] = r
    failed = None
    while pids:
        pid, status = os.wait()
        pids.pop(pid, None)
        code = _exit_code(status)
        if code != 0 and failed is None:
            failed = code
            _end(list(pids))
            break
    return failed or 0


def _end(pids: list[int]) -> None:
    """SIGTERM the ranks still running, SIGKILL those left after the grace period, reap them all."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    left = set(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                left.discard(pid)
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def serve() -> None:
    warm()
    if threading.active_count() != 1:  # forking a process with threads could copy a held lock
        raise SystemExit(f"zygote: {threading.active_count()} threads after the imports; fork is unsafe")
    reply = sys.stdout
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _job(req)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": _exit_code(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()

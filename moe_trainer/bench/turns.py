"""Step-interleaved benchmarking: jobs that take turns, one optimizer step at a time.

A benchmark that runs ours, then the peer, lets a slow minute of a shared machine land on one
of them: on the 2-core VM the benchmarks run on, the same run moved 15-20% between minutes and
the ratio of two back-to-back runs anywhere from 0.99x to 1.88x. Here every job (each a
process, or a launcher's ranks) starts once and keeps its state, and the driver (`Referee`)
hands out turns: job A runs one step on all of its ranks while every other job sleeps in a
blocking read (rank 0) or a gloo broadcast (the other ranks), then job B, and so on. A slow
spell then costs every job about the same steps, and each job keeps its own process, allocator
and thread settings.

Protocol, one line each over a localhost socket that every job's rank 0 opens to the driver:
job -> `READY <name>`; driver -> `STEP` or `END`; after a STEP the job answers `DONE <json>`
when it next waits (so whatever it does after the step, logging included, stays inside its
turn); after END it answers `RESULT <json>` and exits.

    referee = Referee()
    referee.start("ours", [..., "--turns", referee.address("ours")], env)
    referee.start("peer", [...])
    referee.wait_ready()
    reports = referee.take_turns(steps)   # each round: one step of each job, the others asleep
    results = referee.finish_all()

On a job's side: `turns = Turns(spec)` after its set-up (spec = the `--turns` argument), then
`turns.wait()` before each step, `turns.report(info)` after it, and `turns.close(result)`;
`train_in_turns` does the first two around our Trainer's own loop.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from typing import Callable, Optional


class JobFailed(RuntimeError):
    pass


class _Job:
    def __init__(self, name: str, proc: subprocess.Popen, log):
        self.name, self.proc, self.log = name, proc, log
        self.conn: Optional[socket.socket] = None
        self.reader = None
        self.error: Optional[str] = None

    def tail(self, chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]


class Referee:
    """The driver's side: starts the jobs, hands out turns, collects their results."""

    def __init__(self, timeout_s: float = 900.0):
        self.timeout_s = timeout_s
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.jobs: dict[str, _Job] = {}

    def address(self, name: str) -> str:
        """The `--turns` argument for job `name`."""
        return f"{self.port}:{name}"

    def start(self, name: str, cmd: list[str], env: Optional[dict] = None, cwd=None) -> None:
        log = tempfile.TemporaryFile()
        # its own process group: a launcher's ranks are its children, and a failed job's go with it
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.jobs[name] = _Job(name, proc, log)

    def running(self) -> list[str]:
        return [n for n, j in self.jobs.items() if j.error is None]

    def failures(self) -> dict[str, str]:
        return {n: j.error for n, j in self.jobs.items() if j.error is not None}

    def wait_ready(self) -> None:
        """Blocks until every started job has connected (or failed: its process exited first)."""
        deadline = time.monotonic() + self.timeout_s
        waiting = {n for n, j in self.jobs.items() if j.conn is None and j.error is None}
        self.server.settimeout(1.0)
        while waiting:
            for n in list(waiting):
                if self.jobs[n].proc.poll() is not None:
                    self._fail(self.jobs[n], f"exited with {self.jobs[n].proc.returncode} before it was ready")
                    waiting.discard(n)
            if not waiting:
                break
            if time.monotonic() > deadline:
                for n in waiting:
                    self._fail(self.jobs[n], f"not ready after {self.timeout_s:.0f} s")
                break
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            conn.settimeout(self.timeout_s)
            reader = conn.makefile("r")
            hello = reader.readline().split()
            if len(hello) != 2 or hello[0] != "READY" or hello[1] not in waiting:
                conn.close()
                continue
            job = self.jobs[hello[1]]
            job.conn, job.reader = conn, reader
            waiting.discard(job.name)

    def _send(self, job: _Job, word: str) -> None:
        job.conn.sendall((word + "\n").encode())

    def _expect(self, job: _Job, kind: str) -> dict:
        try:
            line = job.reader.readline()
        except (socket.timeout, OSError) as e:
            raise JobFailed(f"{job.name}: no answer ({type(e).__name__})") from None
        if not line.startswith(kind + " "):
            raise JobFailed(f"{job.name}: expected {kind}, got {line.strip()[:200]!r}")
        return json.loads(line[len(kind) + 1:])

    def _fail(self, job: _Job, why: str) -> None:
        _kill(job.proc)
        job.error = f"{why}\n{job.tail()}"

    def step(self, name: str) -> Optional[dict]:
        """One step of job `name` (every other job asleep): what it reported, or None if it failed."""
        job = self.jobs[name]
        try:
            self._send(job, "STEP")
            return self._expect(job, "DONE")
        except (JobFailed, OSError, ValueError) as e:
            self._fail(job, str(e))
            return None

    def finish(self, name: str) -> Optional[dict]:
        """Ends job `name`: its result, or None if it failed."""
        job = self.jobs[name]
        try:
            self._send(job, "END")
            result = self._expect(job, "RESULT")
            job.proc.wait(timeout=self.timeout_s)
            if job.proc.returncode != 0:
                raise JobFailed(f"{name}: exited with {job.proc.returncode}")
            return result
        except (JobFailed, OSError, ValueError, subprocess.TimeoutExpired) as e:
            self._fail(job, str(e))
            return None

    def take_turns(self, steps: int, after_round: Optional[Callable[[int, dict], None]] = None
                   ) -> dict[str, list[dict]]:
        """`steps` rounds of one step per running job: {job: its step reports}. Round i starts with
        the i-th job (in start order) and goes round from there, so every job takes every place in the
        round equally often: on this VM the job that went first in each round came out faster in both
        orders of a pairing, so a fixed order would hand one job that edge. after_round(i, reports)
        runs after round i, every job asleep."""
        reports: dict[str, list[dict]] = {name: [] for name in self.jobs}
        for i in range(steps):
            running = self.running()
            k = i % len(running) if running else 0
            for name in running[k:] + running[:k]:
                info = self.step(name)
                if info is not None:
                    reports[name].append(info)
            if after_round is not None:
                after_round(i, reports)
        return reports

    def finish_all(self) -> dict[str, dict]:
        """Ends every running job: {job: its result}, without the jobs that failed at the end."""
        results = {name: self.finish(name) for name in self.running()}
        return {name: r for name, r in results.items() if r is not None}

    def close(self) -> None:
        for job in self.jobs.values():
            _kill(job.proc)
            job.log.close()
        self.server.close()


def _kill(proc: subprocess.Popen) -> None:
    """Ends a job's whole process group (a launcher and its ranks), if anything of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class Turns:
    """A job's side. Rank 0 talks to the driver; with torch.distributed up, the other ranks learn
    each command from a broadcast (blocking: they sleep while other jobs run)."""

    def __init__(self, spec: str):
        port, self.name = spec.split(":", 1)
        import torch.distributed as dist
        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.conn = self.reader = None
        self.pending: Optional[dict] = None
        if self.rank == 0:
            self.conn = socket.create_connection(("127.0.0.1", int(port)))
            self.reader = self.conn.makefile("r")
            self.conn.sendall(f"READY {self.name}\n".encode())

    def _command(self) -> str:
        """Reports the last step (if any) and blocks for the next command, on every rank."""
        import torch
        word = ""
        multi = self.dist is not None and self.dist.get_world_size() > 1
        if multi and self.pending is not None:  # the step is done when every rank is done with it
            self.dist.barrier()
        if self.rank == 0:
            if self.pending is not None:
                self.conn.sendall(f"DONE {json.dumps(self.pending)}\n".encode())
            word = self.reader.readline().strip()
        self.pending = None
        if multi:
            flag = torch.tensor([1 if word == "STEP" else 0])
            self.dist.broadcast(flag, 0)
            word = "STEP" if int(flag) else "END"
        return word

    def wait(self) -> None:
        """Before a step: blocks until this job's turn. Raises if the driver ends the job instead."""
        if self._command() != "STEP":
            raise JobFailed(f"{self.name}: the driver ended the job before its steps were done")

    def report(self, info: dict) -> None:
        """After a step, on every rank: rank 0's info is what the driver gets back when this job next
        waits, once all ranks have finished the step."""
        self.pending = info

    def close(self, result: dict) -> None:
        """After the last step: waits for END, then hands the driver the job's result."""
        if self._command() != "END":
            raise JobFailed(f"{self.name}: the driver asked for more steps than the job runs")
        if self.rank == 0:
            self.conn.sendall(f"RESULT {json.dumps(result)}\n".encode())
            self.conn.close()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free localhost TCP port for a launcher's master port, below the kernel's ephemeral range:
    jobs started together open ephemeral ports for their own connections (gloo's), and one of those
    could take a port picked there (port 0) before its job's store binds it (EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def worker_env(threads: int, root) -> dict:
    """The environment of a job: DeepSpeed's CPU accelerator without a GPU, the package on the path,
    `threads` OpenMP threads per process."""
    e = dict(os.environ)
    e.setdefault("DS_ACCELERATOR", "cpu")
    e["PYTHONPATH"] = str(root) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = str(threads)
    return e


def train_in_turns(trainer, turns: Turns, info) -> None:
    """trainer.train() (the real loop: logging, checkpoints) with each train_step taken in this
    job's turn; info(record) is what each step reports to the driver."""
    inner = trainer.train_step

    def step_in_turn():
        turns.wait()
        record = inner()
        turns.report(info(record))
        return record

    trainer.train_step = step_in_turn
    try:
        trainer.train()
    finally:
        trainer.train_step = inner

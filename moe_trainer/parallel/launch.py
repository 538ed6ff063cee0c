"""Process-group start-up on any accelerator (DeepSpeed picks gloo on CPU, NCCL on GPU), and the one
line a failed collective ends the job with.

A collective that times out or loses a peer surfaces in one of two places. On gloo (and the CPU
shared-memory rings) the main thread raises DistError, and train.main reports it. On NCCL the main
thread usually sits in a device wait (`.tolist()`, `.item()`) while NCCL's watchdog thread finds the
timeout and ends the process: the main thread never sees an exception. Before the watchdog ends it,
though, it writes its rank into the rendezvous store (key `exception_dump`) and waits a minute for
flight-recorder dumps (NCCL_ENV pins that). CollectiveWatch, a thread of ours on every rank, polls
the store for that signal, and for a failure another rank reported, and ends the job the same way
in both cases: one rank prints one line naming the rank the collective failed on and the ranks that
never answered through the store (stopped, hung or dead), then every rank exits with 4.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

# NCCL's error handling, set before its process group is made unless the user set the variable (or
# its older alias, which torch reads too)
NCCL_ENV = {
    # torch's default, pinned: after a timeout the watchdog ends the process without aborting the
    # communicators first (ncclCommAbort can hang itself); 2 (clean up only) would let a main thread
    # that read an aborted collective's garbage run on
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # the watchdog writes its rank to the store, then waits 4 x this (60 s) before ending the
    # process: the window in which CollectiveWatch prints the job's line and exits first
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000",
    # every rank's monitor thread watches that key and ends its process too, if nothing does sooner
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # the monitor ends a process whose watchdog is itself stuck (in a CUDA call) for 8 minutes
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}
NCCL_ALIASES = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING"}
NCCL_SIGNAL = "exception_dump"  # ProcessGroupNCCL's kStoreDumpKey, in the store under every prefix
EXIT_CODE = 4  # a failed collective (train.main's exit status for it)


def nccl_environment(environ=os.environ) -> dict[str, str]:
    """Set the NCCL_ENV variables that `environ` lacks (before the NCCL process group is made: torch
    reads them when it builds it); returns the ones it set."""
    added = {k: v for k, v in NCCL_ENV.items() if k not in environ and NCCL_ALIASES.get(k, k) not in environ}
    environ.update(added)
    return added


def init_distributed(timeout_s: int) -> None:
    """deepspeed.init_distributed with the collective timeout, then tidy up after it, and the
    CollectiveWatch of a multi-rank job.

    torchrun does not set LOCAL_SIZE, which DeepSpeed's CPU shared-memory op
    reads (it crashes without it); copy it from LOCAL_WORLD_SIZE.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    if get_accelerator().communication_backend_name() == "nccl":
        nccl_environment()
    deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    dist.barrier()  # every rank has mapped every peer's shared-memory segment by now
    unlink_shm_segment(dist.get_rank())
    if dist.get_world_size() > 1:
        _WATCH.append(CollectiveWatch(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                                      dist.get_world_size(), timeout_s))
        _WATCH[0].start()


def shutdown_distributed() -> None:
    """End a finished run on every rank together: a barrier, then the process group torn down.

    Ranks that simply exit leave their peers' gloo connections to break under them; a
    rank still tearing down its own process group (e.g. rank 0 after writing the pipeline
    trace) could then abort in C++ ("terminate called without an active exception",
    exit -6) after a run that succeeded."""
    while _WATCH:
        _WATCH.pop().stop()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def unlink_shm_segment(rank: int) -> None:
    """DeepSpeed's CPU accelerator never unlinks its ~66 MB /dev/shm workspace per
    rank, so every launch leaks RAM until reboot. Once all ranks have mapped it
    the name can go; the mappings stay valid."""
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}"
            f"_{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


# ----------------------------------------------------------------------------- a failed collective

_WATCH: list["CollectiveWatch"] = []  # this process's watch (one, from init_distributed to shutdown)
# this rank's heartbeat: the main thread's last progress mark (a counter every rank advances through the
# same marks in the same order), its step and phase. Set by the trainer (a dict update, no I/O); the
# watch thread sends it with its answer, so a hung main thread is told apart from one waiting in a collective
_PROGRESS = {"mark": 0, "step": 0, "phase": "start-up"}


def progress(step: int, phase: str) -> None:
    """The main thread reached `phase` of `step` (the trainer calls this at a few points per step)."""
    _PROGRESS.update(mark=_PROGRESS["mark"] + 1, step=step, phase=phase)


def _parse_answer(answer: str) -> tuple[str, Optional[int], str]:
    """'alive|<mark>|<step>|<phase>' -> (what, mark, 'step S: phase'); a bare 'alive' / 'failed' too."""
    parts = answer.split("|", 3)
    if len(parts) < 4:
        return parts[0], None, ""
    return parts[0], int(parts[1]), f"step {parts[2]}: {parts[3]}"


def _behind(answers: dict[int, str]) -> list[tuple[int, str]]:
    """The answered ranks whose main thread is behind the others' progress marks (stalled there)."""
    marks = {r: _parse_answer(a) for r, a in answers.items()}
    known = {r: m for r, (_, m, _) in marks.items() if m is not None}
    if not known or min(known.values()) == max(known.values()):
        return []
    low = min(known.values())
    return [(r, marks[r][2]) for r in sorted(known) if known[r] == low]


def failure_line(origin: int, reason: str, timeout_s: float, answers: Optional[dict[int, str]] = None,
                 world: int = 1, store_down: bool = False) -> str:
    """The job's one line for a collective that failed on rank `origin` (pure). answers: what the
    ranks left in the store (rank -> "failed" or "alive"; None: nothing read); store_down: the store
    did not answer."""
    line = (f"error: rank {origin}: a collective failed ({reason}); a peer rank died or waited longer than "
            f"parallel.timeout_s={timeout_s:g} s.")
    if store_down:
        return line + " The rendezvous store did not answer either: its host (rank 0, or torchrun's agent) is gone."
    if answers is None:
        return line
    silent = [r for r in range(world) if r not in answers]
    failed = [r for r in sorted(answers) if _parse_answer(answers[r])[0] == "failed" and r != origin]
    if failed:
        line += f" Rank(s) {_ranks(failed)} saw it fail too."
    behind = _behind(answers)
    if behind:
        where = behind[0][1]
        line += (f" Rank(s) {_ranks([r for r, _ in behind])} stopped making progress (at {where}) while the "
                 f"others went on to a collective: the likely cause.")
    if silent:
        return line + (f" Rank(s) {_ranks(silent)} never answered through the rendezvous store: stopped, hung "
                       f"or dead, the likely cause.")
    return line + " Every rank answered through the rendezvous store: look for one that skipped a collective."


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def report_collective_failure(error: BaseException, rank: int, timeout_s: float) -> None:
    """train.main, on a DistError in its main thread: the job's line goes to stderr, from this rank
    or from the one that reports the failure for every rank (CollectiveWatch.fail)."""
    text = str(error).strip()
    reason = (text.splitlines()[0] if text else type(error).__name__)[:300]
    if _WATCH:
        _WATCH[0].fail(reason, origin=rank)
    else:  # one rank, or no process group yet
        _print(failure_line(rank, reason, timeout_s))


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class CollectiveWatch:
    """One thread per rank that ends the job when a collective fails anywhere (module docstring).

    The store keys (under moe_trainer/failure/<attempt>/, so a torchrun restart starts clean):
    `first` (who reports: the first rank to compare_set it), `rank/<r>` (each rank's answer:
    "failed" if a collective failed on it, "alive" otherwise), `printed` (the line is out), `bye/<r>`
    (rank r asks the store nothing more: its host waits for these before it exits)."""

    POLL_S = 2.0  # two store checks per rank per interval while training: TCP round trips, no device sync
    ANSWER_S = 5.0  # how long the reporting rank waits for the others' answers before it prints

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        # a connection of our own with a short timeout: the process group's keeps its own, and a rank
        # that hosts the store may be stopped or gone
        self.store = store.clone()
        self.store.set_timeout(timedelta(seconds=self.ANSWER_S))
        root = self.store
        while hasattr(root, "underlying_store"):  # NCCL's signal lives in the store under every prefix
            root = root.underlying_store
        self.root = root
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.prefix = f"moe_trainer/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        # an earlier attempt's signal (torchrun restarts keep their store) is not this attempt's; on other
        # back ends nothing writes the key, but watching it costs one check and lets gloo tests drive this path
        self.stale_signal = self._check(self.root, NCCL_SIGNAL)
        self.done = threading.Event()
        self.lock = threading.RLock()  # fail() runs inside _signalled's hold
        self.reported = False
        self.thread = threading.Thread(target=self._run, name="moe_trainer-collective-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=2 * self.POLL_S)

    def _check(self, store, key: str) -> bool:
        try:
            return store.check([key])
        except RuntimeError:  # DistError and its kin: the store is unreachable
            return False

    def _run(self) -> None:
        while not self.done.wait(self.POLL_S):
            if self._check(self.store, self.prefix + "first"):
                self._follow()
            if not self.stale_signal and self._check(self.root, NCCL_SIGNAL):
                self._signalled()

    def _signalled(self) -> None:
        """NCCL's watchdog on some rank found a collective timed out or failed: report it, end this process."""
        try:
            origin = int.from_bytes(self.root.get(NCCL_SIGNAL)[:4], sys.byteorder, signed=True)
        except RuntimeError:
            origin = self.rank
        with self.lock:
            if self.reported:
                return  # this rank's main thread reports one of its own
            self.fail("timed out or hit an error: NCCL's watchdog signalled it through the store", origin)
            self._end()

    def _follow(self) -> None:
        """Another rank reports a failure: answer, wait until its line is out, end this process."""
        with self.lock:
            if self.reported:
                return  # this rank's main thread reports one of its own
            self.reported = True
            self._answer("alive")
            self._wait_for(self.prefix + "printed", self.ANSWER_S + 5)
            self._leave()
            self._end()

    def _end(self) -> None:
        """End the process from this thread: the main thread may be stuck in a device wait that only
        the end of the process ends."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def _answer(self, what: str) -> None:
        beat = f"{what}|{_PROGRESS['mark']}|{_PROGRESS['step']}|{_PROGRESS['phase']}"
        try:
            self.store.set(f"{self.prefix}rank/{self.rank}", beat)
        except RuntimeError:
            pass

    def fail(self, reason: str, origin: int) -> None:
        """A collective failed on rank `origin` (this rank's own, or NCCL's signal). The first rank to
        claim the report prints the job's line once the others answered (or ANSWER_S passed); the
        others return once it is printed (or ANSWER_S and a few seconds later), so that none ends
        first and has the launcher end the reporting rank before it prints. Once per process."""
        with self.lock:
            if self.reported:
                return
            self.reported = True
            self._answer("failed" if origin == self.rank else "alive")
            mine = f"{self.rank}|{origin}|{reason}"
            try:
                claimed = self.store.compare_set(self.prefix + "first", "", mine).decode() == mine
            except RuntimeError:  # no store to agree through: every rank prints its own line
                _print(failure_line(origin, reason, self.timeout_s, store_down=True))
                return
            if not claimed:
                self._wait_for(self.prefix + "printed", self.ANSWER_S + 5)
                self._leave()
                return
            _print(failure_line(origin, reason, self.timeout_s, self._answers(), self.world))
            try:
                self.store.set(self.prefix + "printed", "1")
            except RuntimeError:
                pass
            self._leave()

    def _leave(self) -> None:
        """The last use of the store on this rank; the host of the store (rank 0, under the DeepSpeed
        launcher) leaves last. A rank that asks a store whose host has exited gets an error that
        torch's C++ logs with a 25-line stack trace beside the job's line: so every other rank says
        goodbye and stops asking, and the host waits for the goodbyes of the ranks that answered
        (the silent ones ask nothing), at most ANSWER_S."""
        self.done.set()  # the polling loop asks nothing more
        if self.rank != 0:
            try:
                self.store.set(f"{self.prefix}bye/{self.rank}", "1")
            except RuntimeError:
                pass
            return
        try:
            alive = [r for r in range(1, self.world) if self.store.check([f"{self.prefix}rank/{r}"])]
        except RuntimeError:
            return
        self._wait_for([f"{self.prefix}bye/{r}" for r in alive], self.ANSWER_S)

    def _answers(self) -> Optional[dict[int, str]]:
        """rank -> its answer, after every rank answered or ANSWER_S passed (None: unreadable)."""
        keys = [f"{self.prefix}rank/{r}" for r in range(self.world)]
        self._wait_for(keys, self.ANSWER_S)
        try:
            return {r: self.store.get(k).decode() for r, k in enumerate(keys) if self.store.check([k])}
        except RuntimeError:
            return None

    def _wait_for(self, keys, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        keys = [keys] if isinstance(keys, str) else keys
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return
            except RuntimeError:
                return
            time.sleep(0.2)

"""Collective benchmark (issue #8): an nccl-tests-style table for the backend
DeepSpeed picks on this accelerator (gloo on CPU, NCCL on GPU).

Launch one process per rank:
    deepspeed --num_gpus 2 tools/bench_collectives.py [--min-bytes 1K --max-bytes 64M ...]
    torchrun --nproc-per-node 2 tools/bench_collectives.py [...]

For every message size it times broadcast, all-reduce, reduce-scatter,
all-gather, all-to-all (even and uneven splits), send/recv ping-pong, the
reduce-scatter + all-gather decomposition of all-reduce, and DeepSpeed's
shared-memory all-reduce where the CPU accelerator has it. It also checks,
bitwise, that reduce-scatter + all-gather equals all-reduce (the lecture's
decomposition) and that both equal the sum computed locally.

Conventions follow nccl-tests: `size` is the full buffer (the all-reduce
buffer, the reduce-scatter input, the all-gather output, one rank's
all-to-all send buffer); algbw = size / time; busbw = algbw * factor, with
factor 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter, all-gather and
all-to-all, 1 for broadcast and send/recv. Each of `trials` trials times
`iters` back-to-back calls on every rank and keeps the slowest rank's mean;
the table shows the median trial (and the fastest and slowest), because a
shared CPU host makes single means jumpy.

Why one module of ~580 lines: one command, read in the order it runs (sizes, one builder per
collective, timing, the decomposition check, the report); each piece is short and only this
benchmark uses them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Uneven all-to-all: every sender gives the "hot" rank 0 this many shares and
# every other rank one share, as when one rank hosts a popular expert. Rank 0
# then receives 2n/(n+1) times the even load (4/3 with two ranks).
HOT_RANK_WEIGHT = 2

# Sizes reported in the conclusions (the lecture's and issue #8's 16 MB).
HEADLINE_BYTES = 16 << 20

_SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernel's types


# ---------------------------------------------------------------------------
# Pure helpers: sizes, splits, bandwidth factors.
# ---------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """'64K' / '16M' / '1G' / '4096' -> bytes (binary multiples)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    return int(float(digits) * scale)


def format_bytes(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Geometric ladder min_bytes, min_bytes*factor, ... up to max_bytes."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad size range {min_bytes}..{max_bytes} x{factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def element_count(nbytes: int, elem_size: int, world_size: int) -> int:
    """Elements in a `nbytes` buffer, rounded down to a multiple of the world
    size so it shards evenly (at least one element per rank)."""
    return max(nbytes // elem_size // world_size, 1) * world_size


def uneven_splits(count: int, world_size: int) -> list[list[int]]:
    """(n, n) matrix: splits[s][d] elements rank s sends to rank d.

    Every row sums to `count` (each rank sends as much as in the even case);
    column 0 gets HOT_RANK_WEIGHT shares, the others one share each.
    """
    weights = [HOT_RANK_WEIGHT] + [1] * (world_size - 1)
    row = [count * w // sum(weights) for w in weights]
    row[-1] += count - sum(row)
    return [list(row) for _ in range(world_size)]


def _all_reduce_factor(n: int) -> float:
    return 2 * (n - 1) / n


def _shard_factor(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


# ---------------------------------------------------------------------------
# The collectives: each builder allocates its buffers once for a message size
# and returns a closure that runs one call.
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    backend: str


Call = Callable[[], None]


def _zeros(env: Env, count: int) -> torch.Tensor:
    # Zeros stay zero under repeated in-place sums: no fp16 overflow to inf.
    return torch.zeros(count, dtype=env.dtype, device=env.device)


def build_broadcast(env: Env, count: int) -> Call:
    buf = _zeros(env, count)
    return lambda: dist.broadcast(buf, src=0)


def build_all_reduce(env: Env, count: int) -> Call:
    buf = _zeros(env, count)
    return lambda: dist.all_reduce(buf)


def build_reduce_scatter(env: Env, count: int) -> Call:
    full, shard = _zeros(env, count), _zeros(env, count // env.world_size)
    return lambda: dist.reduce_scatter_tensor(shard, full)


def build_all_gather(env: Env, count: int) -> Call:
    full, shard = _zeros(env, count), _zeros(env, count // env.world_size)
    return lambda: dist.all_gather_into_tensor(full, shard)


def build_rs_ag(env: Env, count: int) -> Call:
    """all-reduce as the lecture's decomposition: reduce-scatter, then all-gather."""
    full, shard, out = _zeros(env, count), _zeros(env, count // env.world_size), _zeros(env, count)

    def call() -> None:
        dist.reduce_scatter_tensor(shard, full)
        dist.all_gather_into_tensor(out, shard)
    return call


def build_all_to_all(env: Env, count: int) -> Call:
    send, recv = _zeros(env, count), _zeros(env, count)
    return lambda: dist.all_to_all_single(recv, send)


def build_all_to_all_uneven(env: Env, count: int) -> Call:
    splits = uneven_splits(count, env.world_size)
    in_splits = splits[env.rank]
    out_splits = [splits[src][env.rank] for src in range(env.world_size)]
    send, recv = _zeros(env, count), _zeros(env, sum(out_splits))
    return lambda: dist.all_to_all_single(recv, send, output_split_sizes=out_splits,
                                          input_split_sizes=in_splits)


def build_send_recv(env: Env, count: int) -> Call:
    """Ping-pong between ranks 2i and 2i+1; one call is a round trip (2 legs).
    With an odd world size the last rank sits out."""
    buf = _zeros(env, count)
    peer = env.rank ^ 1
    if peer >= env.world_size:
        return lambda: None
    if env.rank % 2 == 0:
        def call() -> None:
            dist.send(buf, peer)
            dist.recv(buf, peer)
    else:
        def call() -> None:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    return call


def build_all_reduce_shm(env: Env, count: int) -> Call:
    buf = _zeros(env, count)
    return lambda: dist.inference_all_reduce(buf)


@dataclass(frozen=True)
class Collective:
    name: str
    build: Callable[[Env, int], Call]
    bus_factor: Callable[[int], float]  # nccl-tests factor for world size n
    legs: int = 1  # transfers per call: the ping-pong makes 2


COLLECTIVES = [
    Collective("broadcast", build_broadcast, _one),
    Collective("all_reduce", build_all_reduce, _all_reduce_factor),
    Collective("reduce_scatter", build_reduce_scatter, _shard_factor),
    Collective("all_gather", build_all_gather, _shard_factor),
    Collective("rs_then_ag", build_rs_ag, _all_reduce_factor),
    Collective("all_to_all", build_all_to_all, _shard_factor),
    Collective("all_to_all_uneven", build_all_to_all_uneven, _shard_factor),
    Collective("send_recv", build_send_recv, _one, legs=2),
]
SHM_ALL_REDUCE = Collective("all_reduce_shm", build_all_reduce_shm, _all_reduce_factor)


def bus_factor(name: str, world_size: int) -> float:
    by_name = {c.name: c for c in COLLECTIVES + [SHM_ALL_REDUCE]}
    return by_name[name].bus_factor(world_size)


# ---------------------------------------------------------------------------
# Timing and checks.
# ---------------------------------------------------------------------------

def max_over_ranks(values: list[float], env: Env) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()  # host sync


def time_call(call: Call, iters: int, trials: int, warmup: int, env: Env) -> list[float]:
    """Seconds per call, one value per trial: in each trial every rank times
    `iters` back-to-back calls after a barrier, and the slowest rank's mean
    counts. Trials let a noisy, shared host be summarised by a median."""
    acc = get_accelerator()
    for _ in range(warmup):
        call()
    per_trial = []
    for _ in range(trials):
        acc.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        acc.synchronize()  # GPU collectives are asynchronous: wait for the last one
        per_trial.append((time.perf_counter() - start) / iters)
    return max_over_ranks(per_trial, env)


@dataclass
class Row:
    op: str
    bytes: int
    count: int
    time_us: float  # median over trials
    min_us: float
    max_us: float
    algbw_gbps: float  # from the median time
    busbw_gbps: float


def measure(coll: Collective, nbytes: int, cfg: BenchConfig, env: Env) -> Row:
    count = element_count(nbytes, env.dtype.itemsize, env.world_size)
    call = coll.build(env, count)
    trial_us = sorted(t / coll.legs * 1e6 for t in time_call(call, cfg.iters, cfg.trials, cfg.warmup, env))
    median = statistics.median(trial_us)
    size = count * env.dtype.itemsize
    algbw = size / median / 1e3  # bytes/us -> GB/s (1e9 bytes/s)
    return Row(coll.name, size, count, median, trial_us[0], trial_us[-1], algbw,
               algbw * coll.bus_factor(env.world_size))


def _rank_input(rank: int, count: int, seed: int, env: Env) -> torch.Tensor:
    """Integer values in [0, 4): sums over up to 64 ranks are exact even in
    bf16 (8-bit mantissa), so every reduction order gives the same bits."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    values = torch.randint(0, 4, (count,), generator=gen)
    return values.to(dtype=env.dtype, device=env.device)


def check_decomposition(nbytes: int, seed: int, with_shm: bool, env: Env) -> dict:
    """Bitwise checks on every rank, combined by a MIN over ranks:
    all_reduce == local reference sum, reduce-scatter + all-gather ==
    all_reduce, and (with_shm) the shared-memory all-reduce == all_reduce."""
    count = element_count(nbytes, env.dtype.itemsize, env.world_size)
    x = _rank_input(env.rank, count, seed, env)
    expected = sum(_rank_input(r, count, seed, env) for r in range(env.world_size))

    reduced = x.clone()
    dist.all_reduce(reduced)
    shard = torch.empty(count // env.world_size, dtype=env.dtype, device=env.device)
    gathered = torch.empty_like(x)
    dist.reduce_scatter_tensor(shard, x.clone())
    dist.all_gather_into_tensor(gathered, shard)
    flags = [torch.equal(reduced, expected), torch.equal(gathered, reduced)]
    if with_shm:
        shm = x.clone()
        dist.inference_all_reduce(shm)
        flags.append(torch.equal(shm, reduced))

    ok = torch.tensor(flags, dtype=torch.int32, device=env.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    ok = [bool(v) for v in ok.tolist()]  # host sync
    result = {"bytes": count * env.dtype.itemsize, "all_reduce_exact": ok[0], "rs_ag_equals_all_reduce": ok[1]}
    if with_shm:
        result["shm_equals_all_reduce"] = ok[2]
    return result


def shm_all_reduce_status(env: Env) -> tuple[bool, str]:
    """Whether deepspeed.comm.inference_all_reduce runs DeepSpeed's
    shared-memory kernel here. When it cannot, DeepSpeed silently falls back
    to the plain all-reduce, and with ranks not all on one host (LOCAL_SIZE !=
    world size) the kernel's workspace is never set up, so it must not run."""
    if get_accelerator().device_name() != "cpu":
        return False, f"the shared-memory all-reduce is a CPU-accelerator op (accelerator is {get_accelerator().device_name()})"
    if not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        return False, "DeepSpeed's deepspeed_shm_comm op is not built or not loaded"
    if env.dtype not in _SHM_DTYPES:
        return False, f"the kernel has no {env.dtype} path"
    local_size = int(os.environ.get("LOCAL_SIZE", "0"))
    if local_size != env.world_size:
        return False, f"ranks are not all on one host (LOCAL_SIZE={local_size}, world size {env.world_size})"
    level = getattr(dist.comm.cdb, "shm_vector_kernel_level", 0)
    needed = 1 if env.dtype == torch.float32 else 2  # avx2 for fp32, avx512bw for 16-bit
    if level < needed:
        return False, f"CPU lacks the vector ISA the kernel needs for {env.dtype} (level {level} < {needed})"
    return True, "DeepSpeed shared-memory kernel (deepspeed_shm_comm)"


def oversubscription(env: Env) -> Optional[str]:
    """A warning when this host's ranks run more threads than it has cores.
    DeepSpeed's shm kernel spins on flags inside OpenMP loops, so with
    oversubscribed cores it slows by orders of magnitude (seen: 2 ranks x 2
    threads on 2 cores under the deepspeed launcher, which leaves
    OMP_NUM_THREADS unset; torchrun sets it to 1)."""
    if get_accelerator().device_name() != "cpu":
        return None
    local_ranks = int(os.environ.get("LOCAL_SIZE", env.world_size))
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if local_ranks * threads <= cores:
        return None
    fix = (f"set OMP_NUM_THREADS={cores // local_ranks}" if local_ranks <= cores
           else "run at most one rank per core")
    return (f"{local_ranks} ranks x {threads} threads > {cores} cores: timings (the shm all-reduce above all) "
            f"suffer; {fix}")


def unlink_shm_segment(env: Env) -> None:
    """See parallel/launch.py: DeepSpeed leaks its /dev/shm workspace."""
    from ..parallel.launch import unlink_shm_segment as unlink
    unlink(env.rank)


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------

def headline_size(sizes: list[int]) -> int:
    """16 MB when measured, else the largest size."""
    return HEADLINE_BYTES if HEADLINE_BYTES in sizes else sizes[-1]


def _times(rows: list[Row], op: str) -> dict[int, float]:
    return {r.bytes: r.time_us for r in rows if r.op == op}


def compare(rows: list[Row], slow_op: str, base_op: str) -> dict[int, float]:
    """bytes -> time(slow_op) / time(base_op)."""
    slow, base = _times(rows, slow_op), _times(rows, base_op)
    return {b: slow[b] / base[b] for b in base if b in slow}


def _relative(time_ratio: float) -> str:
    """time(a) / time(b) -> 'N.Nx slower than' / 'N.Nx faster than'."""
    if time_ratio >= 1:
        return f"{time_ratio:.1f}x slower than"
    return f"{1 / time_ratio:.1f}x faster than"


def conclusions(rows: list[Row], sizes: list[int], backend: str, env: Env,
                shm_ok: bool, shm_reason: str) -> list[str]:
    size_of = {nbytes: element_count(nbytes, env.dtype.itemsize, env.world_size) * env.dtype.itemsize
               for nbytes in sizes}
    head = size_of[headline_size(sizes)]
    label = format_bytes(head) + "B"
    rs_ag = compare(rows, "rs_then_ag", "all_reduce")
    rs = compare(rows, "reduce_scatter", "all_reduce")
    lines = [
        f"on {backend}, reduce-scatter + all-gather is {_relative(rs_ag[head])} all-reduce at {label} "
        f"({_times(rows, 'rs_then_ag')[head]:.0f} us vs {_times(rows, 'all_reduce')[head]:.0f} us, {env.world_size} ranks)",
        f"on {backend}, reduce-scatter alone takes {rs[head]:.2f}x the time of a full all-reduce at {label}",
    ]
    if not shm_ok:
        lines.append(f"DeepSpeed shared-memory all-reduce: unavailable ({shm_reason})")
        return lines
    shm = compare(rows, "all_reduce_shm", "all_reduce")
    largest = size_of[sizes[-1]]
    tail = "" if largest == head else f" ({_relative(shm[largest]).removesuffix(' than')} at {format_bytes(largest)}B)"
    lines.append(f"DeepSpeed shared-memory all-reduce (inference_all_reduce) is {_relative(shm[head])} "
                 f"{backend} all-reduce at {label}{tail}")
    return lines


def format_table(rows: list[Row], world_size: int) -> str:
    out = []
    for op in dict.fromkeys(r.op for r in rows):
        factor = bus_factor(op, world_size)
        out.append(f"# {op}  (busbw = algbw x {factor:.3g})")
        out.append(f"{'size':>6} {'bytes':>10} {'count':>9} {'time(us)':>10} {'min(us)':>10} {'max(us)':>10} "
                   f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
        for r in rows:
            if r.op == op:
                out.append(f"{format_bytes(r.bytes):>6} {r.bytes:>10} {r.count:>9} {r.time_us:>10.1f} "
                           f"{r.min_us:>10.1f} {r.max_us:>10.1f} {r.algbw_gbps:>12.3f} {r.busbw_gbps:>12.3f}")
        out.append("")
    return "\n".join(out)


def write_json_atomic(path: str, payload: dict) -> None:
    """Write to a temporary file in the target directory, then rename over
    `path`: readers see the old file or the complete new one, never a part."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".bench_collectives.", suffix=".json", dir=directory)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------

@dataclass
class BenchConfig:
    min_bytes: int = 1 << 10
    max_bytes: int = 64 << 20
    factor: int = 4
    iters: int = 10
    trials: int = 5
    warmup: int = 3
    dtype: str = "float32"
    json: Optional[str] = None
    seed: int = 0


def parse_args(argv: Optional[list[str]] = None) -> BenchConfig:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=parse_bytes, default=d.min_bytes, help="smallest message, e.g. 1K (default 1K)")
    p.add_argument("--max-bytes", type=parse_bytes, default=d.max_bytes, help="largest message, e.g. 64M (default 64M)")
    p.add_argument("--factor", type=int, default=d.factor, choices=(2, 4), help="size step (default 4)")
    p.add_argument("--iters", type=int, default=d.iters, help=f"timed calls per trial (default {d.iters})")
    p.add_argument("--trials", type=int, default=d.trials, help=f"trials per size; the median is reported (default {d.trials})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"untimed calls first (default {d.warmup})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype)
    p.add_argument("--json", default=None, help="write all results here (rank 0, atomically)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the check inputs")
    # The deepspeed launcher appends --local_rank=K; the rank comes from the environment.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.iters < 1 or a.trials < 1 or a.warmup < 0:
        p.error("--iters and --trials must be >= 1, --warmup >= 0")
    try:
        message_sizes(a.min_bytes, a.max_bytes, a.factor)
    except ValueError as e:
        p.error(str(e))
    return BenchConfig(a.min_bytes, a.max_bytes, a.factor, a.iters, a.trials, a.warmup, a.dtype, a.json, a.seed)


def init_env(dtype: str) -> Env:
    # torchrun sets LOCAL_WORLD_SIZE; DeepSpeed's shm op only sets itself up when
    # LOCAL_SIZE (set by the deepspeed launcher) equals the world size.
    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    deepspeed.init_distributed(verbose=False)
    acc = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    acc.set_device(local_rank)
    env = Env(dist.get_rank(), dist.get_world_size(), torch.device(acc.device_name(local_rank)),
              DTYPES[dtype], torch.distributed.get_backend())
    dist.barrier()  # every rank has mapped every peer's shm segment by now
    unlink_shm_segment(env)
    return env


def _load_average() -> Optional[float]:
    """1-minute host load: other processes on a shared CPU host distort timings."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def run(cfg: BenchConfig, env: Env) -> dict:
    """Run checks and timings on every rank; returns the report (same on all ranks)."""
    sizes = message_sizes(cfg.min_bytes, cfg.max_bytes, cfg.factor)
    shm_ok, shm_reason = shm_all_reduce_status(env)
    load_before = _load_average()
    checks = [check_decomposition(nbytes, cfg.seed, shm_ok, env) for nbytes in sizes]
    collectives = COLLECTIVES + ([SHM_ALL_REDUCE] if shm_ok else [])
    # Sizes outer, collectives inner: the ops compared at one size are timed
    # seconds apart, so a shared host's load drifts less between them.
    rows = [measure(c, nbytes, cfg, env) for nbytes in sizes for c in collectives]
    passed = all(all(v for k, v in c.items() if k != "bytes") for c in checks)
    return {
        "meta": {
            "backend": env.backend, "accelerator": get_accelerator().device_name(),
            "world_size": env.world_size, "dtype": cfg.dtype, "iters": cfg.iters, "trials": cfg.trials, "warmup": cfg.warmup,
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "torch_threads": torch.get_num_threads(), "oversubscribed": oversubscription(env),
            "load_average_1min": {"before": load_before, "after": _load_average()}, "argv": sys.argv,
            "time": "per call: median over trials of the slowest rank's mean; send_recv: one leg (half a round trip)",
        },
        "results": [asdict(r) for r in rows],
        "checks": {"passed": passed, "per_size": checks},
        "rs_ag_over_all_reduce": {str(b): v for b, v in compare(rows, "rs_then_ag", "all_reduce").items()},
        "shm_all_reduce": {
            "available": shm_ok, "detail": shm_reason,
            "speedup_over_all_reduce": {str(b): 1 / v for b, v in
                                        compare(rows, "all_reduce_shm", "all_reduce").items()},
        },
        "conclusions": conclusions(rows, sizes, env.backend, env, shm_ok, shm_reason),
    }


def print_report(report: dict) -> None:
    meta = report["meta"]
    rows = [Row(**r) for r in report["results"]]
    print(f"# collectives: backend {meta['backend']} on {meta['accelerator']}, {meta['world_size']} ranks, "
          f"dtype {meta['dtype']}, {meta['trials']} trials x {meta['iters']} iters, warmup {meta['warmup']}, "
          f"torch threads/rank {meta['torch_threads']}, host load (1 min) "
          f"{meta['load_average_1min']['before']} before / {meta['load_average_1min']['after']} after")
    print(f"# time: {meta['time']}; GB/s = 1e9 bytes/s; uneven all-to-all: rank 0 gets "
          f"{HOT_RANK_WEIGHT} shares of every send, others 1")
    print()
    if meta["oversubscribed"]:
        print(f"# WARNING: {meta['oversubscribed']}\n")
    print(format_table(rows, meta["world_size"]))
    print("# rs_then_ag / all_reduce time: " + ", ".join(
        f"{format_bytes(int(b))}B {v:.2f}x" for b, v in report["rs_ag_over_all_reduce"].items()))
    shm = report["shm_all_reduce"]
    if shm["available"]:
        print("# all_reduce / all_reduce_shm time (shm speed-up): " + ", ".join(
            f"{format_bytes(int(b))}B {v:.2f}x" for b, v in shm["speedup_over_all_reduce"].items()))
    checks = report["checks"]
    what = "reduce-scatter + all-gather == all-reduce == local sum"
    what += ", shm all-reduce == all-reduce" if shm["available"] else ""
    print(f"# check ({what}, bitwise, {len(checks['per_size'])} sizes): "
          f"{'PASS' if checks['passed'] else 'FAIL'}")
    for line in report["conclusions"]:
        print(f"# {line}")


def main(argv: Optional[list[str]] = None) -> int:
    cfg = parse_args(argv)
    env = init_env(cfg.dtype)
    report = run(cfg, env)
    if env.rank == 0:
        print_report(report)
        if cfg.json:
            write_json_atomic(cfg.json, report)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if report["checks"]["passed"] else 1

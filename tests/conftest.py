"""Shared test helpers: launching the real trainer and reading what it leaves."""
from __future__ import annotations

import atexit
import base64
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest

# master ports below the ephemeral range: a concurrent job's own connections never take one first
from moe_trainer.bench.turns import free_port, worker_env  # noqa: F401  (free_port: used by the tests)
from zygote import WARM

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# The heaviest test files (minutes of real launchers, dry runs and ranks each; a fresh-clone suite's
# durations, 2026-12-07), collected first so that scripts/test.sh's two workers (--dist loadfile: whole
# files, handed out in collection order) end together instead of one running a big file alone while the
# other idles (scripts/test.sh turns off xdist's own reordering, which hands out the files with the most
# tests first).
HEAVY_FIRST = ("test_fault_drill.py", "test_dry_run_path.py", "test_checkpoint_reshard.py", "test_dry_run.py",
               "test_reliability.py", "test_replace.py", "test_compile.py", "test_faults.py", "test_pp_parity.py",
               "test_multinode.py", "test_overlap.py", "test_expert_placement.py", "test_plan_time.py")


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order


# a tiny MoE that trains in seconds on one core
TINY = [
    "model.hidden_size=64", "model.num_hidden_layers=3", "model.num_attention_heads=2",
    "model.intermediate_size=128", "model.q_lora_rank=32", "model.kv_lora_rank=32",
    "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16", "model.v_head_dim=16",
    "model.n_routed_experts=8", "model.num_experts_per_tok=2", "model.n_group=2", "model.topk_group=1",
    "model.moe_intermediate_size=32", "train.seq_len=32", "train.micro_batch_size=2",
    "train.global_batch_size=8", "train.warmup_steps=2", "train.eval_batches=1", "train.log_every=1",
    "train.eval_every=0", "train.checkpoint_every=0", "train.resume=none", "metrics.peak_tflops=1.0",
]


# The in-process distributed tests' ranks start from multiprocessing's fork server (one per test
# worker) that has imported what the zygote's launched ranks have (zygote.WARM) and this module once:
# a freshly spawned rank spent seconds of a core importing them itself, most of a small distributed
# test's time. Each rank still runs in a process of its own, in the environment of the moment it was
# started (_in_environment), as a spawned one did.
RANK_PRELOAD = [*WARM, "conftest"]


def _in_environment(rank: int, fn, environ: dict, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def start_ranks(fn, world: int, *args) -> None:
    """Run fn(rank, *args) on `world` processes started from the fork server (RANK_PRELOAD); an
    exception in a rank is raised here, as torch.multiprocessing.spawn raises it."""
    import multiprocessing
    import torch.multiprocessing as mp
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts, once
    mp.start_processes(_in_environment, args=(fn, dict(os.environ), *args), nprocs=world, join=True,
                       start_method="forkserver")


def spawn_ranks(fn, world: int, *args) -> dict:
    """Run fn(rank, world, port, *args, results) on `world` processes (start_ranks); returns what the
    ranks stored in `results` (a shared dict keyed by rank)."""
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    start_ranks(fn, world, world, free_port(), *args, results)
    return dict(results)


def env() -> dict:
    """A launched job's environment: DeepSpeed's CPU accelerator without a GPU, this checkout and
    tests/ (nccl_p2p_rule) on the path, one OpenMP thread per process."""
    e = worker_env(1, ROOT)
    e["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + e["PYTHONPATH"]
    return e


def launch(n: int, out_dir: Path, overrides: list[str], config: str = "configs/moe_tiny.yaml",
           timeout: int = 300, launcher: str = "deepspeed", max_restarts: Optional[int] = None,
           real: bool = False) -> subprocess.CompletedProcess:
    """Run the trainer under a launcher with n ranks; returns the finished process.

    "deepspeed" is DeepSpeed's per-node launcher (deepspeed.launcher.launch: it spawns the
    ranks, sets their environment and ends them all when one fails), started the way the
    `deepspeed` command starts it on a single node; "deepspeed-cli" goes through that command
    itself (its runner only adds a second `import deepspeed`, ~2 s of one core per launch, which
    the run-directory and launcher tests still pay). Under "deepspeed" and "torchrun" every rank
    runs the trainer with torch.distributed's point-to-point calls held to NCCL's rule
    (tests/nccl_p2p_rule.py): a pipeline order that deadlocks on GPUs fails here.

    "deepspeed" and "python" jobs are started by this worker's warm zygote (tests/zygote.py: the
    ranks fork()ed with their imports done, in the environment DeepSpeed's launcher gives them),
    unless `real` asks for the launcher's own processes; the restart wrapper always starts them."""
    args = [f"--config={config}"] + [a for o in overrides + [f"run.out_dir={out_dir}"] for a in ("--set", o)]
    if launcher in ("deepspeed", "python") and max_restarts is None and not real:
        e = env()
        _zygote_for(e)
        return _zygote_launch(n if launcher == "deepspeed" else 0,
                              "nccl_p2p_rule" if launcher == "deepspeed" else "moe_trainer.train", args, e, timeout)
    if launcher == "deepspeed-cli":
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(n), "--master_port", str(free_port()),
               "--module", "moe_trainer.train", *args]
    elif launcher == "deepspeed":
        world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(n))}).encode()).decode()
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--module", "nccl_p2p_rule", *args]
    elif launcher == "torchrun":
        cmd = [str(VENV_BIN / "torchrun"), f"--nproc-per-node={n}", f"--master-port={free_port()}",
               "-m", "nccl_p2p_rule", *args]
    else:
        cmd = [sys.executable, "-m", "moe_trainer.train", *args]
    if max_restarts is not None:  # under the restart wrapper (scripts/train.sh --max-restarts K)
        cmd = [sys.executable, "-m", "moe_trainer.restart", "--max-restarts", str(max_restarts), "--", *cmd]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


_ZYGOTE: dict = {}
_PER_TEST = ("PYTEST_CURRENT_TEST",)  # pytest's name of the running test: the only variable that changes per test


def _stable(e: dict) -> dict:
    return {k: v for k, v in e.items() if k not in _PER_TEST}


def _zygote_for(e: dict) -> None:
    """This worker's zygote, started in environment `e` (a zygote started in another one is replaced:
    what its imports read from the environment would not be this one's)."""
    z = _ZYGOTE.get("proc")
    if z is not None and z.poll() is None and _ZYGOTE["env"] == _stable(e):
        return
    if z is not None:
        z.kill()
        z.wait()
    z = subprocess.Popen([sys.executable, "-u", "-m", "zygote"], cwd=ROOT, env=e, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, bufsize=0)
    _ZYGOTE.update(proc=z, env=_stable(e), buf=b"")
    ready = _zygote_reply(120)
    if ready is None or "ready" not in ready:
        z.kill()
        raise RuntimeError(f"the tests' zygote did not start: {ready!r}")
    atexit.register(z.kill)


def _zygote_reply(timeout: Optional[float]) -> Optional[dict]:
    """The zygote's next reply line, or None when `timeout` seconds pass without one."""
    fd = _ZYGOTE["proc"].stdout.fileno()
    while b"\n" not in _ZYGOTE["buf"]:
        if not select.select([fd], [], [], timeout)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError("the tests' zygote ended")
        _ZYGOTE["buf"] += chunk
    line, _ZYGOTE["buf"] = _ZYGOTE["buf"].split(b"\n", 1)
    return json.loads(line)


def _zygote_launch(n: int, module: str, args: list[str], e: dict, timeout: float) -> subprocess.CompletedProcess:
    """One job started by the zygote (n = 0: one process without rank variables, as `python -m`)."""
    z = _ZYGOTE["proc"]
    cmd = ["zygote", f"n={n}", "-m", module, *args]
    pid = None
    with tempfile.TemporaryDirectory(prefix="job_") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        try:
            z.stdin.write((json.dumps({"module": module, "args": args, "n": n, "port": free_port(), "env": e,
                                       "cwd": str(ROOT), "stdout": str(out), "stderr": str(err)}) + "\n").encode())
            z.stdin.flush()
            pid = _zygote_reply(None)["pid"]
            done = _zygote_reply(timeout)
        except BaseException:  # interrupted (a pytest timeout, ^C): end the job, and the zygote with its replies
            if pid is not None:
                _kill_group(pid)
            z.kill()
            z.wait()
            raise
        if done is None:  # past the timeout: the job ends as subprocess.run's would
            _kill_group(pid)
            _zygote_reply(None)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if done is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, done["rc"], stdout, stderr)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the job and its ranks: a session of their own
    except ProcessLookupError:
        pass


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line]


def train_losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


@pytest.fixture
def tiny():
    return list(TINY)


def ep_layer_parity_errors(layer, ref, out, ref_out, x, x_ref, rank: int, world: int, batch_per_rank: int,
                           n_experts: int) -> list[str]:
    """An expert-parallel MoE layer on this gloo rank against the single-rank `ref` that saw
    every rank's tokens: this rank's outputs and input grads, its experts' grads (the
    shard e in [rank * E/world, (rank+1) * E/world)), and the replicated parameters' grads
    summed over ranks. One line per mismatch (fp32, 1e-5)."""
    import torch
    import torch.distributed as dist
    sl = slice(batch_per_rank * rank, batch_per_rank * (rank + 1))  # this rank's sequences of the reference batch
    lo, n = rank * (n_experts // world), n_experts // world
    checks = {"output": (out, ref_out[sl]), "x.grad": (x.grad, x_ref.grad[sl])}
    for name in ("gate_up_proj", "down_proj"):
        checks[name] = (getattr(layer.experts, name).grad, getattr(ref.experts, name).grad[lo:lo + n])
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():  # replicated: each rank's grads cover its own tokens
        if not name.startswith("experts."):
            g = p.grad.clone()
            dist.all_reduce(g)
            checks[name] = (g, ref_params[name].grad)
    errors = []
    for name, (a, b) in checks.items():
        try:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        except AssertionError as e:
            errors.append(f"{name}: {str(e)[:300]}")
    return errors


# 5 steps of the tiny MoE with a checkpoint at step 5: what expert-parallel runs are compared with
MOE_STEPS = ["train.max_steps=5", "train.checkpoint_every=5"]


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory):
    """TINY + MOE_STEPS on one rank, trained once for every test file that compares with it."""
    out = tmp_path_factory.mktemp("moe_reference") / "one"
    check(launch(1, out, TINY + MOE_STEPS, launcher="python"))
    return out


def train_grad_norms(out_dir: Path) -> dict[int, float]:
    """Step -> the global gradient norm before clipping (metrics' `grad_norm`: DeepSpeed's
    get_global_grad_norm, the norm ZeRO computes from the dp-averaged gradients, summed over
    pipeline stages and tensor shards, before it scales them down to `train.grad_clip`)."""
    return {r["step"]: r["grad_norm"] for r in read_metrics(out_dir) if "loss" in r}


def assert_same_steps(one_dir: Path, many_dir: Path, steps=(1, 2, 3, 4, 5), rel: float = 1e-4) -> None:
    """The runs' training losses AND gradient norms before clipping agree to `rel` at every step.

    The losses alone cannot catch a gradient that is off by a uniform factor (summed instead of
    averaged over a group): clipping and Adam both normalise the scale away, so the updates, the
    losses and the weights stay equal. The norm before clipping keeps the scale."""
    for what, read in (("loss", train_losses), ("grad_norm", train_grad_norms)):
        one, many = read(one_dir), read(many_dir)
        assert sorted(many) == list(steps), (what, many)
        for s in steps:
            assert one[s] > 0 or what == "loss", (what, s, one[s])  # a norm of 0 would mean none was computed
            assert abs(one[s] - many[s]) <= rel * abs(one[s]), (what, s, one[s], many[s])


def checkpoint_weights(out_dir: Path, step: int = 5) -> dict:
    """The step's model weights, assembled from every rank's part (global names)."""
    from moe_trainer.checkpoint import read_full
    return read_full(Path(out_dir) / "checkpoints" / f"step_{step}")


def assert_same_final_weights(one_dir: Path, many_dir: Path, step: int = 5) -> None:
    """The step's checkpoints (every rank's part, under global names) hold equal weights: rtol 1e-4,
    atol 3e-5, 1% of one Adam step at moe_tiny's lr 3e-3. Adam divides each update by the gradient's
    own size, so an element whose gradient nearly cancels carries the rounding of the layouts'
    different reduction orders into its step (seen: one element of 8,192 off by 1.1e-5 after 5
    steps, on a Zen 3 CPU; with the data package's window order, one element of lm_head's 20,480 off by
    1.5e-4 in llama3 tp 2 x pp 2 x v 2, 5% of one Adam step). So: at most one element of a tensor (one
    in 10,000 of a larger one) may leave that band, and none by more than 0.1 x lr (3e-4). A wrong
    gradient moves weights by about lr per step, in most elements: it fails both."""
    a, b = checkpoint_weights(one_dir, step), checkpoint_weights(many_dir, step)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        diff = (b[k].double() - a[k].double()).abs()
        outside = int((diff > 3e-5 + 1e-4 * a[k].double().abs()).sum())
        assert outside <= max(1, a[k].numel() // 10_000), (k, outside, float(diff.max()))
        assert float(diff.max()) <= 3e-4, (k, float(diff.max()))


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Build the fused CPU kernels once, before any test (the first build takes ~20 s; every later
    process, spawned ranks included, loads the cached copy)."""
    from moe_trainer.kernels.cpu import extension as cpu_kernels
    cpu_kernels.kernels()


WORDS = ("the quick brown fox jumps over a lazy dog while seven experts route every token to "
         "their shared stage and the pipeline keeps its bubble small under one plain schedule").split()


def toy_documents(n: int, seed: int = 0) -> list[str]:
    """n short English-like documents (seeded), for training a tokenizer and a tiny run."""
    import random
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 80))) + "." for _ in range(n)]


def train_tokenizer(path: Path, vocab_size: int = 400, eos: str = "<|endoftext|>") -> Path:
    """A byte-level BPE trained in-process on toy_documents (no download), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [eos] if eos else []
    tok.train_from_iterator(toy_documents(200), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


class EventLikeClock:
    """A StepClock stand-in that behaves like CUDA events: a mark cannot be read until the step's
    host sync (`synced`); the host clock would have timed kernel launches instead of kernels."""

    def __init__(self):
        self.now, self.synced = 0.0, False

    def mark(self):
        self.now += 1.0
        return self.now

    def seconds(self, a, b) -> float:
        assert self.synced, "a mark was read before the step's host sync"
        return b - a


@pytest.fixture
def one_rank_env(monkeypatch):
    """The environment of a launched world of one (a free port on loopback), for tests that start
    torch.distributed and a DeepSpeed engine in this process."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}.items():
        monkeypatch.setenv(k, v)
    _forget_deepspeed_groups()
    yield
    _forget_deepspeed_groups()


def _forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the groups of the last engine built in this process (deepspeed.utils.groups: its clone
    of the world group, the mpu, the expert groups); once that process group is destroyed, the next engine
    would be handed the dead groups ("Group ... is not registered"). A new in-process world starts clean."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        getattr(groups, name).clear()
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mpu", "mesh_device"):
        setattr(groups, name, None)
    groups.expert_tensor_parallel_world_size = 1

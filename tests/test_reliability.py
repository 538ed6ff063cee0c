"""Checkpoints that survive crashes and change layout, exact resume, and failure
handling, through the real launcher (fp32)."""
import json
import os
import random
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest
import torch

from moe_trainer.checkpoint import read_full

from conftest import (ROOT, TINY, VENV_BIN, check, env, free_port, launch, read_metrics, train_grad_norms,
                      train_losses)

BASE = TINY + ["train.global_batch_size=8", "train.micro_batch_size=2"]


def weights(ckpt: Path) -> dict:
    return read_full(ckpt)


def assert_same_weights(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=rtol, atol=atol, msg=k)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """10 steps, pp 2 x ep 2 on 4 ranks, checkpoints at 5 and 10."""
    out = tmp_path_factory.mktemp("straight") / "run"
    check(launch(4, out, BASE + ["parallel.pp=2", "parallel.ep=2", "train.max_steps=10",
                                 "train.checkpoint_every=5", "train.keep_checkpoints=5"]))
    return out


def test_exact_resume_pipeline_and_experts(straight, tmp_path):
    out = tmp_path / "run"
    layout = ["parallel.pp=2", "parallel.ep=2", "train.checkpoint_every=5"]
    check(launch(4, out, BASE + layout + ["train.max_steps=10", "train.stop_at_step=5"]))
    proc = check(launch(4, out, BASE + layout + ["train.max_steps=10", "train.resume=auto"]))
    assert "resumed from" in proc.stdout and "step_5" in proc.stdout
    for read in (train_losses, train_grad_norms):
        a, b = read(straight), read(out)
        assert sorted(b) == list(range(1, 11))  # the interrupted run's metrics continue without duplicates
        for s in a:
            assert abs(a[s] - b[s]) <= 1e-6 * abs(a[s]), (read.__name__, s, a[s], b[s])
    assert_same_weights(weights(straight / "checkpoints" / "step_10"), weights(out / "checkpoints" / "step_10"),
                        rtol=1e-6, atol=1e-7)


def test_resharded_resume(straight, tmp_path):
    """A checkpoint written at (pp 2, ep 2, world 4) continues on one rank with the same losses and
    gradient norms (tests/test_checkpoint_reshard.py moves checkpoints between the other layouts, and
    tests/test_run_dir.py resumes on another multi-rank layout)."""
    out = tmp_path / "run"
    ckpt = straight / "checkpoints" / "step_5"
    check(launch(1, out, BASE + ["train.max_steps=10", f"train.resume={ckpt}"], launcher="python"))
    for read in (train_losses, train_grad_norms):
        a, b = read(straight), read(out)
        assert sorted(b) == list(range(6, 11))
        for s in b:
            assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), (read.__name__, s, a[s], b[s])


def _rank_pids(marker: str) -> list[int]:
    """PIDs of trainer ranks whose command line mentions `marker` (the run dir)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(marker.encode() in c for c in cmd) and b"moe_trainer.train" in cmd and \
                    any(c.startswith(b"--local_rank") for c in cmd):
                pids.append(int(d.name))
    return pids


def _start(n: int, out: Path, overrides: list[str], port: Optional[int] = None) -> subprocess.Popen:
    """The trainer under the deepspeed launcher; its rank 0 hosts the rendezvous store on `port`."""
    args = [a for o in overrides + [f"run.out_dir={out}"] for a in ("--set", o)]
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(n), "--master_port", str(port or free_port()),
           "--module", "moe_trainer.train", "--config=configs/moe_tiny.yaml", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "metrics.jsonl").is_file() and len(read_metrics(out)) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("the run did not reach the step in time")


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = _start(2, out, BASE + ["train.max_steps=100000", "train.checkpoint_every=0"])
    _wait_for_steps(out, 3, proc)
    pids = _rank_pids(str(out))
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGTERM)  # as a scheduler does before preemption (one rank is enough)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout
    latest = (out / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert step >= 3 and max(r["step"] for r in read_metrics(out)) == step


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "a collective failed" in line]


def test_a_dead_rank_ends_the_job_quickly(tmp_path):
    out = tmp_path / "run"
    proc = _start(2, out, BASE + ["train.max_steps=100000", "train.checkpoint_every=0", "parallel.timeout_s=60"])
    _wait_for_steps(out, 2, proc)
    t0 = time.time()
    os.kill(_rank_pids(str(out))[1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=150)
    assert proc.returncode != 0  # the launcher passes on the first failure it sees: rank 1's SIGKILL
    assert time.time() - t0 < 120
    # one line for the job, from rank 0, naming the rank that never answered through the store
    lines = _error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: ") and "Rank(s) 1 never answered" in lines[0], \
        stderr[-3000:]


def _exited(pid: int) -> bool:
    """The process is gone or a zombie its parent (the launcher) has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_a_stopped_rank_times_out_with_one_line_naming_the_ranks(tmp_path):
    """Rank 1 frozen (SIGSTOP: alive, but it never arrives): rank 0's collective times out after
    parallel.timeout_s and it ends with exit 4 and one line naming itself and rank 1, which never
    answered through the rendezvous store, within the timeout and a few seconds."""
    out, timeout_s = tmp_path / "run", 10
    proc = _start(2, out, BASE + ["train.max_steps=100000", "train.checkpoint_every=0",
                                  f"parallel.timeout_s={timeout_s}"])
    _wait_for_steps(out, 2, proc)
    pids = _rank_pids(str(out))
    t0 = time.time()
    os.kill(pids[1], signal.SIGSTOP)
    while not _exited(pids[0]) and time.time() - t0 < timeout_s + 60:
        time.sleep(0.2)
    took = time.time() - t0
    reaped = time.time() + 30  # the launcher has seen rank 0's exit 4 once it reaped it (no zombie left) ...
    while Path(f"/proc/{pids[0]}").exists() and time.time() < reaped:
        time.sleep(0.1)
    # ... so rank 1's SIGKILL cannot be the failure it reports (it reports the first it sees);
    # a frozen rank ignores the launcher's SIGTERM (it waits 30 s, then kills)
    os.kill(pids[1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 4, stderr[-3000:]
    # the timeout, CollectiveWatch.ANSWER_S for the answers, and a loaded 2-core machine's slack
    assert took < timeout_s + 20, took
    lines = _error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: rank 0: ") and f"parallel.timeout_s={timeout_s} s" in lines[0]
    assert "Rank(s) 1 never answered through the rendezvous store" in lines[0]


def test_an_nccl_watchdog_signal_ends_the_job_with_one_line(tmp_path):
    """NCCL's watchdog, on a timeout, writes its rank to the store's `exception_dump` key (and ends its
    process a minute later); its main thread never sees an exception. Written here by hand into a gloo
    job's store, the same signal must end every rank within seconds with one line naming rank 1."""
    import torch.distributed as dist

    from moe_trainer.parallel.launch import NCCL_SIGNAL
    out, port = tmp_path / "run", free_port()
    proc = _start(2, out, BASE + ["train.max_steps=100000", "train.checkpoint_every=0"], port=port)
    _wait_for_steps(out, 2, proc)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    t0 = time.time()
    store.set(NCCL_SIGNAL, (1).to_bytes(4, "little", signed=True))  # ProcessGroupNCCL writes a native int
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 4, stderr[-3000:]
    assert time.time() - t0 < 30
    lines = _error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: rank 1: ") and "NCCL's watchdog" in lines[0]
    assert "Every rank answered" in lines[0]  # both were alive
    assert "Traceback" not in stderr


def test_failure_line_names_the_origin_and_the_silent_ranks():
    from moe_trainer.parallel.launch import failure_line
    line = failure_line(2, "Timed out waiting 10000ms", 10, {0: "alive", 2: "failed", 3: "failed"}, world=4)
    assert line.startswith("error: rank 2: a collective failed (Timed out waiting 10000ms)")
    assert "Rank(s) 3 saw it fail too." in line and "Rank(s) 1 never answered" in line
    assert "never answered" not in failure_line(0, "x", 10, {0: "failed", 1: "alive"}, world=2)
    assert "did not answer" in failure_line(0, "x", 10, store_down=True)
    many = failure_line(0, "x", 10, {0: "failed"}, world=40)
    assert "Rank(s) 1, 2, " in many and "and 23 more" in many


def test_nccl_variables_are_set_before_init_and_the_users_kept(monkeypatch):
    """On the NCCL back end init_distributed sets launch.NCCL_ENV before the process group is made
    (torch reads them then), keeps what the user set (or its older alias), and leaves gloo alone."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from moe_trainer.parallel import launch
    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kwargs):  # what the process group would be made with
        seen.update({k: os.environ.get(k) for k in [*launch.NCCL_ENV, *launch.NCCL_ALIASES.values()]})
        raise Stop

    monkeypatch.setattr(deepspeed, "init_distributed", fake_init)
    for name in [*launch.NCCL_ENV, *launch.NCCL_ALIASES.values()]:
        monkeypatch.delenv(name, raising=False)
    accel = get_accelerator()
    monkeypatch.setattr(accel, "communication_backend_name", lambda: "gloo")
    with pytest.raises(Stop):
        launch.init_distributed(60)
    assert all(v is None for v in seen.values()), seen
    monkeypatch.setattr(accel, "communication_backend_name", lambda: "nccl")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's, by its older name
    with pytest.raises(Stop):
        launch.init_distributed(60)
    assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] is None
    assert seen["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "15000" and seen["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    env = {}
    assert launch.nccl_environment(env) == launch.NCCL_ENV and env == launch.NCCL_ENV


def test_sigkill_at_random_moments_always_resumes_from_a_complete_checkpoint(tmp_path):
    """Killed 3 times (checkpoints every step, so some kills land mid-write), a
    restart with resume=auto always picks a complete checkpoint and finishes
    with the same weights as a run that was never interrupted."""
    rng = random.Random(0)
    steps = ["train.max_steps=12", "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    ref = tmp_path / "ref"
    check(launch(1, ref, BASE + steps, launcher="python"))
    out = tmp_path / "run"
    args = [a for o in BASE + steps + [f"run.out_dir={out}", "train.resume=auto"] for a in ("--set", o)]
    cmd = [str(VENV_BIN / "python"), "-m", "moe_trainer.train", "--config=configs/moe_tiny.yaml", *args]
    for _ in range(3):
        p = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(4.0, 9.0))  # start-up takes a few seconds; then steps and writes interleave
        p.send_signal(signal.SIGKILL)
        p.wait()
        latest = out / "checkpoints" / "latest"
        if latest.is_file():  # `latest` only ever names a complete checkpoint
            from moe_trainer.checkpoint import verify
            assert verify(out / "checkpoints" / latest.read_text().strip()) is None
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_weights(weights(ref / "checkpoints" / "step_12"), weights(out / "checkpoints" / "step_12"),
                        rtol=1e-6, atol=1e-7)
    assert not list((out / "checkpoints").glob(".step_*.tmp"))  # leftovers of killed writes are gone


def test_nan_loss_is_skipped_then_stops_with_the_last_good_state(tmp_path):
    out = tmp_path / "run"
    one = check(launch(1, out, BASE + ["train.max_steps=6", "debug.inject_nan_steps=[3]", "train.checkpoint_every=1",
                                       "train.keep_checkpoints=10"], launcher="python"))
    assert "step 3: non-finite loss" in one.stderr
    recs = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    assert [s for s, r in recs.items() if r["skipped"]] == [3]
    assert all(recs[s]["loss"] == recs[s]["loss"] for s in (4, 5, 6))  # finite again
    nan = [r for r in read_metrics(out) if r.get("event") == "nan"]  # an event row, and in TensorBoard
    assert [(r["step"], r["lm_loss"], r["in_a_row"], r["action"]) for r in nan] == [(3, "nan", 1, "skipped")]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("events/nan/in_a_row")] == [(3, 1.0)]
    # the skipped step changed nothing: weights after step 3 are those after step 2
    assert_same_weights(weights(out / "checkpoints" / "step_2"), weights(out / "checkpoints" / "step_3"), 0, 0)
    halt = tmp_path / "halt"
    proc = launch(2, halt, BASE + ["train.max_steps=8", "debug.inject_nan_steps=[3, 4, 5]", "train.max_nan_skips=2"])
    assert proc.returncode != 0
    assert "3 non-finite losses in a row" in proc.stderr and "checkpoint step_2" in proc.stderr
    assert (halt / "checkpoints" / "latest").read_text().strip() == "step_2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "run"
    check(launch(1, out, BASE + ["train.max_steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=5"],
                 launcher="python"))
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _bad_resume(run: Path, extra: list[str]) -> subprocess.CompletedProcess:
    return launch(1, run, BASE + ["train.max_steps=3"] + extra, launcher="python")


def _snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage, words", [
    ("truncate", "bytes, the manifest says"),
    ("tamper", "does not match its checksum"),
    ("missing", "is missing"),
])
def test_damaged_checkpoint_is_refused_and_kept(saved, tmp_path, damage, words):
    run = _copy_run(saved, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_2"
    f = ckpt / "part-r00000.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-100])
    elif damage == "tamper":
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        f.unlink()
    before = _snapshot(ckpt)
    proc = _bad_resume(run, [f"train.resume={ckpt}"])
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr
    assert _snapshot(ckpt) == before  # nothing on disk lost or changed
    # resume=auto skips it with a warning and takes the older complete one
    auto = check(_bad_resume(run, ["train.resume=auto"]))
    assert "skipping checkpoint" in auto.stderr and "resumed from" in auto.stdout and "step_1" in auto.stdout


def test_checkpoint_of_another_architecture_is_refused(saved, tmp_path):
    ckpt = saved / "checkpoints" / "step_2"
    proc = launch(1, tmp_path / "run", BASE + ["model.arch=llama3", "train.max_steps=3", f"train.resume={ckpt}"],
                  launcher="python")
    assert proc.returncode == 2 and "holds a deepseek_v3 model" in proc.stderr and "Traceback" not in proc.stderr
    proc = launch(1, tmp_path / "run2", BASE + ["model.n_routed_experts=16", "train.max_steps=3",
                                                f"train.resume={ckpt}"], launcher="python")
    assert proc.returncode == 2 and "but the config implies" in proc.stderr


def test_data_with_out_of_range_ids_is_refused(tmp_path):
    from moe_trainer.data import prepare
    files = []
    for i in range(20):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(f"document {i} " * 500)
    prepare([str(f) for f in files], str(tmp_path / "tok"), val_fraction=0.3)
    index = json.loads((tmp_path / "tok" / "index.json").read_text())
    import numpy as np
    shard = tmp_path / "tok" / index["splits"]["train"]["shards"][0]["file"]
    arr = np.fromfile(shard, dtype=index["dtype"])
    arr[5] = 1000
    arr.tofile(shard)
    proc = launch(1, tmp_path / "run", BASE + ["train.max_steps=2", f"data.path={tmp_path / 'tok'}"],
                  launcher="python")
    assert proc.returncode == 2 and "outside model.vocab_size" in proc.stderr and "Traceback" not in proc.stderr


def test_failure_line_names_the_rank_whose_heartbeat_is_behind():
    from moe_trainer.parallel.launch import failure_line
    answers = {0: "failed|9|3|replica check", 1: "alive|8|3|start"}  # rank 1's main thread never got further
    line = failure_line(0, "Timed out waiting 10000ms", 10, answers, world=2)
    assert "Rank(s) 1 stopped making progress (at step 3: start)" in line
    even = failure_line(0, "x", 10, {0: "failed|9|3|replica check", 1: "alive|9|3|replica check"}, world=2)
    assert "stopped making progress" not in even and "skipped a collective" in even

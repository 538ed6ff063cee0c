"""The step-interleaved benchmark driver (moe_trainer/bench/turns.py) with real job processes:
jobs step strictly in turn (their steps never overlap in time; each round starts with the next
job), a multi-rank job's other ranks follow rank 0's turns through a gloo broadcast, a job that
fails mid-run is reported with its output while the others go on, and a job that never connects
fails the wait instead of hanging."""
import json
import subprocess
import sys
import time
from pathlib import Path

from moe_trainer.bench.turns import Referee, free_port, worker_env

ROOT = Path(__file__).resolve().parents[1]

JOB = r'''
import json, os, sys, time
from moe_trainer.bench.turns import Turns
spec, steps, fail_at, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if "RANK" in os.environ:
    import torch.distributed as dist
    dist.init_process_group("gloo")
rank = int(os.environ.get("RANK", "0"))
if os.environ.get("CHILD_PID_FILE"):  # like a launcher: a child process that outlives a failure
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(os.environ["CHILD_PID_FILE"], "w").write(str(child.pid))
turns = Turns(spec)
with open(f"{log}.{rank}", "w") as out:
    for i in range(steps):
        turns.wait()
        if i == fail_at:
            raise RuntimeError(f"job failed on purpose at step {i}")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.02:  # a step's work
            pass
        out.write(json.dumps([t0, time.monotonic()]) + "\n")
        out.flush()
        turns.report({"i": i, "rank": rank})
turns.close({"name": turns.name})
if "RANK" in os.environ:  # ranks end together (an unilateral exit aborts gloo's peer)
    dist.barrier()
    dist.destroy_process_group()
'''


def _job(tmp: Path, referee: Referee, name: str, steps: int, fail_at: int = -1, extra_env=None) -> Path:
    script = tmp / "job.py"
    script.write_text(JOB)
    log = tmp / name
    env = worker_env(1, ROOT)
    env.update(extra_env or {})
    referee.start(name, [sys.executable, str(script), referee.address(name), str(steps), str(fail_at), str(log)],
                  env, cwd=ROOT)
    return log


def _intervals(log: Path) -> list[tuple[float, float]]:
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]


def test_jobs_step_in_turn_and_never_overlap(tmp_path):
    referee = Referee(timeout_s=120)
    try:
        logs = {n: _job(tmp_path, referee, n, 4) for n in ("a", "b")}
        # a two-rank job: rank 0 talks to the referee, rank 1 follows its broadcasts
        script = tmp_path / "job.py"
        cmd = [sys.executable, str(script), referee.address("pair"), "4", "-1", str(tmp_path / "pair")]
        port = str(free_port())
        env = [{**worker_env(1, ROOT), "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port} for r in (0, 1)]
        referee.start("pair", cmd, env[0], cwd=ROOT)
        rank1 = subprocess.Popen(cmd, env=env[1], cwd=ROOT)
        referee.wait_ready()
        order = []
        for _ in range(4):
            for name in ("a", "b", "pair"):
                info = referee.step(name)
                assert info is not None, referee.failures()
                order.append((name, info["i"]))
        assert order == [(n, i) for i in range(4) for n in ("a", "b", "pair")]
        assert [referee.finish(n) for n in ("a", "b", "pair")] == [{"name": "a"}, {"name": "b"}, {"name": "pair"}]
        assert rank1.wait(timeout=60) == 0
        spans = {n: _intervals(Path(f"{logs[n]}.0")) for n in ("a", "b")}
        spans["pair0"], spans["pair1"] = _intervals(tmp_path / "pair.0"), _intervals(tmp_path / "pair.1")
        assert all(len(v) == 4 for v in spans.values())
        # no two jobs' steps overlap in time; rank 1 of the pair steps only in the pair's turns
        jobs = [sorted(spans["a"]), sorted(spans["b"]), sorted(spans["pair0"] + spans["pair1"])]
        for i, mine in enumerate(jobs):
            for other in jobs[i + 1:]:
                for s0, s1 in mine:
                    assert all(s1 <= o0 or o1 <= s0 for o0, o1 in other), (s0, s1)
    finally:
        referee.close()


def test_each_round_starts_with_the_next_job(tmp_path):
    """take_turns rotates the order, so no job always steps first (or always after the same job)."""
    referee = Referee(timeout_s=120)
    try:
        logs = {n: _job(tmp_path, referee, n, 3) for n in ("a", "b", "c")}
        referee.wait_ready()
        reports = referee.take_turns(3)
        assert all([r["i"] for r in reports[n]] == [0, 1, 2] for n in logs)
        assert referee.finish_all() == {n: {"name": n} for n in logs}
        starts = {n: [t0 for t0, _ in _intervals(Path(f"{log}.0"))] for n, log in logs.items()}
        rounds = [sorted(logs, key=lambda n: starts[n][i]) for i in range(3)]
        assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    finally:
        referee.close()


def test_a_failed_job_is_reported_and_the_others_go_on(tmp_path):
    """...and its whole process group is gone (a launcher's ranks would otherwise wait forever)."""
    referee = Referee(timeout_s=120)
    pid_file = tmp_path / "child.pid"
    try:
        _job(tmp_path, referee, "ok", 3)
        _job(tmp_path, referee, "bad", 3, fail_at=1, extra_env={"CHILD_PID_FILE": str(pid_file)})
        referee.wait_ready()
        reports = referee.take_turns(3)
        assert [r["i"] for r in reports["ok"]] == [0, 1, 2] and [r["i"] for r in reports["bad"]] == [0]
        assert referee.running() == ["ok"]
        assert "job failed on purpose at step 1" in referee.failures()["bad"]
        child = int(pid_file.read_text())
        assert not Path(f"/proc/{child}").exists() or " Z " in Path(f"/proc/{child}/stat").read_text()
        assert referee.finish_all() == {"ok": {"name": "ok"}}
    finally:
        referee.close()


def test_a_job_that_never_connects_fails_the_wait(tmp_path):
    referee = Referee(timeout_s=3)
    try:
        referee.start("silent", [sys.executable, "-c", "import time; time.sleep(60)"], worker_env(1, ROOT))
        t0 = time.monotonic()
        referee.wait_ready()
        assert time.monotonic() - t0 < 30
        assert referee.running() == [] and "not ready after 3 s" in referee.failures()["silent"]
    finally:
        referee.close()

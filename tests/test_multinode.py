"""DeepSpeed's multi-node launch, on this one machine: a hostfile of two "nodes" (localhost and
127.0.0.1, one rank each) and one launcher per node with --no_ssh --node_rank 0|1, as a cluster's
scheduler starts them. Same losses as one node with the same ranks, and it resumes; the ranks
share the machine's cores as one node's would (each launcher counts only its own ranks)."""
import os
import re
import subprocess
from pathlib import Path

from conftest import ROOT, TINY, VENV_BIN, check, env, free_port, read_metrics, train_losses

BASE = TINY + ["train.max_steps=4", "train.checkpoint_every=2", "train.resume=auto"]


def own_threads() -> dict:
    """env() without OMP_NUM_THREADS: the trainer's own thread default decides."""
    e = env()
    e.pop("OMP_NUM_THREADS")
    return e


def trainer_args(out: Path, overrides: list[str]) -> list[str]:
    return ["--config=configs/moe_tiny.yaml"] + [a for o in overrides + [f"run.out_dir={out}"] for a in ("--set", o)]


def launch_two_nodes(out: Path, overrides: list[str], tmp: Path, nodes=(0, 1), environ=None
                     ) -> list[subprocess.CompletedProcess]:
    """The launchers of the hostfile's nodes `nodes` (a node left out never starts)."""
    hosts = tmp / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = free_port()
    nodes = [subprocess.Popen([str(VENV_BIN / "deepspeed"), "--hostfile", str(hosts), "--no_ssh", "--node_rank",
                               str(r), "--master_addr", "127.0.0.1", "--master_port", str(port), "--module",
                               "moe_trainer.train", *trainer_args(out, overrides)], cwd=ROOT, env=environ or env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in nodes]
    done = []
    for p in nodes:
        stdout, stderr = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def test_two_nodes_equal_one_node_and_resume(tmp_path):
    """Without OMP_NUM_THREADS, as a user runs it: one node's 2 ranks take cores / 2 threads each,
    and so do the two one-rank "nodes" (each took every core: 10-20x slower), so the runs are the
    same computation and their losses equal."""
    one = tmp_path / "one"
    proc = check(subprocess.run([str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                                 "--module", "moe_trainer.train", *trainer_args(one, BASE)], cwd=ROOT,
                                env=own_threads(), capture_output=True, text=True, timeout=300))
    assert "threads:" not in proc.stdout  # one launcher: its local ranks are the machine's
    assert proc.stdout.count("built successfully") <= 1  # DeepSpeed's line, from the node's first rank only
    two = tmp_path / "two"
    first = launch_two_nodes(two, BASE + ["train.stop_at_step=2"], tmp_path, environ=own_threads())  # ends at 2
    for proc in first:
        check(proc)
    assert "nodes: 2 of 1 rank(s)" in first[0].stdout  # each launcher's LOCAL_WORLD_SIZE is its node's
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert (f"threads: 2 ranks of 2 share this machine's {len(os.sched_getaffinity(0))} cores (its launcher started "
            f"1): {threads} per rank") in first[0].stdout, first[0].stdout
    for proc in launch_two_nodes(two, BASE, tmp_path, environ=own_threads()):  # the same command: resumes at 2
        check(proc)
    assert train_losses(two) == train_losses(one)
    starts = [r for r in read_metrics(two) if "loss" in r]
    assert [r["step"] for r in starts] == [1, 2, 3, 4]


def test_errors_reach_every_node_and_a_node_never_started_is_named(tmp_path):
    """A config error is in each node's launcher output, not only rank 0's; with node 1's launcher
    never started, node 0 says which rank never joined and after how long, not a failed collective."""
    bad = launch_two_nodes(tmp_path / "bad", BASE + ["train.lr=-1"], tmp_path)
    for node, proc in enumerate(bad):
        assert proc.returncode == 2 and "config error: train.lr must be >= 0" in proc.stderr, (node, proc.stderr)
    [alone] = launch_two_nodes(tmp_path / "alone", BASE + ["parallel.timeout_s=8"], tmp_path, nodes=(0,))
    said = re.search(r"the process group did not form after (\d+) s \(parallel.timeout_s=8\): 1 of 2 ranks joined; "
                     r"rank 1, outside this node, never joined", alone.stderr)
    assert alone.returncode == 4 and said, alone.stderr
    assert 8 <= int(said[1]) <= 8 + 10  # the rendezvous' own wait, as the rank timed it
    assert "collective" not in alone.stderr


def _check_run_dirs(rank, world, port, dirs, results):
    import os

    import torch
    import torch.distributed as dist

    from moe_trainer.config import ConfigError
    from moe_trainer.run_dir import check_shared
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    said = []
    for shared in (True, False):  # one directory for both ranks; then each its own, as on two nodes' local disks
        out = Path(dirs[0] if shared else dirs[rank])
        out.mkdir(parents=True, exist_ok=True)
        try:
            check_shared(out, rank, world, torch.device("cpu"))
            said.append(None)
        except ConfigError as e:
            said.append(str(e))
    results[rank] = said
    dist.destroy_process_group()


def test_a_run_directory_that_is_not_shared_by_every_rank_is_named_at_start(tmp_path):
    from conftest import spawn_ranks
    said = spawn_ranks(_check_run_dirs, 2, [str(tmp_path / "a"), str(tmp_path / "b")])
    for rank in (0, 1):
        assert said[rank][0] is None  # the shared directory passes, and its marker is gone
        assert "is not one directory for every rank: rank(s) 1 (on " in said[rank][1]
    assert list((tmp_path / "a").iterdir()) == [] and list((tmp_path / "b").iterdir()) == []

"""tools/dry_run.py: shipped layouts pass on fake CUDA under NCCL's rules, and each rule fails with
its sentence when a defect is put back (a CPU tensor in the checkpoint's all-gather, a one-rank group
that only MoE stages create, an extra collective on one rank). Each case runs in its own process:
the dry run shims torch.cuda and wraps torch.distributed process-wide."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# runs tools/dry_run.py's main after `patch` (Python source) has put a defect back
DRIVER = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tools!r})
{patch}
import dry_run
sys.exit(dry_run.main({argv!r}))
"""

# defect 1: the checkpoint's part reports all-gathered as a host tensor on the default group
CPU_GATHER = """
import torch, torch.distributed as dist
from moe_trainer import checkpoint
def _gather_reports(trainer, size, digest):
    mine = torch.zeros(5, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(trainer.layout.world)]
    dist.all_gather(parts, mine)
    return [(size, digest)] * trainer.layout.world
checkpoint._gather_reports = _gather_reports
"""

# defect 4: the one-rank expert groups made by their member alone, from the MoE stages only
MOE_ONLY_GROUP = """
import torch.distributed as dist
from moe_trainer.parallel import expert
base = expert.register_deepspeed_groups
def register(mesh, group_name):
    dist.new_group([mesh.rank], use_local_synchronization=True)
    base(mesh, group_name)
expert.register_deepspeed_groups = register
"""

# an extra collective on rank 1 only
EXTRA_COLLECTIVE = """
import torch, torch.distributed as dist
from moe_trainer import trainer as trainer_module
base = trainer_module.Trainer.train_step
def train_step(self):
    if self.mesh.rank == 1:
        dist.all_reduce(torch.zeros(1, device=self.device))
    return base(self)
trainer_module.Trainer.train_step = train_step
"""


def dry_run(argv: list[str], patch: str = "", timeout: int = 240) -> subprocess.CompletedProcess:
    code = DRIVER.format(root=str(ROOT), tools=str(ROOT / "tools"), patch=textwrap.dedent(patch), argv=argv)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def short(global_batch: int) -> list[str]:
    """moe_tiny cut to the shortest run that still reaches what a case checks: a dense and a MoE layer,
    `global_batch` sequences a step in micro-batches of 2 (the reports of the layouts that pass walk the
    whole config)."""
    return ["--set", "model.num_hidden_layers=2", "--set", f"train.global_batch_size={global_batch}"]


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines, proc.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def tiny_pp2(tmp_path_factory):
    """moe_tiny at pp 2 on 2 ranks, one GPU per node, 8 micro-batches: the JSON report of running every
    micro-batch (--micro-batches all) and of the two short schedules extrapolated (auto)."""
    reports = {}
    for mode in ("all", "auto"):
        out = tmp_path_factory.mktemp("dry") / f"{mode}.json"
        proc = dry_run(["--config", "configs/moe_tiny.yaml", "--world", "2", "--gpus-per-node", "1", "--set",
                        "parallel.pp=2", "--ranks", "all", "--micro-batches", mode, "--json", str(out)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[mode] = json.loads(out.read_text())
    return reports


def test_moe_tiny_all_ranks_json(tiny_pp2):
    report = tiny_pp2["all"]
    assert report["world"] == 2 and report["gpus_per_node"] == 1
    assert report["groups"]["pp"] == [[0, 1]] and report["groups"]["dp"] == [[0], [1]]
    assert set(report["ranks"]) == {"0", "1"}
    for rank in report["ranks"].values():
        # the planner's estimate within the band docs/DRY_RUN.md states (0.9-1.15x; here 1.00-1.01x)
        assert 0.9 <= rank["peak_bytes"] / rank["plan_bytes"] <= 1.15, rank
        # one GPU per node: the stages' transfers cross nodes, nothing stays inside one
        assert rank["inter_node_bytes"] > 0 and rank["intra_node_bytes"] == 0


def test_short_schedules_extrapolate_to_the_full_one(tiny_pp2):
    """--micro-batches auto (runs of pp and pp + 1 micro-batches) reports what running all 8 does:
    the same collective counts, bytes and host reads exactly, the same peak (pp in flight either way)."""
    assert tiny_pp2["all"]["micro_batches"] == tiny_pp2["auto"]["micro_batches"] == 8
    for r in ("0", "1"):
        full, short = tiny_pp2["all"]["ranks"][r], tiny_pp2["auto"]["ranks"][r]
        assert full["micro_batches_run"] == [8] and short["micro_batches_run"] == [2, 3]
        assert full["collectives"]["pp.send"] == 8
        for key in ("collectives", "intra_node_bytes", "inter_node_bytes", "host_reads"):
            assert short[key] == full[key], (r, key)
        assert abs(short["peak_bytes"] / full["peak_bytes"] - 1) < 0.05


def test_llama3_tiny_4d_layout_all_ranks():
    proc = dry_run(["--config", "configs/llama3_tiny.yaml", "--world", "8", "--gpus-per-node", "4",
                    "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--ranks", "all"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pp.send 4" in proc.stdout and "tp.reduce_scatter_tensor" in proc.stdout


def test_roles_runs_one_rank_per_stage(tmp_path):
    out = tmp_path / "dry.json"
    proc = dry_run(["--config", "configs/llama3_tiny.yaml", "--world", "8", "--gpus-per-node", "4",
                    "--set", "parallel.pp=2", "--ranks", "roles", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report["ranks"]) == ["0", "1"]  # stage 0 and stage 1 (rank order [tp, cp, pp, dp])
    assert sum(len(g) for g in report["groups"]["pp"]) == 8  # every group of the world, not only the ranks run


def test_cpu_tensor_in_collective_fails():
    proc = dry_run(["--config", "configs/moe_tiny.yaml", "--world", "2", "--gpus-per-node", "2", "--ranks", "0"]
                   + short(4), CPU_GATHER)
    assert proc.returncode == 1
    line = error_line(proc)
    assert "collectives take tensors on the rank's CUDA device" in line and "rank 0" in line
    assert "on cpu to all_gather" in line and "moe_trainer/checkpoint.py:" in line


def test_group_created_by_moe_stages_only_fails():
    # stage 0 holds the dense layers 0-1, stage 1 the MoE layers 2-3
    proc = dry_run(["--config", "configs/moe_tiny.yaml", "--world", "4", "--gpus-per-node", "4", "--ranks", "roles",
                    "--set", "parallel.pp=2", "--set", "parallel.ep=2", "--set", "model.first_k_dense_replace=2",
                    "--set", "parallel.pp_partition=[2,2]", "--set", "train.global_batch_size=8"], MOE_ONLY_GROUP)
    assert proc.returncode == 1
    line = error_line(proc)
    assert "every rank enters every group creation in the same order" in line
    assert "its own one-rank group" in line and "moe_trainer/parallel/expert.py" in line


def test_extra_collective_on_one_rank_fails():
    proc = dry_run(["--config", "configs/moe_tiny.yaml", "--world", "2", "--gpus-per-node", "2", "--ranks", "all"]
                   + short(4), EXTRA_COLLECTIVE)
    assert proc.returncode == 1
    line = error_line(proc)
    assert "the members of a group enter the same collectives in the same order" in line
    assert "rank 1" in line and "world" in line and "moe_trainer/" in line


def test_bad_input_is_one_sentence():
    proc = dry_run(["--config", "configs/moe_tiny.yaml", "--world", "3", "--gpus-per-node", "2"])
    assert proc.returncode == 2
    assert error_line(proc).count(".") >= 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("spec", ["7", "x"])
def test_bad_rank_list(spec):
    proc = dry_run(["--config", "configs/moe_tiny.yaml", "--world", "2", "--gpus-per-node", "2", "--ranks", spec])
    assert proc.returncode == 2 and "--ranks" in error_line(proc)

"""tools/dry_run.py walks a real GPU run's path and compares what the roles do on the groups they share:
- `--ranks roles` compares per-group collective sequences across the roles that ran (a dense-only stage
  against a MoE stage on the pipeline group), so one extra collective on one role fails it;
- the process group is bound to the rank's device, so the mesh's groups are communicator splits
  (dist.split_group) under NCCL's rules for splits;
- functional collectives (the compiled EP path), coalesced calls and batched point-to-point go
  through the same rules;
- two steps of the Trainer's loop run, with the replica check, straggler naming, expert metrics and
  evaluation at every step;
- the EP split sizes come from a seeded skewed routing, some of them zero.
Each case runs in its own process (tests/test_dry_run.py's driver): the dry run shims torch.cuda and
wraps torch.distributed process-wide."""
from __future__ import annotations

import json

import pytest

from moe_trainer.parallel.dryrun.routing import skewed_matrix
from test_dry_run import dry_run, error_line, short

PP2 = ["--config", "configs/moe_tiny.yaml", "--world", "4", "--gpus-per-node", "4", "--set", "parallel.pp=2",
       "--micro-batches", "all"] + short(8)
# the layout of issue 42: stage 0 holds only dense layers, stage 1 the MoE layers, ep 2, bf16
DENSE_STAGE = ["--config", "configs/moe_tiny.yaml", "--world", "4", "--gpus-per-node", "4",
               "--set", "model.first_k_dense_replace=2", "--set", "parallel.pp=2", "--set", "parallel.ep=2",
               "--set", "parallel.pp_partition=[2,2]", "--set", "train.dtype=bf16"]
EP2 = ["--config", "configs/moe_tiny.yaml", "--world", "2", "--gpus-per-node", "2", "--set", "parallel.ep=2",
       "--micro-batches", "all"] + short(8)

# one extra all-reduce on the pipeline group, made by the last stage only (as the MoE stages' expert
# gradient norm was): the roles that share the group no longer agree
EXTRA_ON_LAST_STAGE = """
import torch, torch.distributed as dist
from moe_trainer import trainer as trainer_module
base = trainer_module.Trainer.reduce_losses
def reduce_losses(self, values):
    if self.mesh.is_last_stage:
        dist.all_reduce(torch.zeros(3, device=self.device), group=self.mesh.group("pp"))
    return base(self, values)
trainer_module.Trainer.reduce_losses = reduce_losses
"""

# rank 1 splits the world into other groups than every other rank at its first split
OTHER_SPLIT_ON_RANK_1 = """
import torch.distributed as dist
from moe_trainer.parallel import mesh
base = mesh._partition
def _partition(lists, rank, timeout=None):
    if rank == 1 and not getattr(_partition, "done", False):
        _partition.done = True
        dist.split_group(split_ranks=[list(range(dist.get_world_size()))], timeout=timeout)
    return base(lists, rank, timeout)
mesh._partition = _partition
"""

# the compiled path's all-to-alls (functional collectives) run eagerly
FUNCTIONAL_PATH = """
from moe_trainer.parallel import comm
comm.traced = lambda: True
"""

# an extra functional all-reduce on rank 1
EXTRA_FUNCTIONAL = """
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
from moe_trainer import trainer as trainer_module
base = trainer_module.Trainer.reduce_losses
def reduce_losses(self, values):
    if self.mesh.rank == 1:
        fc.wait_tensor(fc.all_reduce(torch.zeros(5, device=self.device), "sum", dist.group.WORLD))
    return base(self, values)
trainer_module.Trainer.reduce_losses = reduce_losses
"""

# an extra coalesced all-reduce on rank 1
EXTRA_COALESCED = """
import torch, torch.distributed as dist
from moe_trainer import trainer as trainer_module
base = trainer_module.Trainer.reduce_losses
def reduce_losses(self, values):
    if self.mesh.rank == 1:
        dist.all_reduce_coalesced([torch.zeros(2, device=self.device), torch.zeros(3, device=self.device)])
    return base(self, values)
trainer_module.Trainer.reduce_losses = reduce_losses
"""

# rank 1 makes GPU 0 current before its step: its pipeline transfers (batch_isend_irecv) would hang on NCCL
WRONG_CURRENT_DEVICE = """
import torch
from moe_trainer import trainer as trainer_module
base = trainer_module.Trainer.train_step
def train_step(self):
    if self.mesh.rank == 1:
        torch.cuda.set_device(0)
    return base(self)
trainer_module.Trainer.train_step = train_step
"""

# what the loop ran on each rank, printed at exit
LOOP_CALLS = """
import atexit, sys
from collections import Counter
from moe_trainer import guards as guards_module, trainer as trainer_module
from moe_trainer.expert_load import tracker
calls = Counter()
def counted(cls, name):
    base = getattr(cls, name)
    def wrapper(self, *args, **kwargs):
        calls[name] += 1
        return base(self, *args, **kwargs)
    setattr(cls, name, wrapper)
for name in ("train_step", "evaluate_sources"):
    counted(trainer_module.Trainer, name)
for name in ("check_replicas", "name_stragglers"):  # the fault guards, a component of the trainer
    counted(guards_module.Guards, name)
counted(tracker.ExpertLoadTracker, "metrics")
atexit.register(lambda: print("LOOP " + " ".join(f"{k}={v}" for k, v in sorted(calls.items())), file=sys.stderr))
"""


def broken_rule(args: list[str], *more, **kwargs) -> str:
    """The dry run of `args` fails a rule (exit 1): its error line."""
    proc = dry_run(args, *more, **kwargs)
    assert proc.returncode == 1, proc.stderr[-3000:]
    return error_line(proc)


def test_roles_compare_the_sequences_of_roles_sharing_a_group():
    # world 4 at pp 2 (rank order tp-cp-dp-pp): the roles are stage 0 (rank 0) and stage 1 (rank 2), the
    # pipeline groups [0, 2] and [1, 3]
    line = broken_rule(PP2 + ["--ranks", "roles"], EXTRA_ON_LAST_STAGE)
    assert "the members of a group enter the same collectives in the same order" in line
    assert "on group pp [0, 2]" in line and "rank 2's is all_reduce (float32, 3 elements, sum)" in line


def test_roles_stand_for_the_ranks_that_did_not_run():
    # ranks 0 and 3 run: rank 2 (stage 1) is read through rank 3, rank 1 (stage 0) through rank 0
    line = broken_rule(PP2 + ["--ranks", "0,3"], EXTRA_ON_LAST_STAGE)
    assert "the same collectives in the same order" in line and "on group pp [0, 2]" in line
    assert "rank 2 (as rank 3 of its role ran)" in line


def test_dense_only_stage_with_moe_stage_passes_roles(tmp_path):
    """Issue 42's layout: a dense-only stage beside a MoE stage at ep 2 in bf16. Before the trainer made
    the same calls on every stage (the noise scale's extra all-reduce and BF16_Optimizer's expert norm
    ran on the MoE stage only) this failed with the rule above on group pp [0, 2]."""
    out = tmp_path / "dry.json"
    proc = dry_run(DENSE_STAGE + ["--ranks", "roles", "--json", str(out)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(json.loads(out.read_text())["ranks"]) == ["0", "2"]


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """moe_tiny at ep 2 on 2 ranks, every rank, every micro-batch: (its process, its JSON report)."""
    out = tmp_path_factory.mktemp("ep2") / "dry.json"
    proc = dry_run(EP2 + ["--ranks", "all", "--json", str(out)], LOOP_CALLS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())["ranks"]


def test_device_bound_and_groups_split(ep2_run):
    for r, rank in ep2_run[1].items():
        assert rank["bound_device"] == f"cuda:{r}"  # DeepSpeed's device_id: LOCAL_RANK's GPU
        assert rank["group_creations"]["split"] >= 1  # the mesh's groups: communicator splits


def test_split_of_other_groups_on_one_rank_fails():
    line = broken_rule(EP2 + ["--ranks", "all"], OTHER_SPLIT_ON_RANK_1)
    assert "every rank enters every group creation in the same order" in line
    assert "rank 1 creates a split of group [0, 1] into [[0, 1]]" in line and "moe_trainer/parallel/mesh.py" in line


def test_functional_collectives_are_checked_and_counted_as_eager(ep2_run, tmp_path):
    out = tmp_path / "functional.json"
    proc = dry_run(EP2 + ["--ranks", "all", "--json", str(out)], FUNCTIONAL_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eager, functional = ep2_run[1], json.loads(out.read_text())["ranks"]
    for r, rank in eager.items():
        # at world 2 the ep group is the dp group: its calls are counted under "dp"
        assert rank["collectives"].get("dp.all_to_all_single", 0) > 0
        # the functional all-to-alls recorded as the eager ones, with their bytes
        assert functional[r]["collectives"] == rank["collectives"]
        assert functional[r]["intra_node_bytes"] == rank["intra_node_bytes"]


def test_extra_functional_collective_fails():
    line = broken_rule(EP2 + ["--ranks", "all"], EXTRA_FUNCTIONAL)
    assert "the same collectives in the same order" in line and "all_reduce (float32, 5 elements, sum)" in line


def test_extra_coalesced_collective_fails():
    line = broken_rule(EP2 + ["--ranks", "all"], EXTRA_COALESCED)
    assert "the same collectives in the same order" in line and "all_reduce_coalesced (float32, 5 elements" in line


def test_batched_transfers_need_the_rank_device_current():
    line = broken_rule(["--config", "configs/moe_tiny.yaml", "--world", "2", "--gpus-per-node", "2", "--set",
                        "parallel.pp=2", "--ranks", "all", "--micro-batches", "all"] + short(4),
                       WRONG_CURRENT_DEVICE)
    assert "batched point-to-point needs the rank's device set current" in line and "rank 1" in line


def test_two_loop_steps_with_every_check(ep2_run):
    loop = [line for line in ep2_run[0].stderr.splitlines() if line.startswith("LOOP ")][-1]
    # two ranks, two steps each: every step logged (expert metrics) and evaluated; each rank checked the
    # replicas before its second step's forward and again before the checkpoint at that step (the state the
    # step's update made is checked before it is written: guards.before_checkpoint), and named
    # stragglers at its second step (a first step pays one-time costs)
    assert loop == "LOOP check_replicas=4 evaluate_sources=4 metrics=4 name_stragglers=2 train_step=4", loop
    # the report counts the set-up and one training step of the schedule's 2 micro-batches
    for rank in ep2_run[1].values():
        assert rank["micro_batches_run"] == [2]


def test_skewed_split_sizes_with_zeros(ep2_run):
    for rank in ep2_run[1].values():
        assert rank["split_sizes"]["splits"] > 0 and rank["split_sizes"]["zero"] > 0


def test_skewed_matrix_is_a_routing():
    """Pure: every source sends each of its n tokens' k copies somewhere (copies sum to n k), one rank
    receives nothing, the rows (distinct tokens) per destination lie between copies / k and
    min(n, copies), the draw is seeded and uneven."""
    n, k, ep, n_local = 1000, 4, 4, 4
    copies, rows = skewed_matrix(7, 3, n, k, ep, n_local)
    assert (copies, rows) == skewed_matrix(7, 3, n, k, ep, n_local)
    assert skewed_matrix(7, 4, n, k, ep, n_local) != (copies, rows)
    for c, r in zip(copies, rows):
        assert sum(c) == n * k
        for ci, ri in zip(c, r):
            assert -(-ci // k) <= ri <= min(n, ci)
    cold = [d for d in range(ep) if all(copies[s][d] == 0 for s in range(ep))]
    assert len(cold) == 1
    hot = [sum(copies[s][d] for s in range(ep)) for d in range(ep) if d not in cold]
    assert max(hot) > 1.2 * min(hot)

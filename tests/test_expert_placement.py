"""Expert placement plans applied to expert parallelism (parallel.expert_placement).

Pure pieces (plan checks, GPU relabeling, replica choice); the placed all-to-all
dispatcher on real gloo ranks against the single-rank layer (outputs, input and
expert gradients, weight bytes) and its effect on per-rank load under skewed
routing; and the real trainer: a placed 2-rank run equals the 1-rank run, a plan
written by `tools/expert_load.py plan --apply` is picked up at resume without
changing the losses, and bad plans end the run with one sentence.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moe_trainer import expert_load
from moe_trainer.resolve import load_config
from moe_trainer.moe import placement as pl
from moe_trainer.parallel.comm import CommCounter
from moe_trainer.parallel.expert import AllToAllDispatcher, shard_experts
from moe_trainer.parallel.replicas import layer_placement, load_placement, read_plan

from conftest import (MOE_STEPS, ROOT, TINY, assert_same_final_weights, assert_same_steps, check, env,
                      ep_layer_parity_errors, launch, read_metrics, spawn_ranks)
from test_expert_parallel import D, E, H, make_layer  # the same layer as the unplaced EP tests
# R = E + 2 * ep slots on 2 GPUs; hot experts 0, 1, 4, 5 twice. Plan GPU 0 mostly holds experts
# whose weights live on EP rank 1, so the relabeling swaps the GPUs; row B needs no swap.
ROW_A = [4, 5, 6, 7, 0, 1, 0, 1, 2, 3, 4, 5]
ROW_B = [0, 1, 2, 3, 6, 7, 4, 5, 6, 7, 2, 3]


# ------------------------------------------------------------------ pure pieces

def test_relabel_maximises_slots_at_home():
    assert pl.relabel_gpus(ROW_A, E, 2) == [1, 0]
    assert pl.relabel_gpus(ROW_B, E, 2) == [0, 1]
    # 4 GPUs, each plan GPU g holds the experts of rank (g + 1) % 4: the best relabeling undoes the shift
    row = [2, 3, 4, 5, 6, 7, 0, 1]
    assert pl.relabel_gpus(row, E, 4) == [1, 2, 3, 0]
    # two nodes: GPUs stay on their node
    assert pl.relabel_gpus(row, E, 4, num_nodes=2) in ([0, 1, 2, 3], [1, 0, 3, 2])


def test_layer_placement_tables():
    p0, p1 = (layer_placement(ROW_A, E, 2, r) for r in range(2))
    assert p0.phy2log.tolist() == ROW_A[6:] + ROW_A[:6] and p0.gpu_to_rank == [1, 0]
    # rank 0 hosts [0, 1, 2, 3, 4, 5]: fetches experts 4 and 5 from rank 1, sends 0 and 1 to rank 1
    assert p0.recv_splits == [0, 2] and p0.send_splits == [0, 2] and p0.send_index.tolist() == [0, 1]
    assert p0.slot_index.tolist() == [0, 1, 2, 3, 4, 5]  # rows of [local 0..3; fetched 4, 5]
    assert p1.slot_index.tolist() == [0, 1, 2, 3, 4, 5]  # [local 4..7; fetched 0, 1]
    # replica choice: a local replica when there is one, else round-robin over all replicas
    assert p0.cand_count.tolist() == [1, 1, 1, 1, 1, 1, 1, 1]
    slots = p0.slots(torch.tensor([6, 6, 0, 6]))
    assert slots.tolist() == [8, 8, 0, 8]  # expert 6 only on rank 1 (slot 8); expert 0 local (slot 0)
    cand, cnt = pl.replica_candidates(ROW_A, rank=0, slots_per_rank=6, num_experts=E)
    assert cand[6].tolist()[:cnt[6]] == [2] and cand[4].tolist()[:cnt[4]] == [0]
    cand, cnt = pl.replica_candidates([0, 1, 2, 3, 0, 1], rank=1, slots_per_rank=2, num_experts=4)
    assert cand[0].tolist() == [0, 4] and cnt[0] == 2  # no local replica: both
    assert pl.pick_replicas(torch.tensor([0, 0, 0, 1]), cand, cnt, offset=1).tolist() == [4, 0, 4, 5]


def _write(path, obj):
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.mark.parametrize("case, plan, needle", [
    ("not_json", "{phy2log: [", "is not valid JSON"),
    ("no_table", {"layout": {}}, "has no phy2log table"),
    ("layers", {"phy2log": [ROW_A]}, "has 1 rows but the model has 2 MoE layers"),
    ("gpus", {"layout": {"num_gpus": 4}, "phy2log": [ROW_A, ROW_B]}, "places experts on 4 GPUs but parallel.ep is 2"),
    ("uneven", {"phy2log": [ROW_A[:9], ROW_B[:9]]}, "cannot share evenly"),
    ("range", {"phy2log": [ROW_A, ROW_B[:-1] + [8]]}, "row 1 slot 11 is 8, but expert ids run from 0 to 7"),
    ("missing", {"phy2log": [ROW_A, [0] * 12]}, "row 1 has no replica of expert 1"),
])
def test_bad_plans_give_one_sentence(tmp_path, case, plan, needle):
    path = _write(tmp_path / f"{case}.json", plan)
    with pytest.raises(pl.PlacementError) as err:
        read_plan(path, num_layers=2, num_experts=E, ep=2)
    msg = str(err.value)
    assert needle in msg and str(path) in msg
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0, msg
    with pytest.raises(pl.PlacementError, match="cannot be read"):
        read_plan(tmp_path / "absent.json", 2, E, 2)


def test_tool_apply_writes_the_run_dirs_plan(tmp_path, capsys):
    load = torch.tensor([[50.0, 40, 5, 5, 5, 5, 30, 1], [9, 9, 9, 9, 60, 1, 1, 1]])
    save_file({"load": load}, str(tmp_path / "load.safetensors"))
    run = tmp_path / "run"
    run.mkdir()
    argv = ["plan", "--load", str(tmp_path / "load.safetensors"), "--replicas", "12", "--groups", "2",
            "--gpus", "2", "--out", str(tmp_path / "plan.json"), "--apply", str(run)]
    assert expert_load.main(argv) == 0
    applied = json.loads((run / "expert_placement.json").read_text())
    assert applied["phy2log"] == json.loads((tmp_path / "plan.json").read_text())["phy2log"]
    assert not [p for p in run.iterdir() if p.name != "expert_placement.json"]  # no temporary left behind
    read_plan(run / "expert_placement.json", 2, E, 2)  # the trainer accepts it
    assert expert_load.main(argv[:-4] + ["--apply", str(tmp_path / "absent")]) == 1
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ the placed dispatcher on gloo ranks

def _ep_layer(rank, world, placement, force, counter=None, dedup=False):
    layer = make_layer()
    if force:  # every token picks experts 0..3, whose weights all live on EP rank 0
        layer.gate.e_score_correction_bias[:E // 2] = 100.0
    shard_experts(layer, rank, world)
    layer.dispatcher = AllToAllDispatcher(E, world, dist.group.WORLD, counter=counter, dedup=dedup,
                                          placement=placement, experts=layer.experts)
    return layer


def _rank_loads(layer, world):
    """Rows each rank's experts computed in the last forward (MoE.stats[5], what the trainer logs)."""
    mine = torch.tensor([float(layer.stats[5])])
    out = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


def _placed_worker(rank, world, port, dedup, force, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    xs = [torch.randn(3, 5, D, generator=torch.Generator().manual_seed(7 + r)) for r in range(world)]
    ref = make_layer()
    if force:
        ref.gate.e_score_correction_bias[:E // 2] = 100.0
    x_ref = torch.cat(xs).requires_grad_()
    ref_out, _ = ref(x_ref)
    ref_out.pow(2).sum().backward()

    plain = _ep_layer(rank, world, None, force, dedup=dedup)
    plain(xs[rank])
    loads_plain = _rank_loads(plain, world)
    if force:  # plan from the measured logical load, as tools/expert_load.py plan does
        load = plain.tokens_per_expert.clone()
        dist.all_reduce(load)
        row = pl.rebalance_experts(load[None], E + 2 * world, 2, 1, world)[0][0].tolist()
    else:
        row = ROW_A
    counter = CommCounter()
    placement = layer_placement(row, E, world, rank)
    layer = _ep_layer(rank, world, placement, force, counter, dedup)
    x = xs[rank].clone().requires_grad_()
    out, _ = layer(x)
    out.pow(2).sum().backward()
    loads_placed = _rank_loads(layer, world)

    # (the home rank's expert grads sum every replica's)
    errors = ep_layer_parity_errors(layer, ref, out, ref_out, x, x_ref, rank, world, 3, E)
    row_bytes = 3 * H * D * 4
    want = {"expert_weights": (sum(placement.send_splits) * row_bytes, sum(placement.recv_splits) * row_bytes),
            "expert_weights_grad": (sum(placement.recv_splits) * row_bytes, sum(placement.send_splits) * row_bytes)}
    got = {k: (counter.sent.get(k, 0), counter.received.get(k, 0)) for k in want}
    if got != want:
        errors.append(f"weight bytes: counted {got}, expected {want}")
    errors += [f"copies: {e}" for e in _copies_errors(rank, world, force, dedup, xs, ref, ref_out, x_ref)]
    results[rank] = {"errors": errors, "plain": loads_plain, "placed": loads_placed,
                     "fetched": sum(placement.recv_splits)}
    dist.destroy_process_group()


def _copies_errors(rank, world, force, dedup, xs, ref, ref_out, x_ref) -> list[str]:
    """Slot-owned experts at home with 2 redundant slots a rank (parallel.replace_every): rank 0's hold
    nothing and expert 4, rank 1's experts 2 and 1 (received in the other order); each rank's tokens for
    them take its copies. The owned and the copy slots run as two kernel calls (MoE._run_experts) on the
    CPU kernels, on the accelerator's with dedup; the copies' gradients, summed on their holder, go home
    after the backward (copy_grads_to_owners), added to the owners' as the trainer's hand-back does."""
    from moe_trainer import kernels
    from moe_trainer.parallel import slots
    with kernels.using("accelerator" if dedup else "cpu"):
        layer = _ep_layer(rank, world, slots.owned_placement(slots.home_row(E), world, rank, [-1, 4, 2, 1]),
                          force, CommCounter(), dedup)
    layer.dispatcher.refresh_cache()
    x = xs[rank].clone().requires_grad_()
    out, _ = layer(x)
    out.pow(2).sum().backward()
    assert layer.dispatcher.counter.sent.get("expert_copies_grad", 0) == 0  # nothing sent inside the backward
    for w, g in layer.dispatcher.copy_grads_to_owners():
        w.grad += g
    copied = layer.dispatcher.counter.sent.get("expert_copies_grad", 0)
    return ep_layer_parity_errors(layer, ref, out, ref_out, x, x_ref, rank, world, 3, E) + (
        [] if copied == [1, 2][rank] * 3 * H * D * 4 else [f"copies' gradient bytes sent: {copied}"])


@pytest.mark.parametrize("dedup", [False, True])
def test_placed_layer_equals_single_rank(dedup):
    res = spawn_ranks(_placed_worker, 2, dedup, False)
    assert all(not r["errors"] for r in res.values()), {k: r["errors"] for k, r in res.items()}
    assert [r["fetched"] for r in res.values()] == [2, 2]


def test_plan_balances_concentrated_routing():
    """All tokens pick experts 0..3 (home: EP rank 0). Without a plan rank 0 computes every row; a plan
    made from the measured load replicates them on rank 1, and the measured per-rank rows even out."""
    res = spawn_ranks(_placed_worker, 2, False, True)
    assert all(not r["errors"] for r in res.values()), {k: r["errors"] for k, r in res.items()}
    plain, placed = res[0]["plain"], res[0]["placed"]
    ratio = lambda v: max(v) / (sum(v) / len(v))  # noqa: E731
    assert plain[1] == 0 and ratio(plain) == 2.0
    assert sum(placed) == sum(plain) and ratio(placed) < 1.25, (plain, placed)


# ------------------------------------------------------------------ the real trainer

def test_placed_run_equals_one_rank(tmp_path, moe_reference):
    plan = _write(tmp_path / "plan.json", {"layout": {"num_gpus": 2}, "phy2log": [ROW_A, ROW_B]})
    out = tmp_path / "placed"
    proc = check(launch(2, out, TINY + MOE_STEPS + ["parallel.ep=2", f"parallel.expert_placement={plan}"],
                        launcher="torchrun"))
    assert "plan GPU -> EP rank [1, 0]" in proc.stdout and "plan GPU -> EP rank [0, 1]" in proc.stdout
    assert_same_steps(moe_reference, out)
    assert_same_final_weights(moe_reference, out)
    last = read_metrics(out)[-1]
    assert last["comm.expert_weights_sent_bytes"] > 0 and last["comm.expert_weights_grad_sent_bytes"] > 0
    assert last["expert.rank_max_over_mean"] >= 1.0 and "expert_layer1.rank_max_over_mean" in last


def test_plan_applied_at_resume_with_pipeline_stages(tmp_path, moe_reference):
    """3 steps without a plan, `expert_load.py plan --apply` on the run, resume for 2 with it: the
    losses are those of 5 straight steps without a plan. Two pipeline stages (world 4 = pp 2 x ep 2):
    each stage's MoE layer takes its own row of the plan."""
    out = tmp_path / "run"
    layout = ["parallel.ep=2", "parallel.pp=2", "train.resume=auto"]
    check(launch(4, out, TINY + MOE_STEPS + layout + ["train.stop_at_step=3"], launcher="torchrun"))
    tool = subprocess.run([sys.executable, "tools/expert_load.py", "plan", "--load", str(out), "--replicas", "12",
                           "--groups", "2", "--gpus", "2", "--apply", str(out)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0, tool.stderr
    proc = check(launch(4, out, TINY + MOE_STEPS + layout, launcher="torchrun"))
    assert "resumed from" in proc.stdout and "expert placement:" in proc.stdout
    assert proc.stdout.count("plan GPU -> EP rank") == 2  # MoE layers 1 and 2
    assert_same_steps(moe_reference, out)
    assert read_metrics(out)[-1]["comm.expert_weights_sent_bytes"] > 0


def test_plan_with_one_ep_rank_is_checked_and_ignored(tmp_path, capsys):
    plan = _write(tmp_path / "plan.json", {"layout": {"num_gpus": 2}, "phy2log": [ROW_A, ROW_B]})
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), TINY + [f"parallel.expert_placement={plan}"])
    assert load_placement(cfg, ep=1, ep_rank=0, log=True) is None
    assert "ignored: parallel.ep is 1" in capsys.readouterr().out
    cfg.parallel.expert_placement = "auto"  # no expert_placement.json in run.out_dir: no plan
    cfg.run.out_dir = str(tmp_path)
    assert load_placement(cfg, ep=2, ep_rank=0, log=True) is None
    _write(tmp_path / "expert_placement.json", {"phy2log": [ROW_A, ROW_B]})
    assert [p.gpu_to_rank for p in load_placement(cfg, ep=2, ep_rank=1, log=False)] == [[1, 0], [0, 1]]
    _write(tmp_path / "expert_placement.json", {"phy2log": [ROW_A]})
    with pytest.raises(pl.PlacementError, match="has 1 rows but the model has 2 MoE layers"):
        load_placement(cfg, ep=1, ep_rank=0, log=False)


def test_bad_plan_ends_the_run_with_one_sentence(tmp_path):
    plan = _write(tmp_path / "plan.json", "not json")
    proc = launch(1, tmp_path / "run", TINY + ["train.max_steps=1", f"parallel.expert_placement={plan}"],
                  launcher="python")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: parallel.expert_placement: {plan} is not valid JSON (Expecting value: line 1 "
                      f"column 1 (char 0)); write it with tools/expert_load.py plan."], proc.stderr
    assert "Traceback" not in proc.stderr

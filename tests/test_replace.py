"""Slot-owned experts that move while the run runs (parallel.replace_every, parallel/slots.py).

Pure pieces (who sends which slot where, the relabeling that keeps experts in place, the config
checks), and the real trainer: runs that move every expert after every step (the `rotate` drill)
equal the 1-rank run that never moves one, loss and grad norm every step at 1e-5, through a
checkpoint saved after a re-placement and resumed at another EP size.
"""
import pytest

from moe_trainer.config import ConfigError
from moe_trainer.moe.placement import online
from moe_trainer.parallel import slots as sl
from moe_trainer.resolve import load_config

from conftest import (MOE_STEPS, ROOT, TINY, assert_same_final_weights, assert_same_steps, check, launch,
                      read_metrics)


# ------------------------------------------------------------------ pure pieces

def test_moves_pair_up_on_both_sides():
    """Every rank's sends to d are d's receives from it, slot for slot, and applying them (with the
    in-rank copies) turns the old placement into the new one."""
    old, new, ep = [0, 1, 2, 3, 4, 5, 6, 7], [5, 1, 7, 0, 2, 4, 3, 6], 4
    s = len(old) // ep
    plans = [sl.moves(old, new, ep, r) for r in range(ep)]
    got = list(old)
    for r, (_, recv, keep) in enumerate(plans):
        for a, b in keep:
            got[r * s + b] = old[r * s + a]
        for src in range(ep):
            sent = plans[src][0][r]  # what src sends to r, in its order
            assert len(sent) == len(recv[src])
            for a, b in zip(sent, recv[src]):
                got[r * s + b] = old[src * s + a]
    assert got == new
    assert online.moved_experts(old, new, ep) == [1, 2, 1, 1]  # rank 1 sends 2 and 3, the others one each


def test_keep_in_place_moves_the_fewest_experts():
    old = [3, 2, 1, 0, 7, 6, 5, 4]  # rank 0 holds 0..3, rank 1 holds 4..7, in another order
    plan = [4, 5, 6, 0, 1, 2, 3, 7]  # plan rank 0 is mostly rank 1's experts
    row = online.keep_in_place(plan, old, 2)
    assert sorted(row[:4]) == [1, 2, 3, 7] and sorted(row[4:]) == [0, 4, 5, 6]  # ranks relabeled: 2 move
    assert row[:4] == [3, 2, 1, 7] and row[4:] == [0, 6, 5, 4]  # stayers keep their slots
    assert online.moved_experts(old, row, 2) == [1, 1]


def _copy_slots_reference(load, row, ep, r):
    """copy_slots as first written: every rank's load summed again for every candidate copy."""
    s0 = len(row) // ep
    holders = {e: [q // s0] for q, e in enumerate(row)}
    replicas, free = [-1] * (ep * r), [list(range(q * r, (q + 1) * r)) for q in range(ep)]
    w = load.double().tolist()

    def loads():
        out = [0.0] * ep
        for e, hs in holders.items():
            for q in hs:
                out[q] += w[e] / len(hs)
        return out
    while True:
        cur = loads()
        busiest = max(range(ep), key=lambda q: cur[q])
        best = None
        for e in sorted((e for e, hs in holders.items() if busiest in hs), key=lambda e: -w[e] / len(holders[e])):
            targets = [q for q in range(ep) if free[q] and q not in holders[e]]
            if not targets:
                continue
            t = min(targets, key=lambda q: cur[q])
            holders[e].append(t)
            after = max(loads())
            holders[e].pop()
            if after < cur[busiest] * (1 - 1e-9):
                best = (e, t)
                break
        if best is None:
            return replicas
        e, t = best
        holders[e].append(t)
        replicas[free[t].pop(0)] = e


def test_copy_slots_equals_its_reference():
    """The incremental copy_slots chooses the copies the plain greedy does: skewed, integer (ties) and flat loads."""
    import torch
    gen = torch.Generator().manual_seed(1)
    for trial in range(200):
        ep = (2, 4, 8, 16, 32)[trial % 5]
        n = ep * (1, 2, 4)[trial % 3]
        load = torch.rand(n, generator=gen, dtype=torch.float64) ** 4 * 100  # a few hot experts
        if trial % 4 == 0:
            load = load.round()
        if trial % 7 == 0:
            load = torch.ones(n)
        row = torch.randperm(n, generator=gen).tolist()
        r = 1 + trial % 3
        assert online.copy_slots(load, row, ep, r) == _copy_slots_reference(load, row, ep, r), (trial, ep, n, r)


def test_copy_rows_counts_the_owners_fan_out():
    """A copy's refresh and hand-back load the busiest of its holders and its owner: an owner sends a hot
    expert to every rank that holds a copy of it."""
    home = online.home_row(8)  # ep 4, 2 experts a rank
    assert online.copy_rows(home, [-1] * 4, 4, 1) == 0
    assert online.copy_rows(home, [-1, 0, 0, 0], 4, 1) == 3  # rank 0 sends expert 0 three times
    assert online.copy_rows(home, [2, 4, 6, 0], 4, 1) == 1  # each rank holds one and gives one
    assert online.copy_rows(home, [2, 3, -1, -1, 0, 1, -1, -1], 4, 2) == 2  # rank 0 holds two, gives two


def test_copies_refresh_tables_pair_up_and_copy_slots_balance():
    """Redundant slots: each rank's copies arrive from their owners in the order the owners send them
    (the refresh and, reversed, the gradients); the greedy fill copies the hot experts to the least
    loaded ranks, never onto their own rank, and lowers the busiest rank's load."""
    import torch
    row, ep = [5, 1, 7, 0, 2, 4, 3, 6], 4  # owned slots: rank r holds row[2r:2r+2]
    copies = [7, -1, 5, 1, 3, -1, 0, 2]  # one or two copies a rank, -1 empty
    tables = [sl._cache_tables(row, copies, ep, r) for r in range(ep)]
    for r, (_, _, recv_splits, slot_index, copy_slot) in enumerate(tables):
        got = []
        for src in range(ep):
            send_index, send_splits = tables[src][0], tables[src][1]
            lo = sum(send_splits[:r])
            rows = send_index[lo:lo + send_splits[r]].tolist()
            assert len(rows) == recv_splits[src]
            got += [row[src * 2 + i] for i in rows]  # the experts src sends to r, in its order
        mine = [e for e in copies[r * 2:r * 2 + 2]]
        owned = row[r * 2:r * 2 + 2]
        slots = owned + [(owned + got)[slot_index[2 + j]] if e >= 0 else -1 for j, e in enumerate(mine)]
        assert slots[2:] == mine and slots[:2] == owned
        assert [mine[j] for j in copy_slot.tolist()] == got  # the slot each received copy fills
    with pytest.raises(ValueError, match="distinct expert ids of other ranks"):
        sl.check_replicas(row, [5, -1, 5, 1, 3, -1, 0, 2], ep)  # rank 0 copying its own expert 5
    load = torch.tensor([100.0, 1, 1, 1, 1, 1, 1, 1])  # expert 0 (on rank 1) takes almost every token
    home = online.home_row(8)
    filled = online.copy_slots(load, home, ep, 1)
    assert 0 in filled and filled[0] != 0 and all(e < 0 or e not in home[q * 2:q * 2 + 2]
                                                  for q, e in enumerate(filled))
    before, after = online.rank_loads(load, home, ep), online.rank_loads(load, home, ep, filled)
    assert float(after.sum()) == pytest.approx(float(before.sum()))
    assert float(after.max()) < float(before.max()) / 2  # expert 0's tokens over 3 or more ranks


@pytest.mark.parametrize("path", ["cpu", "cpu-grouped", "cpu-bf16", "accelerator"])
def test_owned_slots_and_copies_as_two_calls_equal_the_gathered_slots(path, monkeypatch):
    """The routed experts with copies (Dispatched.own_rows): the owned slots' rows against the parameters
    and the copies' rows against the copies equal one call over all slots' weights gathered by slot (what
    ran before), outputs and every gradient, on each expert kernel path (fp32: the threaded C++ and the
    grouped CPU kernels; bf16: the padded one; the accelerator's GroupedExperts). An owned and a copy
    slot are empty, a copy is an owned expert's (its gradient reaches that owned row twice), and the
    owned weights' gradients are held back (kernels/wgrad.py): leaves, made later; the copies' at once."""
    import torch
    from moe_trainer import kernels
    from moe_trainer.kernels import wgrad
    from moe_trainer.kernels.cpu import experts as cpu_experts
    from moe_trainer.moe.dispatcher import Dispatched
    from moe_trainer.moe.layer import MoE
    if path == "cpu-grouped":
        monkeypatch.setattr(cpu_experts, "threaded_cpu_ops", lambda *a: None)
    dtype = torch.bfloat16 if path == "cpu-bf16" else torch.float32
    with kernels.using(path.split("-")[0]):
        moe = MoE(16, 3, 1, 16, 0, 1, 1, False, 1.0).to(dtype)  # S0 = 3 owned slots, r = 2 copies
    gen = torch.Generator().manual_seed(0)
    counts = [4, 0, 5, 3, 0]  # owned slot 1 and copy slot 1 empty
    x, gate, dy = (torch.randn(s, generator=gen).to(dtype) for s in ((12, 16), (12,), (12, 16)))
    with torch.no_grad():
        for w in moe.experts.parameters():
            w.copy_(torch.randn(w.shape, generator=gen) * 0.3)

    def run(split: bool):
        w1, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
        leaves = [t.detach().requires_grad_() for t in (x, gate)]
        for w in (w1, w2):
            w.grad = None
        # copy slot 0 holds owned expert 2, copy slot 1 is empty (zeros, as refresh_cache leaves it)
        copies = [torch.cat([w[2:3], torch.zeros_like(w[:1])]) for w in (w1, w2)]
        with wgrad.held_back(split) as queue:
            if split:
                d = Dispatched(leaves[0], leaves[1], torch.tensor(counts), None,
                               weights={"gate_up_proj": copies[0], "down_proj": copies[1]}, own_rows=9)
                y = moe._run_experts(d)
            else:
                gathered = {"gate_up_proj": torch.cat([w1, copies[0]]), "down_proj": torch.cat([w2, copies[1]])}
                y = torch.func.functional_call(moe.experts, gathered, (leaves[0], torch.tensor(counts), leaves[1]))
            y.backward(dy)
        if split:  # only the owned call's weights, the parameters, are held back
            assert len(queue) == 1 and queue[0][0] == (w1, w2)
            for w, g in wgrad.weight_grads(queue):
                w.grad += g
        return [y] + [t.grad for t in leaves] + [w1.grad, w2.grad]

    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("y", "x.grad", "gate.grad", "gate_up_proj.grad", "down_proj.grad"), run(True), run(False)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{path} {name}: {m}")


@pytest.mark.parametrize("sets, needle", [
    (["parallel.replace_every=-1"], "parallel.replace_every must be >= 0"),
    (["parallel.replace_every=2"], "it needs parallel.ep > 1"),
    (["parallel.replace_every=2", "parallel.ep=2", "parallel.expert_placement=plan.json"],
     "set parallel.expert_placement to none"),
    (["parallel.replace_policy=often"], "parallel.replace_policy must be one of auto, always, rotate"),
    (["parallel.redundant_slots=1", "parallel.ep=2"], "need parallel.replace_every > 0"),
    (["parallel.redundant_slots=5", "parallel.ep=2", "parallel.replace_every=2"], "at most n_routed_experts / ep"),
])
def test_bad_replace_settings_give_one_sentence(sets, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(str(ROOT / "configs/moe_tiny.yaml"), TINY + sets)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the real trainer

def test_moving_experts_equal_the_unmoved_run_through_resume(tmp_path, moe_reference):
    """pp 2 x ep 2 (world 4) moves every expert of both stages after steps 1 and 2 (step 2 runs on moved
    experts), saves at step 2 after the second move, and resumes at ep 4 (world 4) with one redundant
    slot a rank, moving and copying after steps 3 and 4 (steps 4 and 5 route to copies; none after the
    last step): loss and grad norm at every step equal the 1-rank run's (fp32, 1e-5), and so do the
    final weights (saved under expert ids after a move, the copies checked first)."""
    out = tmp_path / "run"
    drill = ["parallel.replace_every=1", "parallel.replace_policy=rotate", "train.dtype=fp32", "train.resume=auto"]
    check(launch(4, out, TINY + MOE_STEPS + drill + ["parallel.ep=2", "parallel.pp=2", "train.stop_at_step=2"],
                 launcher="torchrun"))
    proc = check(launch(4, out, TINY + MOE_STEPS + drill + ["parallel.ep=4", "parallel.redundant_slots=1"],
                        launcher="torchrun"))
    assert "resumed from" in proc.stdout
    # the copies in the redundant slots, checked bit for bit against their owners before the step-5 save
    assert "redundant slots: 8 expert copies bit-identical to their owners" in proc.stdout
    assert_same_steps(moe_reference, out, rel=1e-5)
    assert_same_final_weights(moe_reference, out)
    rows = read_metrics(out)
    events = [r for r in rows if r.get("event") == "replace"]
    assert [r["step"] for r in events] == [1, 2, 3, 4] and all(r["decision"] == "apply" for r in events)
    # rows really crossed ranks (had the tables changed without them, the losses would differ)
    assert all(r["moved_bytes_rank"] > 0 and r["moved_experts"] > 0 for r in events)
    assert [r["copies"] for r in events] == [0, 0, 8, 8]  # then 2 MoE layers x ep 4 x 1 slot


@pytest.mark.parametrize("overlap, compiled, recompute", [("a2a", False, "full"), ("a2a", True, "none"),
                                                      ("none", True, "none")])
def test_copies_overlapped_or_compiled_equal_the_one_rank_run(tmp_path, moe_reference, overlap, compiled, recompute):
    """ep 2 (world 2, 2 micro-batches a step) with one redundant slot a rank: under the overlapped executor
    with full recomputation (parallel.overlap=a2a: the routed experts' weight gradients held back, the
    copies' too, inside checkpointed pieces, where a held-back gradient reaches a copy only through the
    accumulator the dispatcher holds: without it the grad norm drifted 1e-4), and under train.compile
    (aot_eager: the overlapped sub-layer regions, or the blocking run's whole layers). Every step moves
    every expert and places new copies; from step 2 on tokens are routed to copies, whose gradients are
    summed over the step's micro-batches and sent to their owners once, after the last backward. Loss
    and grad norm at every step and the final weights equal the 1-rank eager run's (fp32, 1e-5). Each
    step the copies' gradient rows cross once: as many bytes as their refresh sent, where every
    micro-batch sent them before."""
    out = tmp_path / "run"
    proc = check(launch(2, out, TINY + MOE_STEPS + [
        "parallel.replace_every=1", "parallel.replace_policy=rotate", "train.dtype=fp32", "parallel.ep=2",
        "parallel.redundant_slots=1", f"parallel.overlap={overlap}", f"parallel.recompute={recompute}"] +
        (["train.compile=true", "train.compile_backend=aot_eager"] if compiled else [])))
    assert ("torch.compile (aot_eager)" in proc.stdout) == compiled
    assert_same_steps(moe_reference, out, rel=1e-5)
    assert_same_final_weights(moe_reference, out)
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert all((r.get("comm.overlapped_dispatch_s", 0) > 0) == (overlap == "a2a") for r in rows)
    for r in rows[1:]:  # copies from step 2 on
        assert r["comm.expert_copies_grad_sent_bytes"] == r["comm.expert_copies_sent_bytes"] > 0, r
    # the step boundary's moves and refresh are charged to the next step's time (none before step 1)
    assert rows[0]["time.replacement_s"] == 0
    assert all(0 < r["time.replacement_s"] < r["step_time_s"] for r in rows[1:])


def test_copies_in_interleaved_overlapped_pipeline_equal_the_plain_run(tmp_path):
    """pp 2 x v 2 x ep 2 (world 4, 4 micro-batches a step, one MTP depth), the all-to-alls overlapped in the
    interleaved 1F1B pairs, full recomputation (each piece replayed with the copies it used), every
    expert moved and new copies placed after steps 1 and 2: steps 2 and 3
    route tokens to copies in both stages, and the copies' summed gradients reach their owners before
    the pipeline's reduction. Loss and grad norm every step equal those of the same layout run blocking,
    at home, without copies (fp32, 1e-5)."""
    base = TINY + ["train.max_steps=3", "train.dtype=fp32", "parallel.pp=2", "parallel.ep=2",
                   "parallel.virtual_stages=2", "model.num_hidden_layers=4", "model.num_nextn_predict_layers=1",
                   "train.global_batch_size=16", "parallel.recompute=full"]
    check(launch(4, tmp_path / "plain", base + ["parallel.overlap=none"]))
    check(launch(4, tmp_path / "copies", base + ["parallel.overlap=a2a", "parallel.replace_every=1",
                                                 "parallel.replace_policy=rotate", "parallel.redundant_slots=1"]))
    assert_same_steps(tmp_path / "plain", tmp_path / "copies", steps=(1, 2, 3), rel=1e-5)
    rows = read_metrics(tmp_path / "copies")
    # 4 MoE layers (3 of the model's, the MTP block's) x ep 2 x 1 slot
    assert [r["copies"] for r in rows if r.get("event") == "replace"] == [8, 8]
    assert all(r["comm.expert_copies_grad_sent_bytes"] > 0 for r in rows if r.get("step", 0) > 1 and "loss" in r)


def test_replacement_balances_skewed_routing(tmp_path):
    """Balancing biases skewed on purpose (debug.route_skew, updates off): at home every token goes to the
    experts of EP rank 0 (its share 2x the mean). The search on steps 1-2's load moves half of them
    (decided on the cost rule, written to metrics.jsonl) and the measured share falls to <= 1.10x;
    at step 4 the search finds nothing worth the move and keeps the placement (none after the last step).
    The move's wall goes into step 3's time."""
    out = tmp_path / "skew"
    check(launch(2, out, TINY + ["train.max_steps=5", "parallel.ep=2", "debug.route_skew=0.3",
                                 "model.bias_update_speed=0", "parallel.replace_every=2"]))
    rows = read_metrics(out)
    share = {r["step"]: r["expert.rank_max_over_mean"] for r in rows if "loss" in r}
    assert share[1] > 1.5 and share[2] > 1.5, share
    assert max(share[3], share[4], share[5]) <= 1.10, share
    first, second = (r for r in rows if r.get("event") == "replace")
    assert first["step"] == 2 and first["decision"] == "apply" and "exceeds the move's" in first["reason"]
    assert first["moved_bytes"] > 0 and first["moved_bytes_rank"] > 0 and first["wall_s"] > 0
    # the move's wall is the next step's (step time and throughput count it), in time.replacement_s
    after = next(r for r in rows if r.get("step") == 3 and "loss" in r)
    assert first["wall_s"] <= after["time.replacement_s"] < after["step_time_s"]
    assert first["measured_rank_max_over_mean"] == pytest.approx(share[1] / 2 + share[2] / 2, rel=0.05)
    assert first["predicted_rank_max_over_mean_after"] <= 1.10 < first["predicted_rank_max_over_mean_before"]
    assert second["step"] == 4 and second["decision"] == "keep" and second["moved_bytes_rank"] == 0

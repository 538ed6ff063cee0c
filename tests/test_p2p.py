"""Pipeline point-to-point under NCCL's rule (a send completes only once the peer posted the
matching receive; a rank's transfers run in issue order, a batch_isend_irecv as one group call):
a pure rendezvous simulation of every schedule's transfer plan, the simulation failing the
unbatched order the executor used before, and the gloo wrapper (tests/nccl_p2p_rule.py) that the
multi-rank tests run under, failing that order on real processes and passing the batched one."""
from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

from moe_trainer.parallel.p2p import Transfer, chunk_peers, comm_plan, needs, produces
from moe_trainer.parallel.pipeline import SCHEDULES, forward_only, schedule_units

from conftest import ROOT, EventLikeClock, spawn_ranks


def batched_plan(schedule: str, s: int, p: int, m: int, v: int = 1, overlap: bool = False) -> list[list[Transfer]]:
    """Stage s's batches of transfers, in issue order, as the executor posts them ("eval": the
    forward-only order of evaluation; overlap: parallel.overlap=a2a's units)."""
    units = ([[op] for op in forward_only(s, p, m, v)] if schedule == "eval"
             else schedule_units(schedule, s, p, m, v, overlap))
    return [batch for batch, _ in comm_plan(units, chunk_peers(s, p, v, list(range(p)))) if batch]


def unbatched_plan(schedule: str, s: int, p: int, m: int, v: int = 1) -> list[list[Transfer]]:
    """The order before batching: each receive right before its operation, each send right after."""
    out, peers = [], chunk_peers(s, p, v, list(range(p)))
    for op in SCHEDULES[schedule](s, p, m, v):
        out += [[t] for t in needs(op, peers)]
        out += [[t] for t in produces(op, peers)]
    return out


def _identity(rank: int, t: Transfer, p: int) -> tuple:
    """What a transfer carries, the same on both ends: (kind, micro, the receiving virtual stage)."""
    g = t.chunk * p + rank
    if t.send:
        g += 1 if t.kind == "act" else -1
    return t.kind, t.micro, g


def simulate(plans: list[list[list[Transfer]]]) -> Optional[str]:
    """Run every rank's batches under the rule; None if all finish, else where they are stuck or
    which tensors would be swapped.

    As in NCCL, transfers on a channel (src -> dst) match in issue order, whatever they carry: the
    n-th send from src to dst meets the n-th receive posted for it, which must be the same tensor
    (kind, micro-batch, virtual stage), else the data lands in the wrong buffer. A transfer
    completes when its partner is in the partner rank's current batch; a rank moves to its next
    batch once all of its current batch completed."""
    p = len(plans)
    ops = []  # per rank, per batch: [(src, dst, n, is_send)]
    count: dict = {}
    carried: dict = {}  # (src, dst, n, is_send) -> identity
    for r, batches in enumerate(plans):
        ops.append([])
        for batch in batches:
            row = []
            for t in batch:
                src, dst = (r, t.peer) if t.send else (t.peer, r)
                n = count.get((src, dst, t.send), 0)
                count[(src, dst, t.send)] = n + 1
                row.append((src, dst, n, t.send))
                carried[row[-1]] = _identity(r, t, p)
            ops[-1].append(row)
    for (src, dst, is_send), n in count.items():  # every send has its receive
        assert count.get((src, dst, not is_send)) == n, (src, dst)
    for (src, dst, n, is_send), what in carried.items():
        if is_send and carried[(src, dst, n, False)] != what:
            return f"{src} -> {dst} message #{n}: sends {what}, the receive expects {carried[(src, dst, n, False)]}"
    pos, done = [0] * p, set()
    while True:
        moved = False
        for r in range(p):
            if pos[r] == len(ops[r]):
                continue
            for src, dst, n, is_send in ops[r][pos[r]]:
                peer = dst if is_send else src
                partner = (src, dst, n, not is_send)
                if pos[peer] < len(ops[peer]) and partner in ops[peer][pos[peer]]:
                    done.update({(src, dst, n, is_send), partner})
        for r in range(p):
            while pos[r] < len(ops[r]) and all(o in done for o in ops[r][pos[r]]):
                pos[r] += 1
                moved = True
        if all(pos[r] == len(ops[r]) for r in range(p)):
            return None
        if not moved:
            return "; ".join(f"stage {r} stuck at {ops[r][pos[r]]}" for r in range(p) if pos[r] < len(ops[r]))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES) + ["eval"])
def test_every_schedule_is_deadlock_free_under_nccl_rule(schedule):
    for p in range(1, 9):
        for m in range(1, 17):
            stuck = simulate([batched_plan(schedule, s, p, m) for s in range(p)])
            assert stuck is None, (schedule, p, m, stuck)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES) + ["eval"])
def test_every_interleaved_schedule_is_deadlock_free_under_nccl_rule(schedule):
    """v chunks per rank, the wrap-around from the last rank to rank 0 included: every p <= 8,
    m <= 16 a multiple of p, v in {2, 3, 4} finishes, each message landing in its own buffer."""
    for p in range(2, 9):
        for m in range(p, 17, p):
            for v in (2, 3, 4):
                stuck = simulate([batched_plan(schedule, s, p, m, v) for s in range(p)])
                assert stuck is None, (schedule, p, m, v, stuck)


def test_overlapped_units_are_deadlock_free_and_pair_independent_operations():
    """parallel.overlap=a2a's units (a steady backward with the forward after it, run interleaved):
    every p <= 8, m <= 16 plain, and m a multiple of p with v in {2, 3, 4} interleaved, finish under
    the rule; the same operations in the same order as without overlap; every pair a backward and
    the forward of another micro-batch (no operation of the pair waits for the other's result),
    and a pair wherever a steady state has two forwards."""
    cases = [(p, m, 1) for p in range(1, 9) for m in range(1, 17)] + \
        [(p, m, v) for p in range(2, 9) for m in range(p, 17, p) for v in (2, 3, 4)]
    for p, m, v in cases:
        assert simulate([batched_plan("1f1b", s, p, m, v, overlap=True) for s in range(p)]) is None, (p, m, v)
        for s in range(p):
            units = schedule_units("1f1b", s, p, m, v, overlap=True)
            assert [op for u in units for op in u] == SCHEDULES["1f1b"](s, p, m, v)
            pairs = [u for u in units if len(u) == 2]
            assert all(b[0] == "B" and f[0] == "F" and b[1] != f[1] for b, f in pairs), (p, m, v, s)
            assert all(len(u) <= 2 for u in units)
    # the last stage of 1F1B at p 2, m 4: F0 alone, then (B0, F1), (B1, F2), (B2, F3), B3
    assert schedule_units("1f1b", 1, 2, 4, overlap=True) == \
        [[("F", 0, 0)], [("B", 0, 0), ("F", 1, 0)], [("B", 1, 0), ("F", 2, 0)], [("B", 2, 0), ("F", 3, 0)], [("B", 3, 0)]]


def makespan(p: int, m: int, v: int, overlap: bool, f: float = 1.0, b: float = 2.0) -> float:
    """Step time of the schedule's units on p ranks when a forward (of a chunk) takes f and a backward
    b, transfers are free, and a unit's sends leave when the unit ends (a pair's two operations run
    interleaved, so both end with the unit)."""
    units = [schedule_units("1f1b", s, p, m, v, overlap) for s in range(p)]
    peers = [chunk_peers(s, p, v, list(range(p))) for s in range(p)]
    ready, pos, clock = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(units[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(units[s]):
                unit = units[s][pos[s]]
                wanted = [_identity(s, t, p) for op in unit for t in needs(op, peers[s])]
                if not all(w in ready for w in wanted):
                    break
                clock[s] = max([clock[s]] + [ready[w] for w in wanted]) + sum(f if op[0] == "F" else b for op in unit)
                ready.update({_identity(s, t, p): clock[s] for op in unit for t in produces(op, peers[s])})
                pos[s], moved = pos[s] + 1, True
        assert moved
    return max(clock)


def test_overlapped_pairs_cost_plain_1f1b_its_pipelining_not_interleaved():
    """Why parallel.overlap=a2a at pp > 1 needs interleaved 1F1B (resolve.check_overlap): with plain
    1F1B a stage's pair waits for the next stage's pair (its backward's gradient), which waited for
    this stage's previous pair (its forward's activations), so neighbouring stages take turns and the
    steady state runs at half speed; with v >= 2 the warm-up's 2 (p - s - 1) extra forwards keep the
    ranks apart and the pairs cost the pipeline nothing (as Megatron-Core, which overlaps EP
    all-to-alls at pp > 1 in its interleaved schedule only)."""
    for p in (2, 4):
        assert makespan(p, 16, 1, True) > 1.5 * makespan(p, 16, 1, False), p
        for v in (2, 3):
            assert makespan(p, 16, v, True) == makespan(p, 16, v, False), (p, v)


def test_the_unbatched_order_deadlocks_under_nccl_rule():
    """The simulation can fail: 1F1B with each transfer issued alone (the executor's order before
    batching) deadlocks as soon as a steady state exists; so does the interleaved order."""
    assert simulate([unbatched_plan("1f1b", s, 2, 2) for s in range(2)]) is not None
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        assert simulate([unbatched_plan("1f1b", s, p, m) for s in range(p)]) is not None, (p, m)
    assert simulate([unbatched_plan("1f1b", s, 2, 1) for s in range(2)]) is None  # no steady state
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 8, 4)]:
        assert simulate([unbatched_plan("1f1b", s, p, m, v) for s in range(p)]) is not None, (p, m, v)


def test_the_interleaved_order_one_operation_at_a_time_deadlocks():
    """The naive batching of the interleaved order (each operation's sends with the next
    operation's receives, no forward-backward units) deadlocks under the rule; the units pass."""
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 16, 3)]:
        peers = [chunk_peers(s, p, v, list(range(p))) for s in range(p)]
        naive = [[b for b, _ in comm_plan([[op] for op in SCHEDULES["1f1b"](s, p, m, v)], peers[s]) if b]
                 for s in range(p)]
        assert simulate(naive) is not None, (p, m, v)
        assert simulate([batched_plan("1f1b", s, p, m, v) for s in range(p)]) is None


def test_plan_batches_sends_with_next_receives():
    # stage 0 of 2, 1F1B, m = 3 (F0 F1 B0 F2 B1 B2): the steady state posts F1's send with B0's receive
    plan = comm_plan(schedule_units("1f1b", 0, 2, 3), [(None, 1)])
    ops = [op for _, op in plan]
    assert ops == SCHEDULES["1f1b"](0, 2, 3) + [None]
    batch_before_b0 = plan[ops.index(("B", 0, 0))][0]
    assert {(t.kind, t.micro, t.send) for t in batch_before_b0} == {("act", 1, True), ("grad", 0, False)}


def test_chunk_peers_wrap_around():
    # p 4, v 2: rank 0's chunk 1 (virtual stage 4) follows rank 3's chunk 0; rank 3's chunk 1 is last
    assert chunk_peers(0, 4, 2, [10, 11, 12, 13]) == [(None, 11), (13, 11)]
    assert chunk_peers(3, 4, 2, [10, 11, 12, 13]) == [(12, 10), (12, None)]
    assert chunk_peers(1, 2, 1, [0, 1]) == [(0, None)]


def _crossing_sends(rank, world, port, batched, results):
    """Each rank sends a tensor to the other and then receives one: the order 1F1B's steady state
    had between neighbouring stages (the same call order on both ranks)."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import nccl_p2p_rule
    nccl_p2p_rule.install(timeout_s=3)
    out, buf = torch.full((1 << 16,), float(rank)), torch.empty(1 << 16)
    peer = 1 - rank
    try:
        if batched:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, buf, peer)]):
                w.wait()
        else:
            work = dist.isend(out, peer)
            dist.recv(buf, peer)
            work.wait()
        results[rank] = ("ok", float(buf[0]))
    except nccl_p2p_rule.NcclRuleDeadlock as e:
        results[rank] = ("deadlock", str(e))
    dist.destroy_process_group()


def test_gloo_wrapper_fails_the_crossing_order_and_passes_the_batched_one():
    bad = spawn_ranks(_crossing_sends, 2, False)
    assert [bad[r][0] for r in (0, 1)] == ["deadlock", "deadlock"], bad
    assert "send #0 to rank 1" in bad[0][1] and "deadlock" in bad[0][1]
    good = spawn_ranks(_crossing_sends, 2, True)
    assert good == {0: ("ok", 1.0), 1: ("ok", 0.0)}


def test_pipeline_times_are_marks_read_after_the_step_sync():
    """The executor's forward/backward/wait spans, the trace and the point-to-point seconds are all
    clock marks, read only once the step has synced (so on a GPU they time kernels, not launches)."""
    from moe_trainer.parallel.comm import CommCounter
    from moe_trainer.parallel.pipeline import StepResult, Trace
    clock, counter = EventLikeClock(), CommCounter()
    trace, res = Trace(enabled=True), StepResult(losses={})
    trace.start(clock)  # origin mark 1
    for kind in ("forward", "backward"):
        t0, t1 = clock.mark(), clock.mark()
        trace.record(kind, 0, t0, t1)
        res.spans[kind].append((t0, t1))
    t0, t1 = clock.mark(), clock.mark()
    counter.add_span("pp_send", t0, t1)
    counter.add(kind="pp_send", sent=8, received=0)
    with pytest.raises(AssertionError, match="before the step's host sync"):
        counter.reset(clock)
    clock.synced = True
    assert counter.reset(clock)["seconds"] == {"pp_send": 1.0}
    assert res.seconds(clock, "forward") == res.seconds(clock, "backward") == 1.0 and res.seconds(clock, "wait") == 0
    trace.resolve()
    assert [(e["kind"], e["start"], e["end"]) for e in trace.events] == [("forward", 1.0, 2.0), ("backward", 3.0, 4.0)]
    trace.start(clock)  # the next step starts from no events
    assert trace.events == [] and trace.marks == []


def test_timed_parallel_code_reads_no_host_clock():
    """The pipeline executor, its transfers and the expert all-to-alls time through StepClock only."""
    for name in ("pipeline.py", "p2p.py", "expert.py", "comm.py"):
        assert "perf_counter" not in (ROOT / "moe_trainer" / "parallel" / name).read_text(), name


def test_splitting_a_steady_pair_into_two_groups_deadlocks():
    """Why a forward and its backward share one batch in the interleaved steady state, although
    the forward then also waits for the backward's gradient (a slow box holds both ranks,
    bench.pp.executor_bubble): posting the forward's receive with the previous sends and the
    backward's receive as a second group right after it deadlocks under the rule."""
    def split(s, p, m, v):
        peers = chunk_peers(s, p, v, list(range(p)))
        out, pending = [], []
        for unit in schedule_units("1f1b", s, p, m, v):
            recv = [needs(op, peers) for op in unit]
            out += [pending + recv[0]] + recv[1:]
            pending = [t for op in unit for t in produces(op, peers)]
        return [b for b in out + [pending] if b]
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 16, 3)]:
        assert simulate([split(s, p, m, v) for s in range(p)]) is not None, (p, m, v)

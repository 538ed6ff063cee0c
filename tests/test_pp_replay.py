"""The bubble models bench_pp reports next to the measured bubble: replay_bubble (each operation as
soon as its input exists) and executor_bubble (the executor's own batches of transfers, under NCCL's
rule or eager) give (p-1)/(v m+p-1) exactly when every box takes the same time; a slow box costs the
batched executor more than the free replay; the held-stage harness runs the real executor."""
import pytest

from moe_trainer.bench.pp import executor_bubble, replay_bubble
from moe_trainer.parallel.pipeline import SCHEDULES, theoretical_bubble


def boxes(p: int, m: int, v: int, ratio: float, schedule: str = "1f1b", slow: dict = None) -> list[list[dict]]:
    """Trace-like events: forward 1/v, backward ratio/v per chunk; `slow` scales some (rank, op) boxes."""
    slow = slow or {}
    return [[{"kind": "forward" if op[0] == "F" else "backward", "micro": op[1], "chunk": op[2], "start": 0.0,
              "end": (1.0 if op[0] == "F" else ratio) / v * slow.get((s, op), 1.0)}
             for op in SCHEDULES[schedule](s, p, m, v)] for s in range(p)]


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
def test_equal_boxes_give_the_formula(ratio):
    for p in (2, 4, 8):
        for v in (1, 2, 4):
            for m in (p, 2 * p, 4 * p):
                ev, want = boxes(p, m, v, ratio), theoretical_bubble(p, m, v)
                assert replay_bubble(ev, chunks=v) == pytest.approx(want, abs=1e-9), (p, v, m)
                for strict in (True, False):
                    assert executor_bubble(ev, chunks=v, strict=strict) == pytest.approx(want, abs=1e-9), \
                        (p, v, m, strict)
    ev = boxes(4, 8, 2, 2.0, "gpipe")
    assert executor_bubble(ev, "gpipe", chunks=2) == pytest.approx(theoretical_bubble(4, 8, 2), abs=1e-9)


def test_a_slow_box_costs_the_batched_executor_more_than_the_free_replay():
    """Rank 0's forward of micro-batch 4 (chunk 0) at 3x: in the interleaved steady state that forward's
    activation leaves with the batch after its pair's backward, so rank 1 gets it later than in the
    free replay, where it leaves as soon as the forward ends."""
    p, m, v = 2, 8, 2
    ev = boxes(p, m, v, 2.0, slow={(0, ("F", 4, 0)): 3.0})
    free, batched = replay_bubble(ev, chunks=v), executor_bubble(ev, chunks=v)
    assert batched > free + 0.01, (batched, free)
    # batches only add waits: never below the free replay, whichever box is slow
    for s in range(p):
        for op in SCHEDULES["1f1b"](s, p, m, v):
            ev = boxes(p, m, v, 2.0, slow={(s, op): 3.0})
            assert executor_bubble(ev, chunks=v) >= replay_bubble(ev, chunks=v) - 1e-12, (s, op)


def test_the_held_stage_harness_runs_the_executor():
    """bench_pp --parts schedule: the real executor over the shared-memory rings under NCCL's rule
    on stages that sleep; every step's bubble is at least (nearly) the formula and below one."""
    from moe_trainer.bench.pp_schedule import run_schedule
    bubbles = run_schedule(2, 2, 4, "shm-strict", stage_forward_s=0.01, steps=2, shape=(2, 8, 16))
    assert len(bubbles) == 2
    assert all(0.9 * theoretical_bubble(2, 4, 2) <= b < 1.0 for b in bubbles), bubbles

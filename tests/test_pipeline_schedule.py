"""The 1F1B order (pure), stage partitioning, activation memory held under 1F1B
vs GPipe (saved-tensor hooks, no devices involved), and the executed order
read back from a real run's trace."""
import itertools
import json
import random

import pytest
import torch

from moe_trainer.resolve import load_config
from moe_trainer.models.registry import build_model
from moe_trainer.config import ConfigError, validate_layout
from moe_trainer.parallel.pipeline import (ActivationMeter, PipelineStage, gpipe, layer_costs, one_f_one_b, partition,
                                           peak_in_flight, rank_chunks, schedule_units, stage_layers,
                                           theoretical_bubble)
from moe_trainer.pipeline_trace import executed_order, peak_in_flight_measured

from conftest import ROOT, TINY, check, launch


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 16), (3, 2)])
def test_one_f_one_b_order(pp, m):
    for s in range(pp):
        ops = one_f_one_b(s, pp, m)
        assert sorted(ops) == sorted([("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)])
        warm = min(pp - s - 1, m)
        assert ops[:warm] == [("F", i, 0) for i in range(warm)]
        # each backward follows its own forward; backwards run oldest first
        assert [i for k, i, _ in ops if k == "B"] == list(range(m))
        for i in range(m):
            assert ops.index(("F", i, 0)) < ops.index(("B", i, 0))
        assert peak_in_flight(ops) == min(pp - s, m)
        if m > pp - s:  # steady state alternates F, B
            steady = ops[warm:warm + 2 * (m - warm)]
            assert [k for k, *_ in steady] == ["F", "B"] * (m - warm)
    assert peak_in_flight(gpipe(0, pp, m)) == m
    assert theoretical_bubble(pp, m) == pytest.approx((pp - 1) / (m + pp - 1))


def _worst_stage(costs, sizes, first_extra=0.0, last_extra=0.0) -> float:
    """The most expensive stage of a split, the first paying first_extra and the last last_extra."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    stage = [sum(costs[a:a + n]) for a, n in zip(starts, sizes)]
    stage[0] += first_extra
    stage[-1] += last_extra
    return max(stage)


def _best_worst_stage(costs, stages, first_extra=0.0, last_extra=0.0) -> float:
    """Brute force over every contiguous split into non-empty stages."""
    n = len(costs)
    return min(_worst_stage(costs, [b - a for a, b in zip((0,) + cuts, cuts + (n,))], first_extra, last_extra)
               for cuts in itertools.combinations(range(1, n), stages - 1))


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 2), (2, 8, 4), (4, 4, 2), (4, 8, 2), (4, 16, 3), (3, 6, 2)])
def test_interleaved_order(pp, m, v):
    """Every (micro, chunk) forward and backward once per rank; a micro-batch goes up its chunks
    forwards and down them backwards; the step ends with chunk 0's backward of the last micro-batch
    (the accumulation boundary: one engine.step() per micro-batch, after chunk 0's backward); the
    warm-up and the chunk activations held follow Megatron-Core's interleaved order."""
    for s in range(pp):
        ops = one_f_one_b(s, pp, m, v)
        assert sorted(ops) == sorted((k, i, c) for k in "FB" for i in range(m) for c in range(v))
        at = {op: n for n, op in enumerate(ops)}
        for i in range(m):
            for c in range(v):
                assert at[("F", i, c)] < at[("B", i, c)]
                if c:
                    assert at[("F", i, c - 1)] < at[("F", i, c)] and at[("B", i, c)] < at[("B", i, c - 1)]
        assert ops[-1] == ("B", m - 1, 0)
        warm = v * m if m == pp else min(2 * (pp - s - 1) + (v - 1) * pp, v * m)
        steady = warm < v * m
        assert [k for k, *_ in ops[:warm + steady]] == ["F"] * (warm + steady) and ops[warm + steady][0] == "B"
        assert peak_in_flight(ops) == warm + steady
        units = schedule_units("1f1b", s, pp, m, v)
        assert [op for u in units for op in u] == ops
        assert all(len(u) == 1 or [k for k, *_ in u] == ["F", "B"] for u in units)
        assert gpipe(s, pp, m, v)[:v * m] == [op for op in ops if op[0] == "F"]  # GPipe: same order, all forwards first
    # stage 0 holds (v p + p - 1) / v micro-batches' worth of activations (chunks are 1/v of a stage)
    if m > pp:
        assert peak_in_flight(one_f_one_b(0, pp, m, v)) == v * pp + pp - 2 + 1
    assert theoretical_bubble(pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert theoretical_bubble(pp, m, v) < theoretical_bubble(pp, m)


def test_interleaved_chunks_and_their_checks():
    """Rank s holds virtual stages s, s + pp, ...; the chunks of every rank together hold the whole
    model under its own parameter names (checkpoints load under any (pp, v)); bad input gets one
    sentence naming the key."""
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), ["model.num_hidden_layers=8", "parallel.pp=2",
                                                            "parallel.virtual_stages=2"])
    virtual = stage_layers(cfg, 128)
    assert len(virtual) == 4 and sum(virtual, []) == list(range(8))
    assert rank_chunks(virtual, 0, 2) == [virtual[0], virtual[2]]
    for pp, v, layers in [(2, 2, 4), (2, 3, 6), (4, 2, 8)]:
        sets = [f"model.num_hidden_layers={layers}", "model.num_nextn_predict_layers=1", f"parallel.pp={pp}",
                f"parallel.virtual_stages={v}"] + TINY[:1]
        cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), sets)
        with torch.device("meta"):
            model = build_model(cfg.model)
        names = []
        for s in range(pp):
            stage = PipelineStage(model, rank_chunks(stage_layers(cfg, 32), s, pp), s == 0, s == pp - 1)
            assert [int(i) for c in stage.chunks for i in c] == [i for g in range(s, pp * v, pp)
                                                                  for i in stage_layers(cfg, 32)[g]]
            names += [n for n, _ in stage.named_parameters()]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters()), (pp, v)
    tiny = str(ROOT / "configs/moe_tiny.yaml")
    for sets, key in [(["parallel.pp=2", "parallel.virtual_stages=3"], "parallel.virtual_stages"),
                      (["parallel.virtual_stages=2"], "parallel.virtual_stages"),
                      (["parallel.pp=2", "parallel.virtual_stages=2", "parallel.pp_partition=[2, 2]"],
                       "parallel.pp_partition")]:
        with pytest.raises(ConfigError, match=key):
            load_config(tiny, sets)
    cfg = load_config(tiny, ["parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch_size=6",
                             "train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match="parallel.micro_batches .* multiple of parallel.pp"):
        validate_layout(cfg, 2)
    assert validate_layout(load_config(tiny, ["parallel.pp=2", "parallel.virtual_stages=2"]), 2).grad_accum % 2 == 0


def test_partition_balances_cost_and_honours_hand_split():
    assert partition([1.0] * 8, 4) == [2, 2, 2, 2]
    assert partition([4, 1, 1, 1, 1], 2) == [1, 4]  # a heavy first layer gets a stage of its own
    # the head's cost takes a layer off the last stage: [2, 2, 2] would make it 4
    sizes = partition([1.0] * 6, 3, last_extra=2.0)
    assert sum(sizes) == 6 and sizes[-1] == 1, sizes
    assert _worst_stage([1.0] * 6, sizes, last_extra=2.0) == 3.0
    # the dynamic programme's split is optimal (brute force), extras on either end included
    g = random.Random(0)
    for _ in range(40):
        costs = [g.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(g.randint(2, 8))]
        stages, first, last = g.randint(1, len(costs)), g.choice([0.0, 1.5]), g.choice([0.0, 2.5])
        sizes = partition(costs, stages, first_extra=first, last_extra=last)
        assert len(sizes) == stages and sum(sizes) == len(costs) and min(sizes) >= 1, (costs, stages, sizes)
        assert _worst_stage(costs, sizes, first, last) == pytest.approx(
            _best_worst_stage(costs, stages, first, last)), (costs, stages, first, last, sizes)
    costs = [3.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    sizes = partition(costs, 3)
    assert sum(sizes) == 6 and all(n >= 1 for n in sizes)
    starts = [sum(sizes[:i]) for i in range(3)]
    worst = max(sum(costs[a:a + n]) for a, n in zip(starts, sizes))
    assert worst == 3.0  # the optimum: [3], [1, 1, 1], [1, 1]
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), ["parallel.pp=2", "parallel.pp_partition=[3, 1]"])
    assert stage_layers(cfg, 128) == [[0, 1, 2], [3]]
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), ["parallel.pp=4"])
    assert stage_layers(cfg, 128) == [[0], [1], [2], [3]]
    assert len(layer_costs(cfg.model, 128)) == 4


def _peak_activation_bytes(order, m: int) -> int:
    """Run the schedule's F/B order on one process (one stage's view) and report
    the peak bytes of saved activations."""
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"),
                      ["model.hidden_size=64", "model.num_hidden_layers=2", "model.n_routed_experts=8",
                       "model.n_group=2", "model.topk_group=1", "model.num_experts_per_tok=2",
                       "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.moe_intermediate_size=32",
                       "model.intermediate_size=128"])
    model = build_model(cfg.model)
    meter = ActivationMeter(model)
    batches = [torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(i)) for i in range(m)]
    losses = {}
    for kind, i, _ in order:
        if kind == "F":
            with meter.hooks():
                losses[i] = model(batches[i][:, :-1], batches[i][:, 1:]).loss
        else:
            losses.pop(i).backward()
    assert meter.live == 0  # everything saved was freed by its backward
    return meter.peak


def test_activation_memory_grows_with_pp_not_micro_batches():
    one = _peak_activation_bytes(gpipe(0, 1, 1), 1)  # one micro-batch's activations
    assert one > 0
    # stage 0 under 1F1B holds pp micro-batches, whatever m is
    for pp in (2, 4):
        for m in (4, 8):
            peak = _peak_activation_bytes(one_f_one_b(0, pp, m), m)
            assert peak == pytest.approx(pp * one, rel=0.02), (pp, m, peak / one)
    # GPipe holds all m
    assert _peak_activation_bytes(gpipe(0, 4, 8), 8) == pytest.approx(8 * one, rel=0.02)


def test_trace_of_a_real_run_is_1f1b(tmp_path):
    out = tmp_path / "run"
    proc = check(launch(3, out, TINY + ["parallel.pp=3", "train.max_steps=2", "train.global_batch_size=12",
                                        "train.micro_batch_size=2", "debug.trace_pipeline=true"]))
    assert "pipeline bubble:" in proc.stdout
    trace = json.loads((out / "pipeline_trace.json").read_text())
    pp, m = trace["stages"], trace["micro_batches"]
    assert (pp, m) == (3, 6)
    for s, events in enumerate(trace["events"]):
        assert executed_order(events) == one_f_one_b(s, pp, m), s
        assert peak_in_flight_measured(events) == pp - s
        kinds = {e["kind"] for e in events}
        assert {"forward", "backward"} <= kinds
        assert ("send_fwd" in kinds) == (s < pp - 1) and ("recv_fwd" in kinds) == (s > 0)
    assert 0.0 <= trace["measured_bubble"] < 1.0
    assert trace["theoretical_bubble"] == pytest.approx(2 / 8)
    assert (out / "pipeline_trace.png").stat().st_size > 10_000


def test_gpipe_order_runs_when_asked(tmp_path):
    """The reference order through the same executor: every forward, then every backward."""
    out = tmp_path / "run"
    check(launch(2, out, TINY + ["parallel.pp=2", "train.max_steps=1", "train.global_batch_size=8",
                                 "train.micro_batch_size=2", "debug.trace_pipeline=true", "parallel.schedule=gpipe"]))
    trace = json.loads((out / "pipeline_trace.json").read_text())
    assert trace["schedule"] == "gpipe"
    for s, events in enumerate(trace["events"]):
        assert executed_order(events) == gpipe(s, 2, 4)
        assert peak_in_flight_measured(events) == 4


def test_trace_of_an_overlapped_pair_counts_each_operation_once():
    """parallel.overlap=a2a records a pair's operations one event per stage they ran, interleaved:
    the trace's order and peak count operations (first start, last end), not events."""
    def ev(kind, micro, start, end):
        return {"kind": kind, "micro": micro, "chunk": 0, "start": start, "end": end}
    # the last stage of pp 2 at m 2: F0 alone, then F1 (2 pieces) interleaved with B0 (2 pieces), then B1
    events = [ev("forward", 0, 0, 1), ev("forward", 1, 1, 2), ev("backward", 0, 2, 3), ev("forward", 1, 3, 4),
              ev("backward", 0, 4, 5), ev("backward", 1, 5, 6)]
    assert executed_order(events) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    assert peak_in_flight_measured(events) == 1  # F1 ends (4) after B0 started (2): never two ended forwards

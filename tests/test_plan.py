"""The planner: pure numbers, checked against published figures and hand counts."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_trainer import plan
from moe_trainer.resolve import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def within(value: float, target: float, rel: float = 0.01) -> bool:
    return abs(value - target) <= rel * target


# ----------------------------------------------------------------------------- ZeRO table

def test_zero_cli_prints_the_papers_table():
    out = run_cli("zero", "--params", "7.5e9", "--dp", "64")
    assert out.returncode == 0, out.stderr
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if re.match(r"\| [0-3] \(", line)]
    totals = [cells[4].strip() for cells in rows]
    comm = [cells[5].strip().split()[0] for cells in rows]
    assert totals == ["120 GB", "31.4 GB", "16.6 GB", "1.9 GB"]
    assert comm == ["2x", "2x", "2x", "3x"]
    assert "1.5x data parallel" in rows[3][5]


def test_zero_table_bytes():
    p, n = 7.5e9, 64
    rows = plan.zero_table(p, n)
    assert [r.total for r in rows] == pytest.approx([16 * p, 4 * p + 12 * p / n, 2 * p + 14 * p / n, 16 * p / n])
    assert rows[2].grads == pytest.approx(2 * p / n)


# ----------------------------------------------------------------------------- parameter counts

@pytest.fixture(scope="module")
def deepseek():
    return load_config(str(CONFIGS / "deepseek_v3_671b.yaml"))


def test_deepseek_v3_671b_and_37b(deepseek):
    report = plan.count_parameters(deepseek.model)
    assert within(report.total.main, 671e9)
    # DeepSeek's README_WEIGHTS: 36.7B activated in the main model; the paper rounds it to 37B.
    assert within(report.activated.main, 36.7e9)
    assert round(report.activated.main / 1e9) == 37
    # The MTP module: 11.5B unique parameters; with its shared embedding and head, 671B + 14B = 685B.
    assert within(report.total.mtp, 11.5e9)
    assert within(report.hf_checkpoint_total, 685e9)
    assert report.mtp_parts.routed_experts > 0.9 * report.total.mtp
    assert report.activated.routed_experts == pytest.approx(report.total.routed_experts * 8 / 256)


def test_llama3_405b():
    cfg = load_config(str(CONFIGS / "llama3_405b.yaml"))
    report = plan.count_parameters(cfg.model)
    assert within(report.total.total, 405e9)
    assert report.total.routed_experts == report.total.mtp == 0


def test_tiny_deepseek_count_by_hand():
    cfg = load_config(str(CONFIGS / "moe_tiny.yaml"))
    h, v, heads, inter, e, mi = 256, 320, 4, 768, 16, 128
    mla = h * 96 + 96 + 96 * heads * 48 + h * (64 + 16) + 64 + 64 * heads * (32 + 32) + h * heads * 32
    dense = 3 * h * inter
    moe = e * h + e * 3 * mi * h + 3 * mi * h  # router, routed experts, one shared expert
    expected = 2 * v * h + 4 * (mla + 2 * h) + dense + 3 * moe + h
    assert plan.expected_numel(cfg.model) == expected
    assert plan.count_parameters(cfg.model).total.total == expected


def test_param_shapes_use_hugging_face_names(deepseek):
    shapes = plan.param_shapes(deepseek.model)
    assert shapes["model.layers.3.mlp.experts.gate_up_proj"] == (256, 4096, 7168)
    assert shapes["model.layers.3.mlp.experts.down_proj"] == (256, 7168, 2048)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (18432, 7168)
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert shapes["model.layers.61.eh_proj.weight"] == (7168, 14336)
    assert not any("e_score_correction_bias" in n for n in shapes)
    tied = load_config(str(CONFIGS / "moe_tiny.yaml"), ["model.tie_word_embeddings=true"]).model
    assert "lm_head.weight" not in plan.param_shapes(tied)


# ----------------------------------------------------------------------------- pipeline

def test_bubble_fraction():
    assert plan.bubble_fraction(16, 16) == pytest.approx(15 / 31)
    assert plan.bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert plan.bubble_fraction(1, 8) == 0


def test_in_flight_is_min_of_remaining_stages_and_micro_batches():
    assert [plan.in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [plan.in_flight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]


def test_overlapped_pairs_add_their_records_not_a_micro_batch():
    """parallel.overlap a2a: at pp 1 a pair's forward fills memory as its backward frees it, so the schedule's
    in-flight count stays and the pair adds the records the executor keeps per MoE layer ((3 + 2k) h) and
    per block (h) of one micro-batch; at pp > 1 one more chunk (1/v of the stage) with its records.
    moe_1b_8gpu's plan is then its dry run's heaviest peak (26.2 GB, docs/DRY_RUN.md) within 1%."""
    from moe_trainer.plan.memory import stage_activation_bytes
    prec = plan.precision_for(None, "bf16", "fp32")
    for sets, stage in (([], 0), (["parallel.pp=2", "parallel.virtual_stages=2"], 0),
                        (["parallel.pp=2", "parallel.virtual_stages=2"], 1)):
        base = [str(CONFIGS / "moe_1b_8gpu.yaml"), sets + ["train.compile=false"]]
        off = load_config(base[0], base[1] + ["parallel.overlap=none"])
        on = load_config(base[0], base[1] + ["parallel.overlap=a2a"])
        m, part = on.model, plan.stage_partition(on)
        a, b = (stage_activation_bytes(c, part, stage, 8, prec) for c in (off, on))
        blocks = part[stage]
        moe = blocks - (1 if stage == 0 else 0)  # first_k_dense_replace 1
        records = (moe * (3 + 2 * m.num_experts_per_tok) + blocks) * m.hidden_size * 2 * 4096
        v = on.parallel.virtual_stages
        assert b.in_flight == a.in_flight
        extra = (records + (a.per_micro_batch if v > 1 else 0)) / v
        assert b.no_recompute - a.no_recompute == pytest.approx(extra, rel=1e-9)
        assert b.overlap_extra == pytest.approx(extra, rel=1e-9) and a.overlap_extra == 0
    peak = plan.make_plan(load_config(str(CONFIGS / "moe_1b_8gpu.yaml"), ["parallel.overlap=a2a"]), 8).peak_bytes
    assert 26.2e9 * 0.99 < peak < 26.2e9 * 1.01


def test_balanced_partition():
    assert plan.balanced_partition(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B's split
    split = plan.balanced_partition(61, 16)
    assert sum(split) == 61 and max(split) - min(split) == 1 and split[0] == split[-1] == 3
    assert plan.balanced_partition(5, 2) == [3, 2]
    with pytest.raises(plan.PlanError):
        plan.balanced_partition(3, 4)


# ----------------------------------------------------------------------------- all-to-all

# 4 experts on 2 EP ranks: experts 0, 1 on rank 0; 2, 3 on rank 1. Top-2 routing.
ROUTING = [
    [[0, 1], [0, 2], [2, 3]],  # rank 0's tokens: 0 + 1 + 2 = 3 copies leave; with dedup 0 + 1 + 1 = 2
    [[3, 0], [1, 0], [0, 2]],  # rank 1's tokens: 1 + 2 + 1 = 4 copies leave; with dedup 1 + 1 + 1 = 3
]


def test_alltoall_exact_on_a_hand_made_routing():
    got = plan.alltoall_bytes_exact(ROUTING, n_experts=4, ep=2, rank=0, hidden=3, bytes_per_elem=2)
    row = 3 * 2
    assert (got.dispatch_send, got.dispatch_recv) == (3 * row, 4 * row)
    assert (got.combine_send, got.combine_recv) == (4 * row, 3 * row)
    assert got.total == 14 * row
    dedup = plan.alltoall_bytes_exact(ROUTING, 4, 2, rank=1, hidden=3, bytes_per_elem=2, dedup=True)
    assert (dedup.dispatch_send, dedup.dispatch_recv) == (3 * row, 2 * row)
    assert plan.remote_copies(ROUTING, 4, 2) == [[0, 3], [4, 0]]


def test_alltoall_entry_point_dispatches_on_routing():
    exact = plan.alltoall_bytes(3, 2, 3, 2, 2, routing=ROUTING, n_experts=4, rank=1)
    assert exact.dispatch_send == 4 * 6
    with pytest.raises(plan.PlanError):
        plan.alltoall_bytes_exact([[[0, 4]], [[1, 2]]], 4, 2, 0, 3, 2)  # expert 4 does not exist


def test_expected_alltoall():
    assert plan.alltoall_bytes_expected(4096, 8, 7168, 1, 2).total == 0
    assert plan.alltoall_bytes_expected(4096, 8, 7168, 1, 2, 256, dedup=True).total == 0
    sent = plan.alltoall_bytes_expected(4096, 8, 7168, 64, 2).sent
    assert sent == pytest.approx(4096 * 8 * 7168 * 2 * 2 * (1 - 1 / 64))


def _group_limited_routing(rng, tokens, n_experts, topk, n_group, topk_group):
    per_group = n_experts // n_group
    out = []
    for _ in range(tokens):
        groups = rng.sample(range(n_group), topk_group)
        pool = [g * per_group + i for g in groups for i in range(per_group)]
        out.append(rng.sample(pool, topk))
    return out


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("ep,n_group,topk_group", [(4, 1, 1), (4, 8, 2), (8, 4, 2)])
def test_expected_matches_random_uniform_routing(dedup, ep, n_group, topk_group):
    rng = random.Random(0)
    e, k, tokens = 32, 4, 1500
    routing = [_group_limited_routing(rng, tokens, e, k, n_group, topk_group) for _ in range(ep)]
    measured = sum(plan.alltoall_bytes_exact(routing, e, ep, r, 1, 1, dedup).dispatch_send for r in range(ep)) / ep
    expected = plan.alltoall_bytes_expected(tokens, k, 1, ep, 1, e, dedup, n_group, topk_group).dispatch_send
    assert measured == pytest.approx(expected, rel=0.03)


def test_node_limited_dedup_reaches_at_most_topk_group_ranks():
    # 8 groups of 4 experts on 4 ranks (2 whole groups each): a token reaches at most 2 ranks.
    assert plan.expected_remote_ranks(32, 8, 4, n_group=8, topk_group=2) <= 2
    routing = [_group_limited_routing(random.Random(r), 200, 32, 8, 8, 2) for r in range(4)]
    copies = plan.remote_copies(routing, 32, 4, dedup=True)
    assert all(sum(row) <= 2 * 200 for row in copies)
    assert plan.expected_remote_ranks(32, 8, 4) > 2  # without the group limit it is more


# ----------------------------------------------------------------------------- memory and traffic

def test_zero_shards_dense_over_dp_and_experts_over_edp():
    p = plan.RankParams(dense=1000.0, expert=100.0)
    mixed = plan.PRECISIONS["mixed"]
    z1 = plan.model_state_bytes(p, mixed, 1, dense_group=10, expert_group=2)
    assert (z1.params, z1.grads, z1.optimizer) == (2 * 1100, 2 * 1100, 12 * (100 + 50))
    z3 = plan.model_state_bytes(p, plan.PRECISIONS["fp32"], 3, 10, 2)
    assert (z3.params, z3.grads, z3.optimizer) == (4 * 150, 4 * 150, 8 * 150)


def test_zero_comm_volumes():
    mixed, n, g = plan.PRECISIONS["mixed"], 1e9, 8
    f = (g - 1) / g
    assert plan.zero_comm(n, g, 0, 4, mixed).all_reduce == pytest.approx(2 * f * n * 2)
    assert plan.zero_comm(n, g, 1, 4, mixed).total == pytest.approx(2 * f * n * 2)
    assert plan.zero_comm(n, g, 3, 4, mixed).total == pytest.approx(4 * 3 * f * n * 2)


def test_deepseek_plan_on_2048_gpus(deepseek):
    result = plan.make_plan(deepseek, 2048)
    assert (result.dp, result.edp, result.micro_batches) == (128, 2, 120)
    assert result.stages[0].activations.in_flight == 16
    assert result.bubble == pytest.approx(15 / 135)
    assert result.stages[1].params.expert == pytest.approx(4 * 256 * 3 * 7168 * 2048 / 64)
    # the trainer's cost-balanced split: stage 0 = 3 dense + 1 MoE layer; the last stage,
    # which also pays the 129K-vocabulary head twice (main + MTP), = 1 layer + the MTP block
    assert plan.stage_partition(deepseek) == [4] * 15 + [1]
    assert result.stages[0].moe_blocks == 1 and result.stages[-1].moe_blocks == 2
    # the MTP module is named where the last stage counts it
    assert result.stages[-1].mtp_blocks == 1 and all(s.mtp_blocks == 0 for s in result.stages[:-1])
    report = plan.format_plan(result)
    assert "| 15 | 1 + MTP 1 | 2 |" in report and "Stage 15 also holds the multi-token-prediction module" in report
    for s in result.stages:
        assert s.activations.full_recompute < s.activations.no_recompute
    assert result.fits
    assert not plan.make_plan(load_config(str(CONFIGS / "deepseek_v3_671b.yaml"),
                                          ["parallel.recompute=none"]), 2048).fits


def test_llama3_128k_layout_uses_context_parallelism():
    cfg = load_config(str(CONFIGS / "llama3_405b_128k.yaml"))
    result = plan.make_plan(cfg, 16384)
    assert (result.dp, result.cp, result.tp, result.micro_batches, result.dense_group) == (8, 16, 8, 16, 128)
    assert all(s.comm.context > 0 and s.comm.all_to_all == 0 for s in result.stages)


# ----------------------------------------------------------------------------- command line

def test_cli_plan_json_and_help():
    out = run_cli("--config", "configs/moe_tiny.yaml", "--gpus", "2", "--set", "parallel.ep=2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["dp"] == 2 and data["ep"] == 2 and data["params"]["total"]["total"] > 0
    helped = run_cli("--help")
    assert helped.returncode == 0 and "zero --params" in helped.stdout


@pytest.mark.parametrize("args,message", [
    (["--config", "configs/missing.yaml", "--gpus", "8"], "config file configs/missing.yaml does not exist"),
    (["--config", "configs/deepseek_v3_671b.yaml", "--gpus", "100"],
     "--gpus 100 does not factor into the layout: it must be a multiple of parallel.pp x parallel.tp x parallel.cp "
     "= 16 x 1 x 1 = 16 (e.g. --gpus 96 or 112)."),
    (["--config", "configs/moe_tiny.yaml", "--gpus", "3"],
     "--gpus 3 does not factor into the layout (data parallel 3): train.global_batch_size (16) must be a multiple"),
    (["--config", "configs/moe_tiny.yaml", "--gpus", "2", "--set", "parallel.ep=4"],
     "--gpus 2 does not factor into the layout (data parallel 2): parallel.ep (4) must divide"),
    (["--config", "configs/moe_tiny.yaml", "--gpus", "2", "--set", "parallel.pp=two"],
     "parallel.pp must be of type int"),
])
def test_cli_bad_input_is_one_sentence(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""


def test_cli_plan_that_does_not_fit_exits_3():
    out = run_cli("--config", "configs/deepseek_v3_671b.yaml", "--gpus", "2048", "--gpu-memory-gb", "10")
    assert out.returncode == 3
    assert "does not fit" in out.stderr and "Traceback" not in out.stderr
    assert "Verdict" in out.stdout


def _kinds(stage) -> dict:
    c = stage.comm
    return {"dense_dp": c.dense_dp.total, "expert_dp": c.expert_dp.total, "all_to_all": c.all_to_all,
            "pipeline": c.pipeline, "tensor": c.tensor, "context": c.context}


def test_node_split_follows_the_rank_order_and_adds_up():
    cfg = load_config("configs/moe_1b_16gpu.yaml", [])
    p = plan.make_plan(cfg, 16, gpus_per_node=8)
    assert p.gpus_per_node == 8 and p.rank_order == "tp-cp-dp-pp"
    for s in p.stages:
        for kind, total in _kinds(s).items():  # every byte is inside a node or across
            assert within(s.nodes[kind].intra_node + s.nodes[kind].inter_node, total, 1e-9) or total == 0, kind
        a2a, pipe = s.nodes["all_to_all"], s.nodes["pipeline"]
        assert a2a.inter_node == 0 and a2a.intra_node > 0 and a2a.nodes == 1  # EP inside a node
        assert pipe.intra_node == 0 and pipe.inter_node > 0  # one stage per node
    # the order MoE runs had before: every EP group {0, 2, ..., 14} over both nodes, 4 of 7 peers remote
    old = plan.make_plan(load_config("configs/moe_1b_16gpu.yaml", ["parallel.rank_order=tp-cp-pp-dp"]), 16)
    a2a = old.stages[0].nodes["all_to_all"]
    assert a2a.nodes == 2 and within(a2a.inter_node, old.stages[0].comm.all_to_all * 4 / 7, 1e-9)
    assert old.stages[0].nodes["pipeline"].inter_node == 0  # while the pipeline stayed inside a node
    assert old.stages[0].comm_seconds > p.stages[0].comm_seconds


def test_link_speeds_set_the_time():
    cfg = load_config("configs/moe_1b_16gpu.yaml", [])
    slow = plan.make_plan(cfg, 16, links=plan.Links(ib_gbps=200))
    fast = plan.make_plan(cfg, 16, links=plan.Links(ib_gbps=400))
    pipe = lambda p: p.stages[0].nodes["pipeline"]  # noqa: E731
    assert within(pipe(slow).seconds, 2 * pipe(fast).seconds, 1e-9)
    assert within(pipe(fast).seconds, pipe(fast).inter_node / 50e9, 1e-9)  # 400 Gb/s = 50 GB/s
    a2a = fast.stages[0].nodes["all_to_all"]
    assert within(a2a.seconds, a2a.intra_node / 450e9, 1e-9)  # NVLink's default, 3600 Gb/s


def test_deepseek_v3_plan_spans_8_nodes_per_ep_group(deepseek):
    p = plan.make_plan(deepseek, 2048, gpus_per_node=8)
    a2a = p.stages[0].nodes["all_to_all"]
    assert a2a.nodes == 8 and within(a2a.inter_node, p.stages[0].comm.all_to_all * 56 / 63, 1e-9)
    assert p.stages[0].nodes["expert_dp"].nodes == 2  # the two replicas of an expert, 64 ranks apart


def test_plan_cli_link_flags_and_bad_values():
    out = run_cli("--config", "configs/moe_1b_16gpu.yaml", "--gpus", "16", "--ib-gbps", "100")
    assert out.returncode == 0 and "network 100 Gb/s (12.5 GB/s)" in out.stdout
    assert "Inside and across nodes" in out.stdout
    bad = run_cli("--config", "configs/moe_1b_16gpu.yaml", "--gpus", "16", "--ib-gbps", "0")
    assert bad.returncode == 2 and "--ib-gbps must be positive" in bad.stderr


def test_bf16_plans_count_fp32_gradients_unless_accumulated_in_bf16():
    fp32_grads = plan.make_plan(load_config("configs/moe_1b_16gpu.yaml", ["train.dtype=bf16"]), 16)
    bf16_grads = plan.make_plan(load_config("configs/moe_1b_16gpu.yaml", ["train.dtype=bf16",
                                                                         "train.grad_accum_dtype=bf16"]), 16)
    assert fp32_grads.precision.name == "mixed_fp32_grads" and bf16_grads.precision.name == "mixed"
    a, b = fp32_grads.stages[0], bf16_grads.stages[0]
    assert within(a.states.grads, 2 * b.states.grads, 1e-9)  # 4 bytes per parameter instead of 2
    assert within(a.comm.dense_dp.all_reduce, 2 * b.comm.dense_dp.all_reduce, 1e-9)  # reduced in fp32
    # redundant slots (2 a rank) add, per MoE layer, 2 copies' weights (kept, bf16) and their gradients summed
    # over the step (fp32: the run's accumulation dtype) beside the activations; no slot weights per micro-batch
    # in flight (the kernels take the parameters and the copies as they are, MoE._run_experts): one expert row
    # is 3 x 2048 x 1024 bf16. Stage 0: 8 MoE layers; stage 1: 7. After the last backward, one layer's hand-back
    # adds its owned rows' gradients twice (24 experts / ep 8 = 3 rows, bf16) to the sums.
    # (The dry run of this config: docs/BENCHMARKS_ep.md "Redundant slots".)
    row, sets = 3 * 2048 * 1024 * 2, ["train.dtype=bf16", "parallel.replace_every=1"]
    modes = ("selective", "full")
    plans = {(rc, r): plan.make_plan(load_config("configs/moe_1b_16gpu.yaml", sets + [
        f"parallel.recompute={rc}", f"parallel.redundant_slots={r}"]), 16) for rc in modes for r in (0, 2)}
    added = {rc: [c.total - b.total for b, c in zip(plans[rc, 0].stages, plans[rc, 2].stages)] for rc in modes}
    assert added["selective"] == [(8 * 2 + 8 * 2 * 2) * row, (7 * 2 + 7 * 2 * 2) * row]
    assert [s.copies.activations for s in plans["full", 2].stages] == [8 * 2 * 2 * row, 7 * 2 * 2 * row]
    assert [s.copies.after_backward for s in plans["full", 2].stages] == [(32 + 6) * row, (28 + 6) * row]
    # full recomputation: stage 0's activations and sums stay under its gradient buckets (only the copies'
    # weights add); stage 1's activations bind with or without copies
    assert added["full"] == [8 * 2 * row, (7 * 2 + 7 * 2 * 2) * row]


def test_llama3_405b_fits_80gb_with_metas_choices():
    """Meta trained 405B at TP 8 x PP 16 x DP 128 on 80 GB H100s. As this trainer would run it (ZeRO-1,
    fp32 gradients whole on every rank, the sequence-parallel regions keeping their gathered input)
    it does not fit; with Meta's choices, gradients sharded with the optimizer state over the
    data-parallel ranks (FSDP, --zero 2) and Megatron's sharded sequence-parallel inputs
    (--sp-regather), the heaviest stage does."""
    cfg = load_config(str(CONFIGS / "llama3_405b.yaml"))
    ours = plan.make_plan(cfg, 16384)
    meta = plan.make_plan(cfg, 16384, zero=2, sp_regather=True)
    assert not ours.fits and meta.fits
    assert meta.partition == [7] + [8] * 14 + [7] and meta.peak_stage == 1
    # the gathered inputs are what --sp-regather takes away: two regions per layer, h (1 - 1/8) bf16 each,
    # for 8 layers x 15 micro-batches in flight and the layer whose backward runs (its gradients' peak)
    tokens, h, flight = 8192, 16384, 15
    gathered = 2 * h * 2 * (1 - 1 / 8) * tokens * (8 * flight + 1)
    regather = plan.make_plan(cfg, 16384, sp_regather=True)
    assert ours.stages[1].activation_bytes - regather.stages[1].activation_bytes == pytest.approx(gathered)
    # ZeRO-2 takes the fp32 gradients (4 bytes per parameter) down to a 1/128 shard
    p = meta.stages[1].params.dense
    assert regather.stages[1].states.grads - meta.stages[1].states.grads == pytest.approx(4 * p * (1 - 1 / 128))

"""The planner (moe_trainer/plan.py, tools/plan.py) against what the real Trainer holds and sends (issue #8).

Each case builds the real Trainer on 2 gloo rank processes (moe_trainer.bench.layouts.measure_layout,
the ranks started by conftest.start_ranks: as moe_trainer.train does, with DeepSpeed's comms logger switched on through
zero.deepspeed_config(comms_logger=True)), runs 2 optimizer steps, and compares rank by rank with
plan.make_plan(cfg, 2) for the rank's pipeline stage:

memory (exact, except DeepSpeed's alignment padding)
  * sum(p.numel()) of engine.module == RankParams.dense + expert of the stage; parameter bytes ==
    ModelStateBytes.params;
  * ZeRO-1 optimizer state: 4 bytes x (DeepSpeedZeroOptimizer.single_partition_of_fp32_groups + Adam's
    exp_avg + exp_avg_sq) == ModelStateBytes.optimizer (recipe fp32_master: 12 bytes per sharded
    parameter), within DeepSpeed's padding: each param group's flat buffer is padded to a multiple of
    2 x dp elements (nccl_start_alignment_factor = 2), so at most 2 extra elements per group and rank.

traffic, bytes one rank sends per step (ring convention: all-reduce 2(g-1)/g, all-gather (g-1)/g x size)
  * expert all-to-all: the trainer's CommCounter (dispatch, combine + _grad) == plan.alltoall_bytes_exact
    of the routing recorded in the step, exactly; and the planner's uniform-routing expectation
    (StageComm.all_to_all) within 25% of the average over ranks and steps (real routing is not uniform);
  * tensor parallel (tp_* kinds, with and without sequence parallelism) == StageComm.tensor, exactly;
  * context parallel (cp_* kinds) == StageComm.context, exactly;
  * pipeline send (pp_send, counted by PipelineExecutor) == StageComm.pipeline, exactly; received the same;
  * DeepSpeed's ZeRO-1 collectives from the comms logger: the gradient all-reduce message == every
    gradient (dense + expert) x 4 bytes exactly, and its ring bytes == ZeroComm.all_reduce exactly;
    the parameter all-gather == ZeroComm.all_gather within the padding above ((g-1) x 2 elements per
    group). Scalar all-reduces of gradient norms / overflow flags (<= 8 bytes) are not planned and
    are only checked to be scalars.
"""
import pytest

from moe_trainer import plan
from moe_trainer.bench.layouts import comm_by_kind, measure_layout, zero_ring_bytes
from moe_trainer.resolve import load_config

from conftest import ROOT, TINY, start_ranks
from test_dense_parity import DENSE

MOE, LLAMA = "configs/moe_tiny.yaml", "configs/llama3_tiny.yaml"
CASES = {  # name: (config, overrides); world 2 each
    "moe_ep2": (MOE, TINY + ["parallel.ep=2"]),
    "moe_ep2_bf16": (MOE, TINY + ["parallel.ep=2", "train.dtype=bf16"]),  # DeepSpeed's BF16_Optimizer path
    "moe_pp2_mtp": (MOE, TINY + ["parallel.pp=2", "model.num_nextn_predict_layers=1"]),
    "dense_tp2_sp": (LLAMA, DENSE + ["parallel.tp=2"]),
    "dense_tp2_no_sp": (LLAMA, DENSE + ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    "dense_cp2": (LLAMA, DENSE + ["parallel.cp=2"]),
}
WORLD, ELEM, ALIGN = 2, 4, 2  # fp32 configs; DeepSpeed's nccl_start_alignment_factor


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    config, overrides = CASES[request.param]
    if not any(o.startswith("train.dtype=") for o in overrides):
        overrides = overrides + ["train.dtype=fp32"]  # what these CPU ranks train in (auto: the planner assumes GPUs' bf16)
    cfg = load_config(str(ROOT / config), overrides)
    ranks = measure_layout(config, overrides, WORLD, steps=2, out_dir=str(tmp_path_factory.mktemp("honesty")),
                           start=start_ranks)
    return request.param, cfg, plan.make_plan(cfg, WORLD), ranks


def test_parameters_and_optimizer_state_per_rank(case):
    name, cfg, p, ranks = case
    for r in ranks:
        stage = p.stages[r["stage"]]
        assert r["numel"] == stage.params.dense + stage.params.expert, (name, r["rank"])
        assert r["param_bytes"] == stage.states.params, (name, r["rank"])
        opt = r["optimizer"]
        assert opt["exp_avg"] == opt["exp_avg_sq"] == opt["fp32_partition"]
        measured = ELEM * (opt["fp32_partition"] + opt["exp_avg"] + opt["exp_avg_sq"])
        padding = 3 * ELEM * ALIGN * opt["groups"]  # <= 2 padded elements per group, in each of 3 tensors
        assert 0 <= measured - stage.states.optimizer <= padding, (name, r["rank"], measured, stage.states.optimizer)


def test_collective_bytes_per_step(case):
    name, cfg, p, ranks = case
    a2a_measured, a2a_planned = [], []
    for r in ranks:
        stage = p.stages[r["stage"]]
        for step in r["steps"]:
            kinds = comm_by_kind(step["sent"])
            assert kinds["tp_all_gather"] + kinds["tp_reduce_scatter"] + kinds["tp_all_reduce"] == stage.comm.tensor
            assert kinds["cp"] == stage.comm.context
            assert kinds["pp_send"] == stage.comm.pipeline
            assert sum(v for k, v in step["received"].items() if k.startswith("pp_")) == stage.comm.pipeline
            assert kinds["all_to_all"] == step["alltoall_exact"]  # exact routing: to the byte
            a2a_measured.append(kinds["all_to_all"])
            a2a_planned.append(stage.comm.all_to_all)
            # DeepSpeed's own collectives (comms logger)
            expert = r["expert_numel"] if cfg.parallel.ep > 1 else 0
            z = zero_ring_bytes(step["ds_ops"], r["numel"] - expert, expert, r["dense_group"], r["edp"], ELEM)
            assert z["other"] == [], z["other"]
            assert z["grad_message_bytes"] == r["numel"] * ELEM  # every gradient, all-reduced once per step
            planned = stage.comm.dense_dp.all_reduce + stage.comm.expert_dp.all_reduce
            assert z["all_reduce"] == pytest.approx(planned, abs=1e-6), (name, z, planned)
            gathered = stage.comm.dense_dp.all_gather + stage.comm.expert_dp.all_gather
            pad = (r["dense_group"] - 1) * ALIGN * ELEM * r["optimizer"]["groups"]
            assert 0 <= z["all_gather"] - gathered <= pad, (name, z["all_gather"], gathered)
            assert stage.comm.dense_dp.reduce_scatter == stage.comm.expert_dp.reduce_scatter == z["reduce_scatter"] == 0
    if cfg.parallel.ep > 1:
        mean = sum(a2a_measured) / len(a2a_measured)
        assert all(x > 0 for x in a2a_measured)
        assert mean == pytest.approx(sum(a2a_planned) / len(a2a_planned), rel=0.25), (a2a_measured, a2a_planned)
    else:
        assert sum(a2a_measured) == sum(a2a_planned) == 0


def test_every_traffic_kind_is_exercised():
    """The cases between them cover each planned kind with a non-zero value."""
    covered = set()
    for config, overrides in CASES.values():
        cfg = load_config(str(ROOT / config), overrides)
        for s in plan.make_plan(cfg, WORLD).stages:
            c = s.comm
            covered |= {k for k, v in (("dp_all_reduce", c.dense_dp.all_reduce), ("dp_all_gather", c.dense_dp.all_gather),
                                       ("a2a", c.all_to_all), ("pp", c.pipeline), ("tp", c.tensor),
                                       ("cp", c.context)) if v > 0}
    assert covered == {"dp_all_reduce", "dp_all_gather", "a2a", "pp", "tp", "cp"}

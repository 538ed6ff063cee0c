"""The step-time model (plan/time.py) and the layout search (plan/search.py): the analytic counts held
to the project's own counting (the kernel proxy, the trainer's metrics), the schedule's formulas, the
four published runs, the search's speed, and the command line."""
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_trainer import metrics
from moe_trainer.bench import kernel_proxy
from moe_trainer.resolve import load_config
from moe_trainer.plan import published
from moe_trainer.plan.gpus import Efficiency, gpu_named
from moe_trainer.plan.memory import layer_acts
from moe_trainer.plan.search import search
from moe_trainer.plan.time import Mechanisms, model_flops_per_token, step_time
from moe_trainer.plan.replacement import natural_imbalance, read_load
from moe_trainer.plan.work import block_work, setup_from_config

ROOT = Path(__file__).resolve().parents[1]


def _cfg(name, *overrides):
    cfg = load_config(str(ROOT / "configs" / name), list(overrides))
    if cfg.model.vocab_size == "auto":
        cfg.model.vocab_size = 320
    return cfg


@pytest.mark.parametrize("name,overrides", [("moe_tiny.yaml", []), ("llama3_tiny.yaml", []),
                                            ("deepseek_v3_671b.yaml", []), ("llama3_405b.yaml", [])])
def test_model_flops_equal_the_trainers_count(name, overrides):
    cfg = _cfg(name, *overrides)
    s = setup_from_config(cfg, cfg.parallel.pp * cfg.parallel.tp * cfg.parallel.cp * max(1, cfg.parallel.ep))
    ours = model_flops_per_token(s)
    theirs = metrics.train_flops_per_token(cfg.model, cfg.train.seq_len)
    # the trainer counts (T + 1) / 2 keys per query, the model T / 2: a few parts in 10^4 apart
    assert ours == pytest.approx(theirs, rel=2e-3)


@pytest.mark.parametrize("case", ["layer", "moe_1b_gpu"])
def test_layer_flops_equal_the_kernel_proxys_count(case):
    """One MoE layer's GEMM and attention FLOPs, forward + backward, as the proxy counts them op by op on
    the meta device (router and all: every 2-D weight the layer multiplies)."""
    cfg, micro_batch, _ = kernel_proxy._config(case)
    counted = kernel_proxy.count(case)
    cfg.train.micro_batch_size = micro_batch
    s = setup_from_config(cfg, 1)
    w = block_work(s, cfg.model.first_k_dense_replace)
    assert 3 * sum(g.flops for g in w.gemms) == pytest.approx(counted["gemm"]["flops"], rel=0.01)
    assert w.attn_flops + w.attn_bwd_flops == pytest.approx(counted["sdpa"]["flops"], rel=0.01)


@pytest.mark.parametrize("case", ["layer", "moe_1b_gpu"])
def test_glue_ratio_is_the_proxys(case):
    """Efficiency.glue_passes is the proxy's glue bytes over the planner's stored activation bytes."""
    cfg, _, _ = kernel_proxy._config(case)
    counted = kernel_proxy.count(case)
    acts = layer_acts(cfg.model, cfg.model.first_k_dense_replace, 1, 2).per_rank(1, False)
    ratio = (counted["bytes_written_per_token"] + counted["bytes_read_per_token"]) / acts
    assert ratio == pytest.approx(Efficiency().glue_passes, rel=0.1)


def test_bubble_and_overlap_follow_their_formulas():
    cfg = _cfg("deepseek_v3_671b.yaml")
    s = setup_from_config(cfg, 2048)
    gpu, eff = gpu_named("h800"), Efficiency()
    mech = Mechanisms(host="graphs")  # no host term: the device's own schedule
    plain = step_time(s, gpu, eff, mech, 1.0)
    per_mb = plain.step - plain.bubble - plain.split["data_parallel"] - plain.optimizer
    p, m = s.pp, s.micro_batches
    assert plain.bubble / (per_mb + plain.bubble) == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
    over = step_time(s, gpu, eff, dataclasses.replace(mech, a2a_overlap=True), 1.0)
    a2a = plain.totals["all_to_all"]
    # paired sub-layer overlap hides at most what min(compute, all-to-all) would, and here not all of it
    assert a2a - min(plain.compute, a2a) <= over.split["all_to_all"] < a2a
    assert over.step < plain.step
    inter = step_time(dataclasses.replace(s, virtual_stages=4), gpu, eff, mech, 1.0)
    busy = inter.step - inter.bubble - inter.split["data_parallel"] - inter.optimizer
    assert inter.bubble / (busy + inter.bubble) == pytest.approx((p - 1) / (4 * m + p - 1), rel=1e-9)
    worse = step_time(s, gpu, eff, mech, 1.3)
    assert worse.totals["compute.expert_gemm"] > plain.totals["compute.expert_gemm"] * 1.25


def test_dualpipe_ranks_hold_two_stages_and_fp8_pays_its_quantisation():
    """DualPipe: rank r runs half the micro-batches through stage r and half through stage p-1-r, so the
    slowest rank's compute is the largest mean of a mirrored pair, not the slowest stage's. FP8 GEMMs
    add their quantisation passes (5 bytes per element of each GEMM's input and output) to the glue."""
    from moe_trainer.plan.time import stage_compute
    s = setup_from_config(_cfg("deepseek_v3_671b.yaml", "parallel.recompute=none"), 2048)
    gpu, eff = gpu_named("h800"), Efficiency()
    mech = Mechanisms(host="graphs", schedule="dualpipe")
    per_stage = [sum(stage_compute(s, st, gpu, eff, mech, 1.0).values()) for st in range(s.pp)]
    assert per_stage[-1] > max(per_stage[1:-1]) * 1.05  # the head's stage is the slowest alone
    r = step_time(s, gpu, eff, mech, 1.0)
    pairs = [(per_stage[i] + per_stage[s.pp - 1 - i]) / 2 for i in range(s.pp)]
    assert r.micro_batch_compute == pytest.approx(pairs[r.stage], rel=1e-9)  # the slowest rank's pair
    assert r.micro_batch_compute <= max(pairs) < per_stage[-1]
    fp8 = dataclasses.replace(mech, gemm_dtype="fp8")
    glue8, glue16 = (stage_compute(s, 1, gpu, eff, m, 1.0)["glue"] for m in (fp8, mech))
    w = block_work(s, 4, 1.0)
    quant = sum(5 * g.count * g.rows * (g.inner + g.cols) for g in w.gemms)
    assert glue8 - glue16 == pytest.approx(s.partition[1] * quant / (gpu.hbm_tbs * 1e12 * eff.memory), rel=1e-6)


def test_paired_overlap_hides_each_transfer_behind_its_partner_only():
    """Each of a MoE block's four transfers hides behind one compute phase of the paired micro-batch:
    compute longer than every transfer hides all; one long transfer shows by its excess alone."""
    from moe_trainer.plan.time import _paired_a2a_exposed
    mech = Mechanisms(a2a_overlap=True)
    assert _paired_a2a_exposed(4.0, 12.0, 0.5, mech) == 0.0  # slots of 2, 4, 2, 4 against transfers of 1
    assert _paired_a2a_exposed(4.0, 0.0, 0.5, mech) == pytest.approx(4.0)  # nothing to hide behind
    # all compute on the MLP side: the two transfers beside attention phases (1 each) stay exposed
    assert _paired_a2a_exposed(4.0, 30.0, 0.0, mech) == pytest.approx(2.0)
    # FP8 dispatch: both transfers towards the experts (forward dispatch, backward combine) carry half a
    # BF16 transfer's bytes (3 = 0.5 u + 0.5 u + u + u, u = 1); all on the MLP side, the two beside attention
    # (the backward combine, 0.5, and the forward combine, 1) stay exposed
    fp8 = dataclasses.replace(mech, fp8_dispatch=True)
    assert _paired_a2a_exposed(3.0, 0.0, 0.5, fp8) == pytest.approx(3.0)
    assert _paired_a2a_exposed(3.0, 30.0, 0.0, fp8) == pytest.approx(1.5)


def test_a_full_recomputation_replay_sends_its_transfers_exposed_or_none():
    """Megatron's full recomputation under the overlap replays each layer, dispatch and combine included,
    right before its backward, exposed (a third of the transfers); this trainer's overlapped executor
    checkpoints the pieces between the all-to-alls, so its replay sends no rows: two thirds of the bytes.
    Without the overlap the replay's transfers are sent and exposed like the rest."""
    from moe_trainer.plan.time import a2a_exposure, comm_seconds, replay_share, trainer_mechanisms
    pub = published.OVERLAP_CHECK[0]  # Megatron-LM PR #6429's layout, full recomputation
    s = setup_from_config(load_config(str(ROOT / pub.config), list(pub.overrides)), pub.gpus)
    assert s.recompute == "full"
    gpu, eff = gpu_named("h100"), Efficiency()
    megatron = Mechanisms(a2a_overlap=True)
    ours = trainer_mechanisms(True, a2a_overlap=True)
    assert not ours.replay_a2a and trainer_mechanisms(True).replay_a2a
    assert replay_share(s, megatron) == pytest.approx(1 / 3) and replay_share(s, ours) == 0.0
    assert replay_share(dataclasses.replace(s, recompute="selective"), megatron) == 0.0
    sent = comm_seconds(s, 1, gpu, eff, 1.0, megatron)["all_to_all"]
    assert comm_seconds(s, 1, gpu, eff, 1.0, ours)["all_to_all"] == pytest.approx(2 / 3 * sent)
    # behind compute long enough to hide every paired transfer: only the replay's third and the unpaired
    # chunks' transfers are left
    block = (4, 1.0, 0.5, 0.25, 0.0)
    t = a2a_exposure(0.3, 0.0, block, megatron, replay=1 / 3)
    assert t["paired"] == 0.0 and t["replay"] == pytest.approx(0.75 * 0.1) and t["unpaired"] == pytest.approx(0.075)
    assert a2a_exposure(0.3, 0.0, block, Mechanisms(), replay=1 / 3)["exposed"] == pytest.approx(0.3)


def test_host_launches_bound_a_small_model_and_syncs_drain_the_queue():
    """moe_bench (a few million parameters) is launch-bound eager: its step is the host's; compiling
    launches fewer kernels for less each; at ep > 1 the tokens-per-expert read per MoE block stops the
    host from running ahead, so the same launches cost more than at ep 1."""
    gpu, eff = gpu_named("h200"), Efficiency()
    bench = setup_from_config(_cfg("moe_bench.yaml"), 1)
    eager = step_time(bench, gpu, eff, Mechanisms(host="eager"), 1.0)
    assert eager.host_wait > 0.9 * (eager.step - eager.optimizer)
    # the figure host_eager_us comes from: 0.197 s per step on the H200 (docs/BENCHMARKS.md)
    assert eager.step == pytest.approx(0.197, rel=0.1)
    compiled = step_time(bench, gpu, eff, Mechanisms(host="compiled", fused_glue=True), 1.0)
    assert compiled.step < eager.step / 2
    graphs = step_time(bench, gpu, eff, Mechanisms(host="graphs", grad_accum_fusion=True), 1.0)
    assert graphs.host_wait == 0.0
    hooks = step_time(bench, gpu, eff, Mechanisms(host="graphs"), 1.0)  # BF16_Optimizer's hooks stay eager
    assert hooks.host_wait > 0
    s = setup_from_config(_cfg("moe_1b_8gpu.yaml"), 8)
    assert s.ep > 1
    drained = step_time(s, gpu, eff, Mechanisms(host="compiled", fused_glue=True), 1.0)
    free = step_time(s, gpu, eff, Mechanisms(host="compiled", fused_glue=True, a2a_sync=False), 1.0)
    assert drained.step > free.step


def test_the_published_runs():
    """Within +-20%: Llama 3 405B, DeepSeek-V3 671B, Mixtral 8x22B, this trainer's eager moe_1b_gpu on
    one H200, the cross-check Qwen3-30B-A3B since Megatron-Core's host time per kernel was measured
    by proxy (host_megatron_us, bench/host_proxy: 1.37x at a fused launcher's 9 us), Megatron's EP
    overlap off and on (Megatron-LM PR #6429), and Qwen3-235B-A22B as NVIDIA re-measured its recipe
    since the overlap hides what Megatron's was measured to hide (megatron_a2a_hidden; 1.30x at the
    phases' ideal). Held where they land, outside the band (docs/PLANS.md, "Held to published runs",
    says why):
    - Qwen3-235B-A22B at the recipe README's 214.3: 1.39x; the same layout's three other figures (245
      without EP overlap and 276 with, Megatron-MoE-ModelZoo at its own settings; 302.0 re-measured) read
      1.20, 1.10, 0.99;
    - moe_1b_gpu compiled 1.95x: the model's device time is half the measured step and the sourced
      launch costs keep it device-bound: the missing second is not split without a profile.
    Megatron's forced balance is random router logits: Qwen3 is timed at uniform routing's imbalance.
    NVIDIA re-measured both Qwen3 recipes (Megatron-LM PR #5728): 302.0 and 240.5, held as their own rows.
    One MoE layer alone is costed slower than Megatron's own H100 layer benchmark measures it, and only the
    fine-grained runs move with the host's time per kernel (docs/PLANS.md, "Why the fine-grained MoE runs
    read fast")."""
    def ratios(eff):
        got = {}
        for pub, setup in runs:
            r = step_time(setup, gpu_named(pub.gpu), eff, pub.mechanisms, published.imbalance_of(pub))
            est = published.estimate_in_unit(pub.unit, r.tokens_per_s_per_gpu, r.model_tflops_per_gpu, r.mfu)
            got[pub.name.split(" (")[0]] = published.ratio(pub.unit, est, pub.figure)
        return got
    runs = published.calibration_setups(ROOT)
    got = ratios(Efficiency())
    assert 0.8 <= got["Llama 3 405B, 8K"] <= 1.2
    assert 0.8 <= got["DeepSeek-V3 671B"] <= 1.2
    assert 0.8 <= got["Mixtral 8x22B"] <= 1.2
    assert 0.8 <= got["moe_1b_gpu eager"] <= 1.2
    # Qwen3-235B's EP overlap hides what Megatron's was measured to hide on another layout (below); the
    # recipe's README figure stays outside, NVIDIA's re-measurement of the same recipe (Megatron-LM PR
    # #5728: 214.3 -> 302.0, and 234.1 -> 240.5 for 30B) lands
    assert 1.3 < got["Qwen3-235B-A22B"] < 1.5
    assert 0.9 < got["Qwen3-235B-A22B re-measured"] < 1.1
    # the cross-check: the same fine-grained layer inside one node, no EP overlap, no pipeline; host-bound at
    # Megatron's measured host time (a fused launcher's 9 us read 1.37 and 1.33)
    assert 1.0 < got["Qwen3-30B-A3B"] < 1.2
    assert 1.0 < got["Qwen3-30B-A3B re-measured"] < 1.2
    # the same model at the ModelZoo's layouts (Megatron-MoE-ModelZoo, 256 H100; not fitted): the recipe's
    # cross-node EP 32 without and with the EP overlap land at the band's edge and inside it; the two intra-node
    # EP 8 layouts are measured far slower than modelled (docs/PLANS.md says what the model leaves out there)
    assert 1.1 < got["Qwen3-235B-A22B, EP 32, no EP overlap"] < 1.25
    assert 1.0 < got["Qwen3-235B-A22B, EP 32, EP overlap"] < 1.2
    assert 1.7 < got["Qwen3-235B-A22B, PP 32, EP 8, alltoall"] < 1.9
    assert 1.3 < got["Qwen3-235B-A22B, TP 4, EP 8"] < 1.5
    # Megatron's EP overlap off and on, one layout, one cluster (Megatron-LM PR #6429): megatron_a2a_hidden is
    # the share of the phases' ideal hiding that makes the model's on / off gain the measured 1.077x; the
    # full recomputation's replayed all-to-alls are exposed as Megatron issues them
    off, on = got["DeepSeek-V3 proxy, EP overlap off"], got["DeepSeek-V3 proxy, EP overlap on"]
    assert 0.9 < off < 1.05 and on == pytest.approx(off, abs=0.01)
    # and without the recomputation (PR #6311): what full recomputation costs is costed right too
    assert 0.95 < got["DeepSeek-V3 proxy, no recompute, EP overlap off"] < 1.05
    (_, s_off), (p_on, s_on) = [r for r in runs if r[0] in published.OVERLAP_CHECK]

    def on_arm(**change):
        return step_time(s_on, gpu_named("h100"), Efficiency(), dataclasses.replace(p_on.mechanisms, **change))
    # the phases' ideal hiding would read 1.12 (a gain of 1.25x), and sending the replay hidden too 1.21
    assert 1.05 < on_arm(a2a_hiding="phases").model_tflops_per_gpu / p_on.figure < 1.2
    assert on_arm(a2a_hiding="phases", replay_a2a=False).model_tflops_per_gpu / p_on.figure > 1.2
    fused = ratios(dataclasses.replace(Efficiency(), host_megatron_us=Efficiency().launch_us))
    assert 1.25 < fused["Qwen3-30B-A3B"] < 1.5 and fused["Qwen3-235B-A22B"] == pytest.approx(got["Qwen3-235B-A22B"])
    # Qwen3-235B's device waits on its all-to-all more than on its host: at 72 us per kernel it moves by 3%
    # (calibrate's sweep), by 12% with TE's per-expert launches at 72 us too (below)
    assert 1.8 < got["moe_1b_gpu compiled"] < 2.1
    # one MoE layer alone against Megatron-LM's own H100 layer benchmark (moe_perf): the model costs it
    # slower than measured, top-2 and top-8 alike, so the whole runs' optimism is not the MoE layer's compute
    speed = {name.split(" (")[0]: measured / (sum(parts.values()) * 1e3)
             for name, measured, parts in published.moe_layer_rows()}
    assert 0.78 < speed["Mixtral proxy"] < 0.95
    assert 0.6 < speed["DeepSeek proxy"] < 0.8
    # at this trainer's measured eager host time per kernel (72 us) instead of a fused launcher's 9 us and
    # Megatron's 41, the big-layer runs do not move and every fine-grained MoE run slows by more than a
    # fifth: the host binds only where a layer's device time is short
    slow = ratios(dataclasses.replace(Efficiency(), launch_us=72.0, host_megatron_us=72.0))
    for name in ("Llama 3 405B, 8K", "DeepSeek-V3 671B", "Mixtral 8x22B", "moe_1b_gpu eager"):
        assert slow[name] == pytest.approx(got[name], rel=0.01)
    assert 0.8 * got["Qwen3-235B-A22B"] < slow["Qwen3-235B-A22B"] < got["Qwen3-235B-A22B"]
    for name in ("Qwen3-30B-A3B", "moe_1b_gpu compiled"):
        assert slow[name] < 0.8 * got[name]


def test_megatron_hiding_share_is_what_its_on_off_pair_measures():
    """Efficiency.megatron_a2a_hidden is re-derived from Megatron-LM PR #6429's pair: the share of the
    phases' ideal hiding at which the model's on / off gain is the measured 185.2 -> 199.5; a change to
    the model that moves it shows here. At 0 the overlap buys nothing (no SMs held back on that run)."""
    (p_off, s_off), (p_on, s_on) = [r for r in published.calibration_setups(ROOT, measured=False)
                                    if r[0] in published.OVERLAP_CHECK]
    gpu = gpu_named("h100")
    off = step_time(s_off, gpu, Efficiency(), p_off.mechanisms).model_tflops_per_gpu

    def gain(share):
        eff = dataclasses.replace(Efficiency(), megatron_a2a_hidden=share)
        return step_time(s_on, gpu, eff, p_on.mechanisms).model_tflops_per_gpu / off
    assert gain(0.0) == pytest.approx(1.0) and gain(1.0) > 1.2
    lo, hi = 0.0, 1.0
    for _ in range(30):
        lo, hi = ((lo + hi) / 2, hi) if gain((lo + hi) / 2) < p_on.figure / p_off.figure else (lo, (lo + hi) / 2)
    assert lo == pytest.approx(Efficiency().megatron_a2a_hidden, abs=0.01)


def test_overlap_leaves_the_unpaired_chunks_exposed():
    """Under the paired overlap the schedule's warm-up forwards and cool-down backwards run alone:
    Megatron's interleaved combined 1F1B 2 (p - r - 1) + (v - 1) p + 1 of v m chunks, DualPipe's
    3p/2 - h - 1 of m, this trainer's pp-1 overlap 1 of m; with every chunk alone nothing is hidden."""
    from moe_trainer.plan.time import unpaired_share
    pub, s = published.load_published(str(ROOT / "configs" / "qwen3_235b_a22b.yaml"))
    p, v, m = s.pp, s.virtual_stages, s.micro_batches
    assert unpaired_share(s, 0, pub.mechanisms) == pytest.approx((2 * (p - 1) + (v - 1) * p + 1) / (v * m))
    assert unpaired_share(s, p - 1, pub.mechanisms) == pytest.approx(((v - 1) * p + 1) / (v * m))
    assert unpaired_share(s, 0, dataclasses.replace(pub.mechanisms, a2a_overlap=False)) == 0.0
    ds = setup_from_config(_cfg("deepseek_v3_671b.yaml", "parallel.recompute=none"), 2048)
    dual = Mechanisms(a2a_overlap=True, schedule="dualpipe")
    assert unpaired_share(ds, 0, dual) == pytest.approx((3 * 16 / 2 - 1) / ds.micro_batches)
    assert unpaired_share(ds, 7, dual) == unpaired_share(ds, 8, dual) == pytest.approx(16 / ds.micro_batches)
    one = dataclasses.replace(ds, pp=1, virtual_stages=1, micro_batches=8)
    assert unpaired_share(one, 0, Mechanisms(a2a_overlap=True)) == pytest.approx(1 / 8)
    gpu, eff = gpu_named("h100"), Efficiency()
    few = dataclasses.replace(s, micro_batches=2)  # 2 micro-batches: every chunk is in the warm-up
    alone = step_time(few, gpu, eff, pub.mechanisms, 1.0)
    assert alone.split["all_to_all"] == pytest.approx(alone.totals["all_to_all"], rel=1e-9)
    paired = step_time(s, gpu, eff, dataclasses.replace(pub.mechanisms, a2a_hiding="phases"), 1.0)
    assert paired.split["all_to_all"] < 0.2 * paired.totals["all_to_all"]


def test_overlap_exposure_is_its_terms_and_meets_the_bench():
    """The overlap bench's setup (moe_tiny, ep 2, pp 1, 16 micro-batches of 1) on the CPU model of the
    2026-12-06 rates, with a link of 0.3 Gb/s and 200 us: blocking, the rank waits for every row transfer
    (bytes over the link, plus the latency of each of the 12 a micro-batch sends: 3 MoE blocks x
    (dispatch, combine) x (forward, backward)) and every split-size exchange (3 a micro-batch, latency
    only); overlapped, for the per-slot excesses of the 15 paired micro-batches, the whole of micro-batch
    0's forward and the last backward's transfers (1/16), and the same split-size exchanges. Then the
    predicted hidden fraction at the bench's pp 1, ratio 1 setting lies inside the spread of the committed
    measurement's rounds (docs/bench/overlap_2026-12-06.json: 0.42-0.69, median 0.56)."""
    from moe_trainer.bench.overlap import model_setup, predict_rows, predicted_hidden
    from moe_trainer.bench.plan_time import RATES_2026_12_06, cpu_from_rates
    from moe_trainer.plan.time import _paired_a2a_exposed
    from moe_trainer.plan.work import rank_bytes
    s, _ = model_setup(1, 1)
    assert (s.micro_batches, s.ep, s.pp) == (16, 2, 1)
    cpu, eff = cpu_from_rates(RATES_2026_12_06, 2)
    gbps, lat = 0.3, 200.0
    p = predicted_hidden(s, cpu, eff, gbps, lat)
    off, on, m = p["off"], p["on"], s.micro_batches
    moved = rank_bytes(s, 0).a2a_bytes * 8 / (gbps * 1e9)
    assert off["transfers"] == pytest.approx(m * (moved + 12 * lat * 1e-6), rel=1e-12)
    assert off["split"] == on["split"] == pytest.approx(m * 3 * lat * 1e-6, rel=1e-12)
    assert off["exposed"] == pytest.approx(off["transfers"] + off["split"], rel=1e-12)
    assert on["unpaired"] == pytest.approx(off["transfers"] / m, rel=1e-12)
    assert on["exposed"] == pytest.approx(on["paired"] + on["unpaired"] + on["split"], rel=1e-12)
    assert 0 < on["paired"] < (1 - 1 / m) * off["transfers"]
    # the paired term is the slots' excesses (of one MoE block's compute and its host time, as a CPU
    # rank's thread runs both): grows with the transfers, vanishes when they are short
    assert _paired_a2a_exposed(1e-9, 1.0, 0.5, Mechanisms(a2a_overlap=True)) == 0.0
    slow = predicted_hidden(s, cpu, eff, gbps / 4, lat)
    assert slow["on"]["paired"] > 4 * on["paired"]
    # the executor's order replayed: a forward and a backward transfer in flight together, the emulated
    # link holding each to its own deadline, so with no compute the rank waits for one, not both
    from moe_trainer.bench.overlap import executor_timeline
    assert executor_timeline([0.0, 0.0], [0.0, 0.0], 1.0) == 1.0
    assert executor_timeline([1.0, 1.0], [2.0, 2.0], 0.5) == 0.0  # each transfer shorter than the stage beside it
    # F0 (to 1), B1 (to 3), F1 waits for f (issued at 1, to 4), B0 for b (issued at 3, to 6 after F1 ends at 5)
    assert executor_timeline([1.0, 1.0], [2.0, 2.0], 3.0) == pytest.approx(1.0 + 1.0)
    saved = json.loads((ROOT / "docs" / "bench" / "overlap_2026-12-06.json").read_text())
    row = next(r for r in predict_rows(saved, 1, 1, RATES_2026_12_06) if r["setting"] == "a2a = 1 x compute")
    assert row["ratio"] == pytest.approx(1.0, rel=1e-3)
    assert min(row["measured"]) <= row["at_ratio"]["hidden"] <= max(row["measured"])


@pytest.mark.parametrize("name,gpus,gpu", [("deepseek_v3_671b.yaml", 2048, "h800"), ("llama3_405b.yaml", 16384, "h100")])
def test_search_is_fast_and_fits(name, gpus, gpu):
    cfg = _cfg(name)
    start = time.perf_counter()
    best, tried, fit = search(cfg, gpus, gpu_named(gpu), Efficiency(), Mechanisms(), 80.0)
    assert time.perf_counter() - start < 60
    assert len(best) == 10 and fit >= 10 and tried > fit
    assert all(c.peak_gb <= 80 for c in best)
    speeds = [c.time.tokens_per_s_per_gpu for c in best]
    assert speeds == sorted(speeds, reverse=True)


def test_search_resolves_the_overlap_per_layout():
    """The search takes parallel.overlap as a CUDA run resolves it for each layout: auto (the default,
    train.compile auto) keeps the compiled blocking path; a2a with train.compile true overlaps every
    layout the executor runs (ep > 1, tp = cp = 1, pp 1 or interleaved) and drops the rest, as the
    trainer refuses them; the winner's --set lines carry the overlap for the dry run."""
    from moe_trainer.plan.search import layout_mechanisms
    cfg = _cfg("moe_1b_16gpu.yaml")
    auto, _, _ = search(cfg, 16, gpu_named("h100"), Efficiency(), Mechanisms(), 80.0, top=300, overlap="auto")
    assert all(c.overlap == "none" and not c.mechanisms.a2a_overlap and c.mechanisms.host == "compiled" for c in auto)
    asked = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True))
    both, tried, _ = search(asked, 16, gpu_named("h100"), Efficiency(), Mechanisms(), 80.0, top=300, overlap="a2a")
    assert tried < len(auto) and both
    for c in both:
        s = c.setup
        assert c.overlap == "a2a" and c.mechanisms.a2a_overlap and c.mechanisms.wgrad_split
        assert s.ep > 1 and s.tp == s.cp == 1 and (s.pp == 1 or s.virtual_stages > 1)
        assert "parallel.overlap=a2a" in c.overrides() and c.label().endswith("a2a overlap")
    # the same layout, overlapped and compiled, is modelled faster than blocking, and holds more memory
    same = next(c for c in auto if c.label() + " a2a overlap" == both[0].label())
    assert both[0].time.tokens_per_s_per_gpu > same.time.tokens_per_s_per_gpu and both[0].peak_gb > same.peak_gb
    # --overlap (a what-if) models it at every layout; a layout the trainer cannot overlap keeps its --set
    what_if = layout_mechanisms(cfg, Mechanisms(a2a_overlap=True))
    assert what_if.a2a_overlap and what_if.host == "eager"


def test_load_imbalance_from_a_run_directory(tmp_path):
    from moe_trainer.expert_load.files import write_expert_load
    counts = torch.tensor([[4.0, 4, 4, 4], [8, 0, 4, 4]])  # layer 1: rank 0 (experts 0, 1) holds 8 of 16
    write_expert_load(tmp_path, 10, counts)
    assert natural_imbalance(read_load(str(tmp_path)), 2) == pytest.approx((1.0 + 1.0) / 2)
    assert natural_imbalance(read_load(str(tmp_path)), 4) == pytest.approx((1.0 + 2.0) / 2)


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_cli_time_search_and_bad_input(tmp_path):
    out = _cli("--config", "configs/qwen3_235b_a22b.yaml", "--gpus", "256", "--time", "--json", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    assert "tokens/s per GPU" in out.stdout
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["balanced"]["step"] > 0 and data["layout"]["ep"] == 32
    bad = _cli("--config", "configs/moe_tiny.yaml", "--gpus", "2", "--time", "--gpu", "tpu")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--gpu must be one of" in bad.stderr
    # DeepSeek-V3's 15,360 sequences a step leave no layout on 2,048 GPUs that the overlap runs
    bad = _cli("--config", "configs/deepseek_v3_671b.yaml", "--gpus", "2048", "--search", "--set", "parallel.overlap=a2a")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "can run parallel.overlap=a2a" in bad.stderr
    plan = tmp_path / "plan.json"
    out = _cli("--config", "configs/deepseek_v3_671b.yaml", "--gpus", "2048", "--search", "--gpu", "h800",
               "--json", str(plan))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n| ") >= 11 and "The config's own layout" in out.stdout
    best = json.loads(plan.read_text())
    assert best["gpus"] == 2048 and any(s.startswith("parallel.ep=") for s in best["set"])
    dry = subprocess.run([sys.executable, str(ROOT / "tools" / "dry_run.py"), "--config",
                          "configs/deepseek_v3_671b.yaml", "--world", "1024", "--gpus-per-node", "8", "--from-plan",
                          str(plan)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert dry.returncode == 2 and "give --world 2048" in dry.stderr and dry.stderr.count("\n") == 1


def test_node_dedup_sends_a_token_once_per_node():
    """DeepSeek-V3's dispatch: with 4 of 8 node groups per token, at most 4 nodes, fewer network bytes
    than one copy per remote rank."""
    from moe_trainer.plan.work import node_dedup_bytes
    s = setup_from_config(_cfg("deepseek_v3_671b.yaml"), 2048)
    per_token = node_dedup_bytes(s, 2) / s.tokens / (2 * s.ffn.hidden_size * 2)
    assert 3.0 < per_token <= 4.0  # expected other nodes among the 4 a token's groups sit on


def test_cpu_prediction_sees_this_machine():
    """bench.plan_time's prediction: one rank sends nothing, two ranks all-reduce their gradients, and
    the matmul rate and copy bandwidth are this machine's (measured, positive)."""
    from moe_trainer.bench.plan_time import predict
    one, two = predict(1, 1), predict(2, 1)
    assert one["matmul_tflops"] > 0 and one["copy_gbs"] > 0
    assert one["exposed_comm_s"] == 0 and two["exposed_comm_s"] > 0
    # the host's time per kernel and the rates at the config's shapes are measured here too
    for r in (one, two):
        assert r["host_us_per_kernel"] > 0 and r["host_s"] > 0
        assert all(0 < v < 2 for v in r["efficiency"].values()), r["efficiency"]


def test_inline_host_adds_every_launch_to_the_step():
    """host "inline" (a CPU rank runs what it dispatches): the step grows by exactly the micro-batches'
    launches, m x kernels x host time per kernel, where "eager" hides them behind the device's time."""
    from moe_trainer.plan.work import block_kernels
    cfg = _cfg("moe_tiny.yaml", "train.dtype=fp32")  # fp32: no accumulation hooks on top
    s = setup_from_config(cfg, 1, gpus_per_node=1)
    gpu = gpu_named("h100")
    quiet, slow = Efficiency(host_eager_us=0.0), Efficiency(host_eager_us=30.0)
    base = step_time(s, gpu, quiet, Mechanisms(host="inline"), 1.0).step
    inline = step_time(s, gpu, slow, Mechanisms(host="inline"), 1.0).step
    kernels = sum(block_kernels(s, layer, False) for layer in range(cfg.model.num_hidden_layers))
    assert inline - base == pytest.approx(s.micro_batches * kernels * 30e-6, rel=1e-9)
    assert step_time(s, gpu, slow, Mechanisms(host="eager"), 1.0).step < inline

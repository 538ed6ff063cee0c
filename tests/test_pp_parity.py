"""Pipeline parallelism (our 1F1B executor around the DeepSpeed ZeRO-1 engine)
against one rank: the same losses and gradient norms before clipping for 5 steps,
and the same final weights. Every multi-rank job runs under NCCL's point-to-point rule
(tests/nccl_p2p_rule.py): on gloo's batch_isend_irecv where a case sets parallel.cpu_p2p=gloo,
else on the shared-memory rings, which keep the rule themselves under it."""
import pytest

from conftest import TINY, assert_same_final_weights, assert_same_steps, check, launch, read_metrics

STEPS = ["train.max_steps=5", "train.checkpoint_every=5", "train.global_batch_size=8",
         "train.micro_batch_size=2"]
FOUR_LAYERS = ["model.num_hidden_layers=4", "model.first_k_dense_replace=2"]
MTP = ["model.num_nextn_predict_layers=1", "model.seq_aux_loss_alpha=0.001"]

CASES = {
    "pp2": (2, ["parallel.pp=2"], []),
    "pp2_mtp": (2, ["parallel.pp=2"], MTP),
    # regional torch.compile (aot_eager: inductor's graphs without its C++ build) with the pipeline
    # executor, full recomputation inside the compiled layers, MTP and ZeRO-1, against eager on one rank
    "pp2_mtp_compiled_recompute": (2, ["parallel.pp=2", "train.compile=true", "train.compile_backend=aot_eager",
                                       "parallel.recompute=full"], MTP),
    "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"], []),
    # stages 0 and 1 hold only dense layers (no MoE state there); the stages' transfers through
    # torch.distributed's batch_isend_irecv (the GPU's path; the other cases use the shared-memory rings)
    "pp4_dense_stages": (4, ["parallel.pp=4", "parallel.pp_partition=[1, 1, 1, 1]", "parallel.cpu_p2p=gloo"],
                         FOUR_LAYERS),
    # stage 0 holds only dense layers (first_k_dense_replace=2): it has no expert group of its own, yet
    # reduces the expert norm over the stages as stage 1 does (a hang before: zero.same_norm_collectives)
    "pp2_ep2_dense_stage": (4, ["parallel.pp=2", "parallel.ep=2", "parallel.pp_partition=[2, 2]",
                                "parallel.timeout_s=120"], FOUR_LAYERS),
    # DeepSeek-V3's 3D layout in small: pipeline x data parallel with EP inside each stage's dp ranks
    "pp2_dp4_ep2": (8, ["parallel.pp=2", "parallel.ep=2"], []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_matches_one_rank(tmp_path, case):
    world, layout, model = CASES[case]
    ref = tmp_path / "one"
    check(launch(1, ref, TINY + STEPS + model, launcher="python"))
    out = tmp_path / case
    proc = check(launch(world, out, TINY + STEPS + model + layout))
    assert ("torch.compile (aot_eager)" in proc.stdout) == ("train.compile=true" in layout), proc.stdout[-2000:]
    assert_same_steps(ref, out)
    assert_same_final_weights(ref, out)
    if "pp4" in case:  # every rank wrote its own part of the checkpoint
        assert len(list((out / "checkpoints" / "step_5").glob("part-r*.safetensors"))) == 4


# interleaved 1F1B (parallel.virtual_stages): one micro-batch per sequence, so the micro-batches per step
# (4 or 8) are a multiple of pp with a steady state; loss AND gradient norm per step against one rank
ONE_PER_MICRO = ["train.max_steps=5", "train.checkpoint_every=5", "train.global_batch_size=8",
                 "train.micro_batch_size=1", "train.eval_every=5"]
DENSE = ["model.hidden_size=64", "model.num_hidden_layers=4", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.intermediate_size=128", "train.seq_len=32", "train.warmup_steps=2",
         "train.log_every=1", "train.resume=none", "metrics.peak_tflops=1.0"]
DENSE_RANK = ["model.num_hidden_layers=4", "model.first_k_dense_replace=3"]
DENSE_RANK_LAYOUT = ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.ep=2",
                     "parallel.pp_partition=[1, 1, 1, 1]", "parallel.timeout_s=120"]
INTERLEAVED = {
    # 4 chunks of 1 layer over 2 ranks (rank 0: layers 0 and 2), EP inside each stage, MTP on the last chunk
    "pp2_v2_ep2_mtp": (4, "configs/moe_tiny.yaml", TINY + FOUR_LAYERS + MTP,
                       ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.ep=2"]),
    # through batch_isend_irecv, as on GPUs (the others: the shared-memory rings, under the same rule)
    "pp4_v2": (4, "configs/moe_tiny.yaml", TINY + ["model.num_hidden_layers=8"],
               ["parallel.pp=4", "parallel.virtual_stages=2", "parallel.cpu_p2p=gloo"]),
    "llama3_tp2_pp2_v2": (4, "configs/llama3_tiny.yaml", DENSE,
                          ["parallel.tp=2", "parallel.pp=2", "parallel.virtual_stages=2"]),
    # rank 0's chunks (layers 0 and 2) are both dense, rank 1's hold layer 3's experts
    "pp2_v2_ep2_dense_rank": (4, "configs/moe_tiny.yaml", TINY + DENSE_RANK, DENSE_RANK_LAYOUT),
}


@pytest.mark.parametrize("case", sorted(INTERLEAVED))
def test_interleaved_pipeline_matches_one_rank(tmp_path, case):
    world, config, model, layout = INTERLEAVED[case]
    ref, out = tmp_path / "one", tmp_path / case
    check(launch(1, ref, model + ONE_PER_MICRO, config=config, launcher="python"))
    check(launch(world, out, model + ONE_PER_MICRO + layout, config=config))
    one, many = read_metrics(ref), read_metrics(out)
    steps = {r["step"]: r for r in one if "loss" in r}
    got = {r["step"]: r for r in many if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4, 5]
    for s, r in steps.items():
        for key in ("loss", "grad_norm"):
            assert abs(r[key] - got[s][key]) / abs(r[key]) < 1e-4, (s, key, r[key], got[s][key])
    val_one, val_many = ({r["step"]: r["val_loss"] for r in rs if "val_loss" in r} for rs in (one, many))
    assert list(val_one) == list(val_many) == [5]  # evaluation: the forward-only order
    assert abs(val_one[5] - val_many[5]) / val_one[5] < 1e-4, (val_one, val_many)
    assert_same_final_weights(ref, out)


# bf16 (BF16_Optimizer: fp32 accumulation) with a pipeline rank that holds no MoE layer: the optimizer reduces
# the expert gradient norm over the pipeline group only where the engine found experts, so before
# zero.same_norm_collectives these layouts never finished step 1 (the step's loss all-reduce met the other
# stage's norm all-reduce); every step's loss and norm against one bf16 rank
DENSE_STAGE_BF16 = {
    "pp2_ep2": (TINY + FOUR_LAYERS, ["parallel.pp=2", "parallel.ep=2", "parallel.pp_partition=[2, 2]",
                                     "parallel.timeout_s=120"]),
    "pp2_v2_ep2": (TINY + DENSE_RANK, DENSE_RANK_LAYOUT),
}


@pytest.mark.parametrize("case", sorted(DENSE_STAGE_BF16))
def test_dense_stage_in_bf16_matches_one_rank(tmp_path, case):
    model, layout = DENSE_STAGE_BF16[case]
    bf16 = model + ONE_PER_MICRO + ["train.dtype=bf16"]
    ref, out = tmp_path / "one", tmp_path / case
    check(launch(1, ref, bf16, launcher="python"))
    check(launch(4, out, bf16 + layout))
    # bf16 layouts group the same sums differently: from the same weights the first step's norm agrees to
    # 1e-3 (an expert norm left out, or a loss added to it, moves it far more), later steps to bf16's drift
    assert_same_steps(ref, out, rel=2e-2)
    one, many = read_metrics(ref), read_metrics(out)
    norms = [{r["step"]: r["grad_norm"] for r in rs if "loss" in r} for rs in (one, many)]
    assert abs(norms[0][1] - norms[1][1]) <= 1e-3 * norms[0][1], norms
    losses = [{r["step"]: r["loss"] for r in rs if "loss" in r} for rs in (one, many)]
    assert all(abs(losses[0][s] - losses[1][s]) <= 1e-3 * losses[0][s] for s in losses[0]), losses

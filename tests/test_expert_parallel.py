"""The all-to-all dispatcher on real gloo ranks against the single-rank MoE layer:
outputs and gradients (over gloo's all-to-all and over the shared-memory one), skewed
routing that sends everything to one rank, and the mesh's group layout."""
import os

import pytest
import torch
import torch.distributed as dist

from moe_trainer.config import DENSE_ORDER, MOE_ORDER, Layout
from moe_trainer.moe.layer import MoE
from moe_trainer.parallel.comm import CommCounter, use_shm_transport
from moe_trainer.parallel.expert import AllToAllDispatcher, shard_experts
from moe_trainer.parallel.order import group_ranks
from moe_trainer.kernels.cpu.shm_alltoall import ShmAllToAll

from conftest import spawn_ranks

E, K, D, H = 8, 2, 16, 8


def make_layer(seed=0):
    torch.manual_seed(seed)
    layer = MoE(D, E, K, H, n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=1.5)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _worker(rank, world, port, force_rank0, transport, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if transport == "shm":
        use_shm_transport(dist.group.WORLD, ShmAllToAll.create(dist.group.WORLD))
    ref = make_layer()
    layer = make_layer()
    if force_rank0:  # the bias makes every token pick experts 0..3, all on EP rank 0
        for m in (ref, layer):
            m.gate.e_score_correction_bias[: E // world] = 100.0
    shard_experts(layer, rank, world)
    counter = CommCounter()
    layer.dispatcher = AllToAllDispatcher(E, world, dist.group.WORLD, counter=counter)
    torch.manual_seed(100 + rank)
    x = torch.randn(2, 5, D)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    out, _ = layer(x)
    out.pow(2).sum().backward()
    ref_out, _ = ref(x_ref)
    ref_out.pow(2).sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    own = [getattr(layer.experts, n_).grad for n_ in ("gate_up_proj", "down_proj")]
    results[rank] = {"grads_finite": all(torch.isfinite(g).all().item() for g in own),
                     "zero_grads": all(g.abs().sum().item() == 0 for g in own),
                     "sent": sum(counter.sent.values())}
    dist.destroy_process_group()


def _expert_grad_worker(rank, world, port, dtype, results):
    """Expert grads on the owner rank equal the single-process grads of the
    concatenated inputs of all ranks. bf16 (the CPU path whose expert GEMMs run on
    padded rows) is held against the fp32 computation on the same bf16 values."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    xs = [torch.randn(2, 5, D, generator=torch.Generator().manual_seed(7 + r)).to(dtype).float()
          for r in range(world)]
    ref = make_layer().to(dtype).float()
    ref_out, _ = ref(torch.cat(xs))
    ref_out.pow(2).sum().backward()
    layer = make_layer().to(dtype)
    shard_experts(layer, rank, world)
    layer.dispatcher = AllToAllDispatcher(E, world, dist.group.WORLD)
    out, _ = layer(xs[rank].to(dtype))
    out.float().pow(2).sum().backward()
    lo, n = rank * (E // world), E // world
    ok = True
    for name in ("gate_up_proj", "down_proj"):
        got, want = getattr(layer.experts, name).grad.float(), getattr(ref.experts, name).grad[lo:lo + n]
        if dtype == torch.float32:
            ok &= torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        else:
            ok &= bool((got - want).norm() <= 2e-2 * want.norm()) and bool(want.norm() > 0)
    results[rank] = ok
    dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_layer_equals_single_rank(world, transport):
    res = spawn_ranks(_worker, world, False, transport)
    assert all(r["grads_finite"] for r in res.values())
    assert all(r["sent"] > 0 for r in res.values())


@pytest.mark.parametrize("world, dtype", [(2, torch.float32), (4, torch.float32), (2, torch.bfloat16)],
                         ids=["w2-fp32", "w4-fp32", "w2-bf16"])
def test_expert_gradients_equal_single_process(world, dtype):
    res = spawn_ranks(_expert_grad_worker, world, dtype)
    assert all(res.values()), res


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_every_token_to_one_rank_no_hang_and_zero_grads_elsewhere(transport):
    res = spawn_ranks(_worker, 2, True, transport)
    assert not res[0]["zero_grads"]  # rank 0 owns every chosen expert
    assert res[1]["zero_grads"]  # rank 1's experts got no tokens: zero (not missing) gradients


def test_mesh_groups_match_deepspeed_order():
    """EP groups are neighbouring data-parallel ranks, expert-DP groups strided by ep."""
    g = group_ranks(Layout(world=8, pp=1, tp=1, cp=1, dp=8, ep=2, edp=4, grad_accum=1))
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["edp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # the MoE order: pipeline outermost, so each stage's EP groups are neighbouring ranks
    g = group_ranks(Layout(world=8, pp=2, tp=1, cp=1, dp=4, ep=2, edp=2, grad_accum=1, order=MOE_ORDER))
    assert g["pp"][0] == [0, 4] and g["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # Llama 3's order: pipeline inside data parallel
    g = group_ranks(Layout(world=8, pp=2, tp=1, cp=1, dp=4, ep=2, edp=2, grad_accum=1, order=DENSE_ORDER))
    assert g["pp"][0] == [0, 1] and g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7]] and g["edp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    for order in (MOE_ORDER, DENSE_ORDER):
        g = group_ranks(Layout(world=8, pp=1, tp=2, cp=2, dp=2, ep=1, edp=4, grad_accum=1, order=order))
        assert g["tp"][0] == [0, 1] and g["cp"][0] == [0, 2] and g["dp"][0] == [0, 4]

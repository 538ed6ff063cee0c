"""Tensor (and sequence) parallel Llama 3 on gloo ranks against the single-rank
model: logits, loss, every gradient, a second forward after an SGD step, the
vocabulary-parallel cross-entropy, and the bytes the collectives move."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_trainer.config import Layout, ModelConfig
from moe_trainer.models.llama3 import Llama3
from moe_trainer.parallel.comm import CommCounter
from moe_trainer.parallel.mesh import build_mesh
from moe_trainer.parallel.tensor import (VocabParallelCrossEntropy, apply_tensor_parallel, check_tensor_parallel,
                                         gather_logits, shard_param)

from conftest import free_port, start_ranks

B, T, L, D = 2, 8, 2, 32


def tiny_cfg(kv_heads: int) -> ModelConfig:
    return ModelConfig(arch="llama3", vocab_size=64, hidden_size=D, num_hidden_layers=L, num_attention_heads=4,
                       num_key_value_heads=kv_heads, intermediate_size=64, initializer_range=0.2)


def reference(cfg: ModelConfig):
    """The single-rank model, its output on a fixed batch (backward done), and the batch."""
    torch.manual_seed(0)
    model = Llama3(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    parallel = copy.deepcopy(model)
    out = model(ids, labels)
    out.loss.backward()
    return model, parallel, out, ids, labels


def start(rank: int, world: int, port: int, **degrees):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    dims = dict(pp=1, tp=1, cp=1, ep=1, grad_accum=1) | degrees
    dp = world // (dims["tp"] * dims["cp"])
    return build_mesh(Layout(world=world, dp=dp, edp=dp * dims["cp"], **dims), rank)


def spawn(fn, world: int, *args):
    start_ranks(fn, world, world, free_port(), *args)


def assert_grads_match(model, ref, cfg, mesh, reduce_cp: bool = False):
    """Each parameter's grad equals the same slice of the single-rank grad; with
    cp the ranks' grads are averaged over cp first (as the dp x cp reduction does)."""
    tp, index = mesh.size("tp"), mesh.index("tp")
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad
        if reduce_cp:
            grad = grad.clone()
            dist.all_reduce(grad, group=mesh.group("cp"))
            grad /= mesh.size("cp")
        expected = shard_param(name, ref_grads[name].grad, cfg, tp, index)[0]
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=name)


def _tp_worker(rank, world, port, kv_heads, sequence_parallel):
    mesh = start(rank, world, port, tp=world)
    cfg = tiny_cfg(kv_heads)
    ref, model, ref_out, ids, labels = reference(cfg)
    counter = CommCounter()
    apply_tensor_parallel(model, mesh, sequence_parallel, counter)
    out = model(ids, labels)
    fwd = counter.reset()["sent"]
    out.loss.backward()
    bwd = counter.reset()["sent"]

    assert out.logits.shape == (B, T, cfg.vocab_size // world)  # never the full vocabulary
    assert (gather_logits(out.logits, mesh) - ref_out.logits).abs().max() < 1e-5
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-6, atol=1e-6)
    assert_grads_match(model, ref, cfg, mesh)

    # bytes of one forward: 2L regions + lm_head enter, 2L regions + embedding leave;
    # all-reduce = reduce-scatter + all-gather, so both modes move the same bytes
    g, act = world, B * T * D * 4
    if sequence_parallel:
        assert fwd["tp_all_gather"] == (2 * L + 1) * (g - 1) * act // g
        assert fwd["tp_reduce_scatter"] == (2 * L + 1) * (g - 1) * act // g
        assert bwd["tp_reduce_scatter_grad"] == fwd["tp_all_gather"]
        assert bwd["tp_all_gather_grad"] == fwd["tp_reduce_scatter"]
    else:
        assert fwd["tp_all_reduce"] == (2 * L + 1) * 2 * (g - 1) * act // g
        assert bwd["tp_all_reduce_grad"] == (2 * L + 1) * 2 * (g - 1) * act // g

    # one SGD step on both, then the forward still agrees
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        for p in ref.parameters():
            p -= 0.1 * p.grad
        diff = (gather_logits(model(ids).logits, mesh) - ref(ids).logits).abs().max()
        assert diff < 1e-5, diff
    dist.destroy_process_group()


@pytest.mark.parametrize("kv_heads,sequence_parallel", [(2, False), (2, True), (1, False), (1, True)],
                         ids=["kv-split", "kv-split-sp", "kv-replicated", "kv-replicated-sp"])
def test_tensor_parallel_equals_single_rank(kv_heads, sequence_parallel):
    spawn(_tp_worker, 2, kv_heads, sequence_parallel)


def _cross_entropy_worker(rank, world, port):
    mesh = start(rank, world, port, tp=world)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, 64, generator=g) * 5
    labels = torch.randint(0, 64, (B, T), generator=g)
    labels[0, :3] = -100  # ignored, as F.cross_entropy does
    v = 64 // world
    local = logits[..., rank * v:(rank + 1) * v].clone().requires_grad_()
    full = logits.clone().requires_grad_()
    loss = VocabParallelCrossEntropy(rank * v, mesh.group("tp"))(local, labels)
    ref = F.cross_entropy(full.reshape(-1, 64), labels.reshape(-1))
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(local.grad, full.grad[..., rank * v:(rank + 1) * v])
    dist.destroy_process_group()


def test_vocab_parallel_cross_entropy_equals_f_cross_entropy():
    spawn(_cross_entropy_worker, 2)


@pytest.mark.parametrize("change,tp", [(dict(num_attention_heads=6, num_key_value_heads=6), 4),
                                       (dict(num_key_value_heads=3, num_attention_heads=6), 2),
                                       (dict(vocab_size=66), 4), (dict(intermediate_size=66), 4)])
def test_degrees_that_do_not_fit_raise(change, tp):
    cfg = tiny_cfg(2)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError):
        check_tensor_parallel(cfg, tp)

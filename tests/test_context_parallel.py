"""Context parallelism (Llama 3's all-gather of K and V, load-balanced chunks)
alone and with tensor + sequence parallelism, against the single-rank model; its
attention without a mask (chunk pairs merged on their log-sum-exps) against the
masked path and single-rank causal attention, for GQA and MLA head shapes, on
every kernel back end; and the proof that it makes no (T/cp, T) mask or scores."""
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moe_trainer import kernels
from moe_trainer.kernels import chunked_attention as ca
from moe_trainer.kernels.reference import ReferenceBackend
from moe_trainer.parallel.comm import CommCounter
from moe_trainer.parallel.context import (ContextParallelAttention, MaskedContextParallelAttention,
                                          apply_context_parallel, cp_causal_mask, cp_gather_order, cp_mean_loss,
                                          cp_shard_indices, shard_sequence)
from moe_trainer.parallel.tensor import apply_tensor_parallel, gather_logits

from test_tensor_parallel import B, L, T, assert_grads_match, reference, spawn, start, tiny_cfg

# (heads, K/V heads, query/key head size, value head size): Llama 3's GQA; MLA (DeepSeek-V3), whose
# value head is narrower than its query/key head and not a multiple of 8 here
SHAPES = {"gqa": (4, 2, 16, 16), "mla": (4, 4, 24, 12)}


def test_shard_indices_pair_early_and_late_chunks():
    assert cp_shard_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_shard_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([cp_shard_indices(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    x = torch.arange(16).view(2, 8)
    assert shard_sequence(x, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    # every rank gets the same causal work: the same number of allowed (query, key) pairs
    assert cp_causal_mask(8, 2, 0).sum() == cp_causal_mask(8, 2, 1).sum()
    with pytest.raises(ValueError):
        cp_shard_indices(10, 2, 0)


def test_gather_order_and_chunk_pairs():
    gathered = torch.cat([cp_shard_indices(12, 3, r) for r in range(3)])  # what the all-gather holds
    assert gathered.index_select(0, cp_gather_order(12, 3)).tolist() == list(range(12))
    # chunk 0 attends only its own chunk causally; chunk 3 its own causally and chunks 0-2 fully
    assert ca.chunk_pairs((0, 3), 4) == [[(0, 4, True)], [(12, 16, True), (0, 12, False)]]


def test_merge_partials_is_the_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    s, v = torch.randn(2, 3, 10, generator=g) * 4, torch.randn(2, 3, 10, 5, generator=g)  # scores, values
    parts = [(torch.einsum("bqk,bqkd->bqd", s[..., i].softmax(-1), v[..., i, :]), s[..., i].logsumexp(-1))
             for i in (slice(0, 3), slice(3, 10))]
    out, lse = ca.merge_partials([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, torch.einsum("bqk,bqkd->bqd", s.softmax(-1), v))
    torch.testing.assert_close(lse, s.logsumexp(-1))


def one_process(cls):
    """`cls` for one cp rank with every rank in this process: called with the whole sequence's K
    and V, its gather returns what the all-gather would (every rank's shard, in cp-rank order)."""
    class OneProcess(cls):
        def gather(self, x):
            return torch.cat([shard_sequence(x, self.cp, r, dim=2) for r in range(self.cp)], dim=2)
    return OneProcess


def qkv(shape: str, seq_len: int, dtype=torch.float32, batch: int = 2, device="cpu"):
    h, hkv, dqk, dv = SHAPES[shape]
    g = torch.Generator().manual_seed(5)
    sizes = ((batch, h, seq_len, dqk), (batch, hkv, seq_len, dqk), (batch, hkv, seq_len, dv))
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in sizes]


def cp_outputs_and_grads(cls, backend: str, cp: int, q, k, v, dout, scale: float):
    """Every cp rank's attention of its query shard, stitched back into sequence order, and the
    gradients of sum(out * dout) w.r.t. the whole q, k, v (summed over ranks, as the reduce-scatter
    of the gathered K/V's gradient and the shards' own gradients do)."""
    with kernels.using(backend):
        ranks = [one_process(cls)(None, cp, r) for r in range(cp)]
    out = torch.empty(dout.shape, dtype=q.dtype, device=q.device)
    total = 0
    for r, attention in enumerate(ranks):
        o = attention(shard_sequence(q, cp, r, dim=2), k, v, scale)
        out[:, :, cp_shard_indices(q.shape[2], cp, r, q.device)] = o.detach()
        total = total + (o.float() * shard_sequence(dout, cp, r, dim=2)).sum()
    grads = torch.autograd.grad(total, (q, k, v))
    return out, grads


def single_rank(q, k, v, dout, scale: float):
    out = ReferenceBackend.causal_attention(q, k, v, scale)
    return out.detach(), torch.autograd.grad((out.float() * dout).sum(), (q, k, v))


@pytest.mark.parametrize("backend", ["accelerator", "cpu", "reference"])
@pytest.mark.parametrize("shape", ["gqa", "mla"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_chunked_attention_equals_masked_path_and_single_rank(backend, shape, cp):
    t, scale = 24, 0.3
    q, k, v = qkv(shape, t)
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(6))
    truth, truth_grads = single_rank(q, k, v, dout, scale)
    new, new_grads = cp_outputs_and_grads(ContextParallelAttention, backend, cp, q, k, v, dout, scale)
    old, old_grads = cp_outputs_and_grads(MaskedContextParallelAttention, backend, cp, q, k, v, dout, scale)
    for name, a, b, c in zip(["out", "dq", "dk", "dv"], [new, *new_grads], [old, *old_grads], [truth, *truth_grads]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=f"{name}: new against masked")
        torch.testing.assert_close(a, c, rtol=1e-5, atol=2e-6, msg=f"{name}: new against single rank")


@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_chunked_attention_in_bf16_is_as_close_to_fp32_as_the_masked_path(shape):
    t, scale, cp = 32, 0.3, 2
    q, k, v = qkv(shape, t)
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(6))
    out, grads = single_rank(q, k, v, dout, scale)
    truth = [out, *grads]
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    errors = {}
    for cls in (ContextParallelAttention, MaskedContextParallelAttention):
        out, grads = cp_outputs_and_grads(cls, "accelerator", cp, *low, dout.bfloat16(), scale)
        errors[cls] = [((a.float() - b).norm() / b.norm()).item() for a, b in zip([out, *grads], truth)]
    # the partial outputs are rounded to bf16 before the merge: a little more error, not much (~1.2x here)
    for new, masked in zip(errors[ContextParallelAttention], errors[MaskedContextParallelAttention]):
        assert new < 1e-2 and new < 1.5 * masked, errors


class TensorSizes(TorchDispatchMode):
    """Every op's name and the shapes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.ops, self.shapes = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        outputs = result if isinstance(result, (tuple, list)) else [result]
        self.shapes += [tuple(x.shape) for x in outputs if isinstance(x, torch.Tensor)]
        return result


@pytest.mark.parametrize("backend", ["accelerator", "cpu"])
def test_chunked_attention_makes_no_mask_scores_or_repeated_kv(backend):
    """Forward and backward of one rank at cp 2 make no tensor as large as one chunk pair's scores
    (B, H, c, c), so neither the (T/cp, T) mask nor the scores, and no tensor with all the query
    heads over more than the local queries: GQA's K/V are never repeated. The masked path makes
    its (T/cp, T) mask, which the first check would catch."""
    cp, t, scale = 2, 256, 0.3
    q, k, v = qkv("gqa", t, batch=1)
    h, c = q.shape[1], t // (2 * cp)
    found = {}
    for name, cls in (("new", ContextParallelAttention), ("masked", MaskedContextParallelAttention)):
        with kernels.using(backend):
            attention = one_process(cls)(None, cp, 1)
        q1 = shard_sequence(q, cp, 1, dim=2).detach().requires_grad_()
        with TensorSizes() as sizes:
            attention(q1, k, v, scale).sum().backward()
        found[name] = sizes
    scores = q.shape[0] * h * c * c
    assert max(torch.Size(s).numel() for s in found["new"].shapes) < scores
    assert not [s for s in found["new"].shapes if len(s) == 4 and s[1] == h and s[2] > t // cp]
    assert "_scaled_dot_product_flash_attention_for_cpu" in found["new"].ops
    assert (t // cp, t) in found["masked"].shapes  # its mask (on a CPU the scores stay inside SDPA's kernel)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, ca.FlashCUDA), (torch.float32, ca.EfficientCUDA)])
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_cuda_kernel_calls_on_the_meta_device(dtype, kernel, shape):
    """The CUDA kernels' calls (arguments, log-sum-exp and padding handling) through torch's meta
    implementations of them: every shape that comes back, forward and backward, as on a GPU."""
    assert ca.block_kernels("cuda", dtype, 24) is kernel
    assert ca.block_kernels("cuda", torch.bfloat16, 320) is ca.EfficientCUDA  # wider than flash takes
    h, hkv, dqk, dv = SHAPES[shape]
    q, k, v = qkv(shape, 40, dtype, device="meta")
    out = ca.chunked_causal_attention(q[:, :, :20], k, v, 0.3, (1, 2))  # chunks of 10 at global chunks 1, 2
    assert out.shape == (2, h, 20, dv) and out.dtype == dtype and out.device.type == "meta"
    dq, dk, dv_ = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_chunked_attention_on_cuda_equals_single_rank_without_host_sync(dtype, tol, shape):
    cp, t, scale = 2, 512, 0.3
    q, k, v = qkv(shape, t)
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(6))
    out, grads = single_rank(q, k, v, dout, scale)
    low = [x.detach().cuda().to(dtype).requires_grad_() for x in (q, k, v)]
    dout = dout.cuda().to(dtype)
    got, got_grads = cp_outputs_and_grads(ContextParallelAttention, "accelerator", cp, *low, dout, scale)
    for a, b in zip([got, *got_grads], [out, *grads]):
        assert ((a.float().cpu() - b).norm() / b.norm()) < tol
    # one rank's forward and backward again, with any host sync an error
    with kernels.using("accelerator"):
        attention = one_process(ContextParallelAttention)(None, cp, 1)
    q1, d1 = shard_sequence(low[0], cp, 1, dim=2), shard_sequence(dout, cp, 1, dim=2)
    attention(q1, low[1], low[2], scale)  # warm-up: the order index is built on first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(attention(q1, low[1], low[2], scale), low, d1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _cp_worker(rank, world, port, tp, kv_heads, backend):
    mesh = start(rank, world, port, tp=tp, cp=world // tp)
    cp, cp_rank = mesh.size("cp"), mesh.index("cp")
    cfg = tiny_cfg(kv_heads)
    with kernels.using(backend):
        ref, model, ref_out, ids, labels = reference(cfg)
        counter = CommCounter()
        apply_tensor_parallel(model, mesh, sequence_parallel=True)
        apply_context_parallel(model, mesh, counter)
    assert isinstance(model.layers["0"].self_attn.attention, ContextParallelAttention)
    positions = shard_sequence(torch.arange(T), cp, cp_rank, dim=0)
    out = model(shard_sequence(ids, cp, cp_rank), shard_sequence(labels, cp, cp_rank), positions=positions)
    sent = counter.reset()["sent"]
    out.loss.backward()

    logits = gather_logits(out.logits, mesh)
    assert (logits - shard_sequence(ref_out.logits, cp, cp_rank)).abs().max() < 1e-5
    torch.testing.assert_close(cp_mean_loss(out.loss, mesh), ref_out.loss, rtol=1e-6, atol=1e-6)
    assert_grads_match(model, ref, cfg, mesh, reduce_cp=True)
    # K and V, each (B, Hkv/tp, T/cp, head_dim), all-gathered over cp in every layer
    kv_local = max(kv_heads // tp, 1)
    assert sent["cp_all_gather"] == L * 2 * (cp - 1) * B * kv_local * (T // cp) * (32 // 4) * 4
    if tp == 1:
        _check_attention_against_masked(mesh, backend)
    dist.destroy_process_group()


def _check_attention_against_masked(mesh, backend):
    """Over the real all-gather (and its reduce-scatter backward): the attention without a mask
    equals the masked one, outputs and gradients, for GQA and MLA head shapes."""
    cp, r = mesh.size("cp"), mesh.index("cp")
    for shape in SHAPES:
        q, k, v = (shard_sequence(x, cp, r, dim=2).detach().requires_grad_() for x in qkv(shape, 32))
        dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(7 + r))
        results = []
        for cls in (ContextParallelAttention, MaskedContextParallelAttention):
            with kernels.using(backend):
                attention = cls(mesh.group("cp"), cp, r)
            out = attention(q, k, v, 0.3)
            results.append([out, *torch.autograd.grad(out, (q, k, v), dout)])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=shape)


@pytest.mark.parametrize("world,tp,kv_heads,backend", [(2, 1, 2, "cpu"), (2, 1, 2, "accelerator"), (4, 2, 1, "cpu")],
                         ids=["cp2", "cp2-accelerator", "tp2-sp-cp2-kv-replicated"])
def test_context_parallel_equals_single_rank(world, tp, kv_heads, backend):
    spawn(_cp_worker, world, tp, kv_heads, backend)

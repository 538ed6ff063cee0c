"""Unit tests of the model pieces: experts, router, balancing, dispatch, MTP, RoPE.

Each fast path is compared with its simple reference (grouped vs loop experts,
group-limited routing vs a brute-force recomputation), on tiny CPU shapes.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_trainer.config import ModelConfig
from moe_trainer.kernels.cpu.layers import ExplicitCausalAttention
from moe_trainer.models.layers import causal_attention
from moe_trainer.rope import rope_inv_freq, yarn_softmax_scale
from moe_trainer.models.registry import build_model, moe_layers
from moe_trainer.kernels.cpu import experts as experts_mod
from moe_trainer.moe.balance import update_bias
from moe_trainer.moe.dispatcher import LocalDispatcher
from moe_trainer.moe.experts import Experts
from moe_trainer.moe.layer import MoE
from moe_trainer.moe.router import Router


def tiny(**over) -> ModelConfig:
    base = dict(arch="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                intermediate_size=64, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=8, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                moe_intermediate_size=16, n_group=4, topk_group=2, max_position_embeddings=64)
    base.update(over)
    return ModelConfig(**base)


def batch(vocab=64, b=2, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


@pytest.fixture
def count_grouped_mm(monkeypatch):
    """Counts calls of torch._grouped_mm, to show which experts path ran."""
    calls = []
    real = torch._grouped_mm if hasattr(torch, "_grouped_mm") else None

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    if real is not None:
        monkeypatch.setattr(torch, "_grouped_mm", spy)
    return calls


# ----------------------------------------------------------------------------- experts: grouped vs loop

def _experts_run(impl, w1, w2, x, gate, counts, dtype):
    m = Experts(w1.shape[0], x.shape[1], w2.shape[2], impl=impl)
    with torch.no_grad():
        m.gate_up_proj.copy_(w1)
        m.down_proj.copy_(w2)
    m.to(dtype)
    xi = x.clone().to(dtype).requires_grad_()
    gi = gate.clone().requires_grad_()
    y = m(xi, counts, gi)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.float(), xi.grad.float(), gi.grad.float(), m.gate_up_proj.grad.float(), m.down_proj.grad.float()]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [32, 6], ids=["aligned", "unaligned"])
def test_grouped_experts_equal_loop_reference(dtype, tol, hidden, count_grouped_mm):
    """Outputs and all gradients (input, gate, both weights), with an expert that gets no rows.
    hidden=6 rows are 24 bytes, which torch._grouped_mm rejects: the grouped path falls back. CPU
    bf16 runs the padded-rows path (one mm per expert on a bounded set of shapes) instead, and CPU
    fp32 the fused kernel with one thread per expert (ThreadedCPUExperts)."""
    g = torch.Generator().manual_seed(0)
    n, inter, counts = 5, 8, [3, 0, 6, 2, 1]
    w1 = torch.randn(n, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(n, hidden, inter, generator=g) / math.sqrt(inter)
    x = torch.randn(sum(counts), hidden, generator=g)
    gate = torch.rand(sum(counts), generator=g)
    grouped = _experts_run("grouped", w1, w2, x, gate, counts, dtype)
    used_grouped_mm = len(count_grouped_mm) > 0
    loop = _experts_run("loop", w1, w2, x, gate, counts, dtype)
    for a, b in zip(grouped, loop):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol)
    padded = experts_mod.row_quantum(x.to(dtype)) > 1
    threaded = experts_mod.threaded_cpu_ops(x.to(dtype)) is not None
    assert used_grouped_mm == (experts_mod.GROUPED_MM and hidden == 32 and not padded and not threaded)
    assert torch.equal(grouped[3][1], torch.zeros_like(grouped[3][1]))  # the empty expert: zero gradient


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_model_moe_impl_grouped_equals_loop(dtype, tol):
    ids, labels = batch()
    results = {}
    for impl in ("grouped", "loop"):
        model = build_model(tiny(moe_impl=impl), seed=7).to(dtype)
        out = model(ids, labels=labels)
        out.loss.backward()
        results[impl] = (out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters()})
    (la, ga), (lb, gb) = results["grouped"], results["loop"]
    assert la.abs().max() > 0
    torch.testing.assert_close(la, lb, atol=tol, rtol=tol)
    assert ga.keys() == gb.keys() and any("experts.gate_up_proj" in k for k in ga)
    for name in ga:
        scale = max(1e-3, gb[name].abs().max().item())
        torch.testing.assert_close(ga[name], gb[name], atol=tol * scale, rtol=tol, msg=name)


# ----------------------------------------------------------------------------- router

def brute_force_route(x, weight, bias, n_group, topk_group, top_k, scoring="sigmoid"):
    """Per token, in plain Python: chosen groups by the sum of each group's top-2 biased scores,
    then the top_k biased scores among those groups' experts."""
    logits = x.double() @ weight.double().t()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    choice = (scores + bias.double()).tolist()
    e = weight.shape[0]
    per = e // n_group
    groups, chosen = [], []
    for row in choice:
        gs = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        keep = set(sorted(range(n_group), key=lambda g: -gs[g])[:topk_group])
        allowed = [i for i in range(e) if i // per in keep]
        groups.append(keep)
        chosen.append(set(sorted(allowed, key=lambda i: -row[i])[:top_k]))
    return groups, chosen, scores


@pytest.mark.parametrize("n_group, topk_group, top_k, scoring", [
    (4, 2, 4, "sigmoid"), (4, 1, 2, "sigmoid"), (8, 3, 6, "sigmoid"), (2, 1, 3, "softmax"), (1, 1, 4, "sigmoid"),
])
def test_group_limited_router_stays_in_chosen_groups(n_group, topk_group, top_k, scoring):
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    e, d = 16, 24
    router = Router(d, e, top_k, n_group, topk_group, True, 2.5, scoring)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, d, generator=g) / math.sqrt(d))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=g))
    x = torch.randn(300, d, generator=g)
    routing = router(x)
    groups, chosen, scores = brute_force_route(x, router.weight.detach(), router.e_score_correction_bias,
                                               n_group, topk_group, top_k, scoring)
    per = e // n_group
    got = routing.topk_idx.tolist()
    for t in range(len(got)):
        assert {i // per for i in got[t]} <= groups[t]
        assert set(got[t]) == chosen[t]
    # gate values: unbiased scores of the chosen experts, renormalised, times routed_scaling_factor
    picked = scores.gather(1, routing.topk_idx).float()
    torch.testing.assert_close(routing.topk_weight, 2.5 * picked / picked.sum(-1, keepdim=True))
    if n_group > topk_group:  # the limit matters: unrestricted top-k would leave the groups for some tokens
        free = (scores + router.e_score_correction_bias.double()).topk(top_k, -1).indices
        assert any({i // per for i in free[t].tolist()} - groups[t] for t in range(len(got)))


def test_bias_changes_selection_not_gate_values():
    g = torch.Generator().manual_seed(1)
    router = Router(16, 8, 2, 1, 1, False, 1.0, "sigmoid")
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
    x = torch.randn(64, 16, generator=g)
    before = router(x)
    with torch.no_grad():
        router.e_score_correction_bias[3] = 10.0  # expert 3 becomes everyone's pick
    after = router(x)
    assert (after.topk_idx == 3).any(-1).all() and not (before.topk_idx == 3).any(-1).all()
    torch.testing.assert_close(after.topk_weight, after.scores.gather(1, after.topk_idx))  # no bias inside


def test_bias_update_balances_a_skewed_router():
    """~100 optimizer steps of aux-loss-free balancing on fixed data: max/mean load falls."""
    g = torch.Generator().manual_seed(0)
    e, d = 8, 16
    router = Router(d, e, 2, 1, 1, True, 1.0, "sigmoid")
    with torch.no_grad():
        router.weight.copy_(0.2 * torch.randn(e, d, generator=g))
        router.weight[:, 0] = torch.linspace(-2, 2, e)  # expert affinity grows with the expert id
    x = torch.randn(512, d, generator=g)
    x[:, 0] += 1.0
    imbalance = []
    for _ in range(100):
        with torch.no_grad():
            counts = torch.bincount(router(x).topk_idx.flatten(), minlength=e).float()
        imbalance.append((counts.max() / counts.mean()).item())
        update_bias(router.e_score_correction_bias, counts, speed=0.01)
    assert imbalance[0] > 2.0
    assert max(imbalance[-10:]) < 1.3
    assert router.e_score_correction_bias[-1] < 0 < router.e_score_correction_bias[0]


def test_softmax_scoring():
    g = torch.Generator().manual_seed(2)
    moe = MoE(16, 8, 2, 8, 1, 2, 1, True, 1.0, scoring_func="softmax")
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    x = torch.randn(2, 10, 16, generator=g)
    routing = moe.gate(x.view(-1, 16))
    torch.testing.assert_close(routing.scores.sum(-1), torch.ones(20))
    torch.testing.assert_close(routing.scores, (x.view(-1, 16) @ moe.gate.weight.t()).softmax(-1))
    torch.testing.assert_close(routing.topk_weight.sum(-1), torch.ones(20))
    out, _ = moe(x)
    out.pow(2).sum().backward()
    assert torch.isfinite(out).all() and moe.gate.weight.grad.abs().sum() > 0
    model = build_model(tiny(scoring_func="softmax"))
    ids, labels = batch()
    assert torch.isfinite(model(ids, labels=labels).loss)


# ----------------------------------------------------------------------------- dispatch and capacity

def test_capacity_factor_drops_and_counts_and_dropless_keeps_all():
    n, k, e = 40, 2, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    topk_idx = torch.tensor([[0, 1]] * 30 + [[2, 3]] * 10)  # experts 0 and 1 overloaded
    weight = torch.rand(n, k, generator=g)
    capped = LocalDispatcher(e, capacity_factor=1.0).dispatch(x, topk_idx, weight)
    capacity = math.ceil(1.0 * n * k / e)  # 20 copies per expert
    assert capped.counts.tolist() == [20, 20, 10, 10]
    assert capped.dropped == 2 * (30 - capacity)
    kept_tokens = capped.ctx.token_of[:20].tolist()
    assert kept_tokens == list(range(20))  # the first tokens keep their slots
    free = LocalDispatcher(e).dispatch(x, topk_idx, weight)
    assert free.dropped == 0 and sum(free.counts) == n * k

    moe = MoE(8, e, k, 8, 0, 1, 1, False, 1.0, capacity_factor=1.0).train()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        moe.gate.e_score_correction_bias.copy_(torch.tensor([5.0, 5.0, 0.0, 0.0]))  # everyone picks 0 and 1
    out, _ = moe(x.view(1, n, 8))
    assert moe.stats[3].item() == 2 * (n - capacity) and moe.stats[4].item() == n * k
    assert torch.equal(out[0, capacity:], torch.zeros(n - capacity, 8))  # no shared expert, both copies dropped
    assert (out[0, :capacity].abs().sum(-1) > 0).all()


# ----------------------------------------------------------------------------- gradients

def test_expert_without_tokens_gets_zero_gradient():
    for impl in ("grouped", "loop"):
        moe = MoE(16, 4, 2, 16, 1, 1, 1, True, 1.0, impl=impl)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 4)
            moe.gate.e_score_correction_bias[2] = -100.0  # nobody picks expert 2
        out, _ = moe(torch.randn(1, 12, 16, generator=g))
        out.sum().backward()
        for w in (moe.experts.gate_up_proj, moe.experts.down_proj):
            assert w.grad is not None
            assert torch.equal(w.grad[2], torch.zeros_like(w.grad[2]))
            assert w.grad[[0, 1, 3]].abs().amax(dim=(1, 2)).gt(0).all()
    experts = Experts(3, 16, 8, impl="grouped")
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    y = experts(torch.zeros(0, 16, requires_grad=True), [0, 0, 0], torch.zeros(0))
    y.sum().backward()  # no rows at all on this rank
    assert experts.gate_up_proj.grad is not None and torch.equal(experts.gate_up_proj.grad,
                                                                 torch.zeros_like(experts.gate_up_proj))


def test_mtp_loss_and_gradients():
    cfg = tiny(num_nextn_predict_layers=2)
    model = build_model(cfg, seed=1)
    ids, labels = batch(t=16)
    out = model(ids, labels=labels)
    assert {"lm", "mtp"} <= out.losses.keys()
    assert torch.isfinite(out.losses["mtp"]) and out.losses["mtp"] > 0
    torch.testing.assert_close(out.loss.detach(), out.losses["lm"] + cfg.mtp_loss_weight * out.losses["mtp"])
    out.loss.backward()
    assert len(model.mtp) == 2
    for name, p in model.mtp.named_parameters():
        assert p.grad is not None, name
    for k in ("0", "1"):
        assert model.mtp[k].eh_proj.weight.grad.abs().sum() > 0
        assert model.mtp[k].block.mlp.experts.gate_up_proj.grad.abs().sum() > 0
    assert len(moe_layers(model)) == 2 + 2  # MoE blocks: layers 1, 2 and both MTP depths


# ----------------------------------------------------------------------------- RoPE vs transformers

@pytest.mark.parametrize("params, dim", [
    (dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0,
          beta_fast=32, beta_slow=1), 64),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0), 16),
    (dict(rope_type="yarn", factor=2.5, original_max_position_embeddings=128, truncate=False), 32),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=8192), 128),
    (dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=64), 8),
])
def test_rope_inverse_frequencies_equal_transformers(params, dim):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theta = 500000.0 if params["rope_type"] == "llama3" else 10000.0
    max_pos = int(params["original_max_position_embeddings"] * params["factor"])
    rope = {"rope_theta": theta, **params}
    if params["rope_type"] == "yarn":
        hf_cfg = transformers.DeepseekV3Config(qk_rope_head_dim=dim, max_position_embeddings=max_pos,
                                               rope_parameters=rope)
    else:
        hf_cfg = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, max_position_embeddings=max_pos,
                                          rope_parameters=rope)
    hf_inv, hf_attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg)
    inv, attention = rope_inv_freq(dim, theta, params, max_pos)
    assert torch.equal(inv, hf_inv.float())
    assert attention == pytest.approx(hf_attention, rel=1e-12)
    default, _ = rope_inv_freq(dim, theta, None, max_pos)
    assert not torch.equal(inv, default)  # the scaling did something
    if params["rope_type"] == "yarn":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
        assert yarn_softmax_scale(dim + 32, params) == pytest.approx(
            yarn_apply_mscale(rope, (dim + 32) ** -0.5), rel=1e-12)


# ----------------------------------------------------------------------------- attention fast path

@pytest.mark.parametrize("dv", [64, 96])
def test_explicit_causal_attention_equals_sdpa(dv):
    """The CPU fast path (explicit scores, hand-written backward) against torch's SDPA reference:
    outputs and all three gradients in float64, MLA's narrower v included; gradcheck on a small case."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 17, 96, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 17, dv, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, 17, dv, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = causal_attention(q, k, v, 0.3)  # CPU: the explicit path
    assert out.grad_fn is not None and "ExplicitCausalAttention" in type(out.grad_fn).__name__
    grads = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    small = [t.detach()[:1, :2, :5, :4].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: ExplicitCausalAttention.apply(a, b, c, 0.7), small)


def test_explicit_causal_attention_bf16_close_to_fp32():
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 4, 64, 96, generator=g) for _ in range(2))
    v = torch.randn(2, 4, 64, 64, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=96 ** -0.5)
    out = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 96 ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02)

"""Model FLOPs per token against a count written out by hand, matmul by matmul.

Conventions (as metrics.py): a (m x k) @ (k x n) matmul is 2*m*k*n FLOPs; per
token, a Linear(in, out) is 2*in*out; training = 3 x forward (backward = 2 x);
attention scores and values with the causal half, (T + 1) / 2 keys per query on
average; MoE layers count the router, the shared experts and the top-k routed
experts only; the embedding lookup is free; MTP depths are counted per token of
the main sequence.
"""
import pytest
import torch

from moe_trainer.config import ModelConfig
from moe_trainer.metrics import attention_flops_per_token, matmul_flops_per_token, train_flops_per_token

# tests/conftest.py's TINY model, plus one MTP depth
DSV3 = ModelConfig(arch="deepseek_v3", vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                   intermediate_size=128, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                   n_shared_experts=1, moe_intermediate_size=32, n_group=2, topk_group=1,
                   num_nextn_predict_layers=1)
LLAMA = ModelConfig(arch="llama3", vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=160)
SEQ = 32


def test_deepseek_v3_hand_count():
    # one MLA block, per token (Linear in -> out: 2*in*out FLOPs)
    q_a = 2 * 64 * 32                  # q_a_proj: d 64 -> q_lora_rank 32                    = 4096
    q_b = 2 * 32 * (2 * (16 + 8))      # q_b_proj: 32 -> heads 2 x (nope 16 + rope 8)         = 3072
    kv_a = 2 * 64 * (32 + 8)           # kv_a_proj_with_mqa: 64 -> kv_lora 32 + rope key 8    = 5120
    kv_b = 2 * 32 * (2 * (16 + 16))    # kv_b_proj: 32 -> heads 2 x (k_nope 16 + v 16)        = 4096
    o = 2 * (2 * 16) * 64              # o_proj: heads 2 x v 16 -> 64                         = 4096
    mla = q_a + q_b + kv_a + kv_b + o
    assert mla == 20480
    dense_ffn = 3 * 2 * 64 * 128       # gate, up (64 -> 128), down (128 -> 64)              = 49152
    router = 2 * 64 * 8                # gate: 64 -> 8 routed-expert scores                   = 1024
    expert = 3 * 2 * 64 * 32           # one SwiGLU expert of hidden 32                       = 12288
    moe = router + 1 * expert + 2 * expert  # 1 shared + top-2 routed (not all 8)             = 37888
    head = 2 * 64 * 320                # lm_head: 64 -> vocab 320                             = 40960
    eh_proj = 2 * (2 * 64) * 64        # MTP: [enorm(emb); hnorm(h)] 128 -> 64                = 16384
    # layer 0 dense (first_k_dense_replace=1), layers 1-2 MoE, head; MTP depth 1 = eh_proj + MLA + MoE + head
    main = 3 * mla + dense_ffn + 2 * moe + head
    mtp = eh_proj + mla + moe + head
    assert (main, mtp) == (227328, 115712)
    parts = matmul_flops_per_token(DSV3)
    assert parts["attention"] == 3 * mla and parts["dense_ffn"] == dense_ffn and parts["moe"] == 2 * moe
    assert parts["head"] == head and parts["mtp"] == mtp
    assert sum(parts.values()) == main + mtp
    # attention: per head, q.k over qk 16+8 = 24 dims and p.v over v 16 dims, (32+1)/2 = 16.5 keys on
    # average under the causal mask, in 3 main layers + 1 MTP block
    attn = 4 * 2 * (2 * 24 * 16.5 + 2 * 16 * 16.5)
    assert attn == 10560
    assert attention_flops_per_token(DSV3, SEQ) == attn
    assert train_flops_per_token(DSV3, SEQ) == 3 * (main + mtp + attn) == 1060800


def test_deepseek_v3_without_q_lora_and_mtp():
    cfg = ModelConfig(**{**DSV3.__dict__, "q_lora_rank": None, "num_nextn_predict_layers": 0})
    mla = 2 * 64 * (2 * 24) + 2 * 64 * 40 + 2 * 32 * 64 + 2 * 32 * 64  # q_proj, kv_a, kv_b, o
    main = 3 * mla + 49152 + 2 * 37888 + 40960
    attn = 3 * 2 * (2 * 24 * 16.5 + 2 * 16 * 16.5)
    assert train_flops_per_token(cfg, SEQ) == 3 * (main + attn)


def test_llama3_hand_count():
    # d 64, 4 query heads of 16, 2 kv heads (GQA), FFN 160, 2 layers, vocab 320
    q = 2 * 64 * (4 * 16)              # 8192
    k = v = 2 * 64 * (2 * 16)          # 4096 each
    o = 2 * (4 * 16) * 64              # 8192
    ffn = 3 * 2 * 64 * 160             # 61440
    head = 2 * 64 * 320                # 40960
    main = 2 * (q + k + v + o + ffn) + head
    assert main == 2 * (24576 + 61440) + 40960 == 212992
    attn = 2 * 4 * (2 * 16 * 16.5 + 2 * 16 * 16.5)  # every query head scores and sums over its shared kv head
    assert attn == 8448
    assert sum(matmul_flops_per_token(LLAMA).values()) == main
    assert attention_flops_per_token(LLAMA, SEQ) == attn
    assert train_flops_per_token(LLAMA, SEQ) == 3 * (main + attn) == 664320


def test_counted_flops_match_the_models_matmuls(monkeypatch):
    """Cross-check with torch's FLOP counter on the real models' forward: every
    projection matmul the model runs (loop experts: only routed rows are
    multiplied) must be in the hand count, and nothing else. The MTP depth runs
    on T - 1 positions (corrected for here). For MLA the counter also sees the
    attention's batched matmuls and charges them the full T x T square (the torch-op attention
    path: the fp32 attention kernel's GEMMs run inside C++, where the counter cannot see them, and
    F.linear: oneDNN's matmul, which the projections use on a CPU in fp32, is no op the counter knows)."""
    from torch.utils.flop_counter import FlopCounterMode
    from moe_trainer.kernels.cpu import extension as cpu_kernels
    from moe_trainer.kernels.cpu import layers
    from moe_trainer.models.registry import build_model
    monkeypatch.setattr(layers, "fused_attention_ops", lambda q: None)
    monkeypatch.setattr(cpu_kernels, "onednn_linear_enabled", lambda: False)  # oneDNN's matmul: uncounted too
    for cfg in (ModelConfig(**{**DSV3.__dict__, "moe_impl": "loop"}), LLAMA):
        model = build_model(cfg, 0).float()
        for name, mod in model.named_modules():  # a hooked shared expert runs as plain F.linear calls
            if name.endswith("shared_experts"):  # (its fused path writes mm(out=...), which the counter skips)
                mod.register_forward_hook(lambda *args: None)
        ids = torch.randint(0, cfg.vocab_size, (2, SEQ))
        with FlopCounterMode(display=False) as counter:
            model(ids, ids)
        ops = {str(k): v / (2 * SEQ) for k, v in counter.get_flop_counts()["Global"].items()}
        parts = matmul_flops_per_token(cfg)
        n = SEQ - 1  # MTP depth 1 predicts from T - 1 positions
        mtp_scale = n / SEQ if cfg.arch == "deepseek_v3" else 0.0
        assert ops.get("aten.mm", 0) + ops.get("aten.addmm", 0) == pytest.approx(
            sum(parts.values()) - parts["mtp"] + parts["mtp"] * mtp_scale, rel=1e-12)
        if cfg.arch == "deepseek_v3":  # MLA's score and value bmm's: 2 * h * (24 + 16) * keys per token
            full = 2 * 2 * 40 * (3 * SEQ + n * mtp_scale)
            # (on a CPU the scores come from one baddbmm with the causal mask: models.layers.causal_attention)
            assert ops.get("aten.bmm", 0) + ops.get("aten.baddbmm", 0) == pytest.approx(full, rel=1e-12)
            causal = 2 * 2 * 40 * (3 * (SEQ + 1) / 2 + (n + 1) / 2 * mtp_scale)
            assert attention_flops_per_token(cfg, SEQ) == pytest.approx(causal, rel=0.02)  # MTP: T vs T-1

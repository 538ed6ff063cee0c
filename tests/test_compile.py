"""Regional torch.compile (train.compile, moe_trainer/compile.py) on the accelerator path: a MoE
decoder layer at ep 1 is one graph with no break (torch._dynamo.explain) in bf16 and fp32 (fp32's
grouped GEMM is a custom op with its own shape rule: torch._grouped_mm's meta kernel takes bf16
only); compiled with fullgraph=True its forward + backward equals eager; and a short training run
of a whole model compiled region by region has the eager run's losses within bf16 tolerance.
The compiled runs use the aot_eager backend (dynamo + AOTAutograd, the graphs inductor would get,
without its C++ code generation, which takes ~2 minutes per layer on these 2 cores)."""
from __future__ import annotations

import copy

import pytest
import torch

from moe_trainer import kernels
from moe_trainer.compile import compile_regions
from moe_trainer.config import load_config
from moe_trainer.models.registry import build_model

from conftest import ROOT

SMALL = ["model.vocab_size=320", "model.hidden_size=64", "model.num_attention_heads=2", "model.intermediate_size=96",
         "model.moe_intermediate_size=32", "model.n_routed_experts=8", "model.q_lora_rank=32", "model.kv_lora_rank=32",
         "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16", "model.v_head_dim=16", "model.num_hidden_layers=3",
         "model.n_shared_experts=1", "model.num_nextn_predict_layers=1", "train.seq_len=32"]


def small_model(dtype, *extra):
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), SMALL + list(extra))
    with kernels.using("accelerator"):
        return cfg, build_model(cfg.model, seed=3).to(dtype)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_layer_is_one_graph_and_compiles_fullgraph(dtype):
    cfg, model = small_model(dtype)
    layer = model.layers["1"]
    assert layer.is_moe
    h = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    cos, sin = model.rope(32, h.device, dtype)
    ex = torch._dynamo.explain(layer)(h, cos, sin)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    eager = copy.deepcopy(layer)
    layer.compile(backend="aot_eager", fullgraph=True)
    outs = []
    for module in (layer, eager):
        h.grad = None
        out, _ = module(h, cos, sin)
        out.float().square().mean().backward()
        outs.append([out.float(), h.grad.float(), module.mlp.experts.gate_up_proj.grad.float()])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=tol)


def test_short_training_compiled_by_region_equals_eager():
    losses = {}
    ids = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(1))
    for mode in ("eager", "compiled"):
        _, model = small_model(torch.bfloat16, "model.num_hidden_layers=2")
        if mode == "compiled":
            names = compile_regions(model, backend="aot_eager")
            assert sorted(names) == ["layers.0", "layers.1", "lm_head", "loss_fn", "mtp.0.block", "norm"]
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        losses[mode] = []
        for step in range(3):
            loss = model(ids[:, :-1], ids[:, 1:]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[mode].append(loss.item())
    assert losses["eager"][0] > losses["eager"][-1]  # it trains: a wrong gradient would not descend alike
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=2e-2, atol=0)

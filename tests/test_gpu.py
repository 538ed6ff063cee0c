"""On a CUDA GPU (scripts/gpu_check.sh runs these; without CUDA they are skipped): the model against
transformers in bf16, the MoE layer's accelerator path against the reference, a forward + backward
with no host sync at all (torch.cuda.set_sync_debug_mode("error")), training with checkpoint save,
resume and MTP eval through the real trainer, and with 2+ GPUs the expert- and pipeline-parallel
layouts against one GPU over NCCL."""
from __future__ import annotations

import pytest
import torch

from moe_trainer import kernels
from moe_trainer.config import load_config
from moe_trainer.hf import from_hf
from moe_trainer.models.registry import build_model
from moe_trainer.moe.layer import MoE

from conftest import ROOT, TINY, check, launch, read_metrics, train_losses

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")]
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA = torch.device("cuda", 0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def test_model_matches_transformers_in_bf16_on_cuda(tmp_path):
    from test_hf_interop import ds_config, hf_model, ids
    cfg = ds_config(attn_implementation="sdpa")
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path)
    with kernels.using("accelerator"):
        ours = from_hf(tmp_path).to(CUDA, torch.bfloat16).eval()
    hf = hf.to(CUDA, torch.bfloat16)
    x = ids(cfg.vocab_size).to(CUDA)
    with torch.no_grad():
        assert rel(ours(x).logits, hf(x).logits) < 3e-2


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_moe_layer_accelerator_path_equals_reference_on_cuda(dtype, tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    layers = {}
    for name in ("accelerator", "reference"):
        torch.manual_seed(0)
        with kernels.using(name):
            layers[name] = MoE(256, 32, 4, 128, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5).to(CUDA, dtype)
        for p in layers[name].parameters():
            torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(4, 512, 256, device=CUDA, dtype=dtype)
    out = {}
    for name, layer in layers.items():
        xi = x.clone().requires_grad_()
        y, _ = layer(xi)
        y.float().square().sum().backward()
        out[name] = [y, xi.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad]
    for a, b in zip(out["accelerator"], out["reference"]):
        assert rel(a, b) < tol


def test_forward_backward_has_no_host_sync_on_cuda():
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), TINY + ["model.num_nextn_predict_layers=1"])
    with kernels.using("accelerator"):
        model = build_model(cfg.model, seed=1).to(CUDA, torch.bfloat16)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), device=CUDA)
    model(x[:, :-1], x[:, 1:]).loss.backward()  # warm-up: first calls may read device properties
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x[:, :-1], x[:, 1:]).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_training_checkpoint_resume_and_mtp_eval_on_cuda(tmp_path):
    steps = TINY + ["model.num_nextn_predict_layers=1", "model.seq_aux_loss_alpha=0.001", "train.max_steps=4",
                    "train.checkpoint_every=2", "train.eval_every=2", "train.resume=auto"]
    out = tmp_path / "run"
    check(launch(1, out, steps[:-1] + ["train.max_steps=2", "train.resume=auto"], launcher="python"))
    check(launch(1, out, steps, launcher="python"))  # resumes at step 2: fused AdamW's step on the GPU
    rows = read_metrics(out)
    assert sorted(train_losses(out)) == [1, 2, 3, 4]
    assert any("val_loss" in r for r in rows)
    assert all(r.get("mfu", 0) >= 0 for r in rows)


LAYOUTS = {"ep2": (2, ["parallel.ep=2"]), "pp2": (2, ["parallel.pp=2"]),
           "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"])}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_parallel_layouts_match_one_gpu_over_nccl(case, tmp_path):
    world, layout = LAYOUTS[case]
    if N_GPUS < world:
        pytest.skip(f"needs {world} GPUs, found {N_GPUS}")
    base = TINY + ["train.max_steps=3", "train.dtype=fp32", "parallel.cpu_alltoall=gloo"]
    one, many = tmp_path / "one", tmp_path / case
    check(launch(1, one, base, launcher="python"))
    check(launch(world, many, base + layout))
    a, b = train_losses(one), train_losses(many)
    for s in a:
        assert abs(a[s] - b[s]) <= 2e-3 * abs(a[s]), (s, a[s], b[s])  # TF32 GEMMs on both sides

"""Activation recomputation: same loss and gradients as without it, fewer saved
bytes, MoE counters not double-counted; and through the trainer on 2 ranks."""
import pytest
import torch

from moe_trainer.resolve import load_config
from moe_trainer.models.registry import build_model, moe_layers
from moe_trainer.parallel.pipeline import ActivationMeter
from moe_trainer.parallel.recompute import apply_recompute

from conftest import ROOT, TINY, check, launch, read_metrics, train_grad_norms, train_losses


def _run(arch: str, mode: str):
    over = ["model.hidden_size=64", "model.num_hidden_layers=3", "model.q_lora_rank=32", "model.kv_lora_rank=32",
            "model.n_routed_experts=8", "model.num_experts_per_tok=2", "model.n_group=2", "model.topk_group=1",
            "model.moe_intermediate_size=32", "model.intermediate_size=128", "model.num_nextn_predict_layers=1",
            f"model.arch={arch}", "model.num_key_value_heads=2"]
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), over)
    model = apply_recompute(build_model(cfg.model), mode)
    meter = ActivationMeter(model)
    x = torch.randint(0, 320, (2, 65), generator=torch.Generator().manual_seed(0))
    with meter.hooks():
        out = model(x[:, :-1], x[:, 1:])
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = [m.tokens_per_expert.clone() for _, m in moe_layers(model)]
    return out.loss.detach(), grads, meter.peak, counts


@pytest.mark.parametrize("arch", ["deepseek_v3", "llama3"])
def test_recompute_is_exact_and_saves_memory(arch):
    base_loss, base_grads, base_peak, base_counts = _run(arch, "none")
    peaks = {}
    for mode in ("selective", "full"):
        loss, grads, peaks[mode], counts = _run(arch, mode)
        assert torch.equal(loss, base_loss)
        assert grads.keys() == base_grads.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], base_grads[k], rtol=1e-5, atol=1e-7, msg=k)
        for c, b in zip(counts, base_counts):  # a re-run forward does not count tokens twice
            assert torch.equal(c, b)
    assert peaks["full"] < peaks["selective"] < base_peak
    assert peaks["full"] < 0.5 * base_peak


def test_recompute_through_the_trainer(tmp_path):
    base = TINY + ["train.max_steps=3", "parallel.ep=2"]
    check(launch(2, tmp_path / "none", base))
    check(launch(2, tmp_path / "full", base + ["parallel.recompute=full"]))
    # selective recomputation inside regionally compiled layers at ep 2 (each MoE layer one graph,
    # the all-to-alls in it; aot_eager: inductor's graphs without its C++ build)
    proc = check(launch(2, tmp_path / "compiled", base + ["parallel.recompute=selective", "train.compile=true",
                                                           "train.compile_backend=aot_eager"]))
    assert "torch.compile (aot_eager): 6 regions" in proc.stdout, proc.stdout[-2000:]
    # the compiled layers count the all-to-all bytes as eager does (fp32: the same routing), once per
    # step and direction; they do not time them (no clock mark inside a graph): no figure, not 0
    eager, compiled = ({r["step"]: r for r in read_metrics(tmp_path / run) if "loss" in r}
                       for run in ("none", "compiled"))
    for s, r in compiled.items():
        assert "time.all_to_all_s" not in r and "time.all_to_all_s" in eager[s], (s, sorted(r))
        for key in ("comm.dispatch_sent_bytes", "comm.combine_received_bytes", "comm.dispatch_grad_received_bytes",
                    "comm.combine_grad_sent_bytes"):
            assert r[key] == eager[s][key] > 0, (s, key, r[key], eager[s][key])
    for run in ("full", "compiled"):
        for read in (train_losses, train_grad_norms):  # the norm before clipping keeps a gradient's scale
            a, b = read(tmp_path / "none"), read(tmp_path / run)
            assert sorted(b) == [1, 2, 3]
            for s in a:
                assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), (run, read.__name__, s, a[s], b[s])

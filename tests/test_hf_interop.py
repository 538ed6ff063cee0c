"""Hugging Face interop: transformers' DeepSeek-V3 / Llama models <-> ours.

Tiny random transformers models are built from config objects (no hub access),
saved with save_pretrained, loaded with `from_hf`, and their logits compared
with ours in fp32. Weights are re-drawn at O(1) scale (transformers' 0.02 init
makes every logit nearly zero, which would hide mapping mistakes), norms get
non-unit gains and routers non-zero correction biases.
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_trainer.config import ModelConfig
from moe_trainer.hf import (HFFormatError, from_hf, hf_config_to_model_config, model_config_to_hf, model_yaml,
                            to_hf)
from moe_trainer.models.registry import build_model

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM)

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # max abs logit difference, fp32


# ----------------------------------------------------------------------------- helpers

def ds_config(**over) -> DeepseekV3Config:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, routed_scaling_factor=1.5,
                max_position_embeddings=128, attn_implementation="eager")
    base.update(over)
    return DeepseekV3Config(**base)


def llama_config(**over) -> LlamaConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager")
    base.update(over)
    return LlamaConfig(**base)


def randomize_(model: torch.nn.Module, seed: int = 0, bias_std: float = 0.5) -> torch.nn.Module:
    """O(1) activations: matrices ~ N(0, 1/fan_in), 1-D tensors (norm gains, biases) ~ 1 + N(0, 0.2^2),
    routers' correction biases ~ N(0, bias_std^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_std * torch.randn(b.shape, generator=g))
    return model.eval()


def hf_model(cfg, seed: int = 0):
    torch.manual_seed(seed)
    cls = DeepseekV3ForCausalLM if isinstance(cfg, DeepseekV3Config) else LlamaForCausalLM
    return randomize_(cls(cfg), seed)


def ids(vocab: int, b: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x) -> torch.Tensor:
    return model(x).logits.float()


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def tiny_ours(**over) -> ModelConfig:
    base = dict(arch="deepseek_v3", vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, moe_intermediate_size=16, n_group=4, topk_group=2, routed_scaling_factor=1.5,
                max_position_embeddings=128)
    base.update(over)
    return ModelConfig(**base)


def tiny_llama(**over) -> ModelConfig:
    base = dict(arch="llama3", vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128)
    base.update(over)
    return ModelConfig(**base)


def rewrite_weights(path: Path, edit) -> None:
    """Apply edit(dict) to the single model.safetensors of a checkpoint directory."""
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------- DeepSeek-V3: HF -> ours

# DeepSeek-V3's factor 40 (its interpolated frequencies are where rounding differs from a naive formula)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

DS_CASES = {
    # q_lora, 4 groups pick 2, interleaved rope, 1 dense layer, sharded checkpoint
    "qlora_g4k2_interleave": dict(cfg=dict(), shard="30KB"),
    # plain q_proj, n_group=1, rotate-half rope, no dense layer, no top-k renormalisation, sdpa
    "noqlora_g1_halfrope_dense0": dict(cfg=dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
                                                first_k_dense_replace=0, norm_topk_prob=False,
                                                attn_implementation="sdpa")),
    # YaRN with mscale_all_dim, 2 dense layers of 3, 2 groups pick 1, 2 shared experts, top-3; a large
    # rms_norm_eps shows that the latent norms (q_a/kv_a_layernorm) keep DeepSeek's fixed 1e-6
    "yarn_g2k1_dense2": dict(cfg=dict(q_lora_rank=16, n_group=2, topk_group=1, num_hidden_layers=3,
                                      first_k_dense_replace=2, rope_parameters=dict(YARN),
                                      max_position_embeddings=1280, rms_norm_eps=0.05,
                                      n_shared_experts=2, num_experts_per_tok=3)),
    # tied embeddings, attention biases, no shared expert, top-1 (gate renormalised to 1), groups unrestricted
    "tied_bias_noshared_top1": dict(cfg=dict(tie_word_embeddings=True, attention_bias=True, n_shared_experts=0,
                                             num_experts_per_tok=1, n_group=4, topk_group=4)),
}


@pytest.mark.parametrize("case", list(DS_CASES))
def test_deepseek_logits_match_transformers(case, tmp_path):
    spec = DS_CASES[case]
    cfg = ds_config(**spec["cfg"])
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path, **({"max_shard_size": spec["shard"]} if "shard" in spec else {}))
    if "shard" in spec:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = from_hf(tmp_path)
    x = ids(cfg.vocab_size)
    ref = logits(hf, x)
    out = logits(ours, x)
    assert out.shape == (2, 16, cfg.vocab_size)
    assert max_diff(out, ref) < TOL
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    # the correction bias was carried over and it changes which experts are picked
    hf_bias = {n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    for name, b in hf_bias.items():
        ours_name = name.removeprefix("model.")
        assert torch.equal(dict(ours.named_buffers())[ours_name], b)
    with torch.no_grad():
        for b in hf_bias.values():
            b.zero_()
    assert max_diff(logits(hf, x), ref) > 1e-3


def test_yarn_softmax_scale_and_frequencies(tmp_path):
    cfg = ds_config(rope_parameters=dict(YARN), max_position_embeddings=1280)
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    attn = ours.layers["0"].self_attn
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    mscale = 0.1 * YARN["mscale_all_dim"] * math.log(YARN["factor"]) + 1.0
    assert attn.softmax_scale == pytest.approx(qk_head_dim ** -0.5 * mscale ** 2, rel=1e-12)
    assert attn.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert attn.softmax_scale > 1.2 * qk_head_dim ** -0.5
    assert torch.equal(ours.rotary.inv_freq, hf.model.rotary_emb.inv_freq)
    assert ours.rotary.attention_scaling == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert ours.rotary.attention_scaling != pytest.approx(1.0)  # mscale != mscale_all_dim


def test_stacked_expert_checkpoint_loads_like_per_expert(tmp_path):
    """transformers' save_pretrained writes one tensor per expert; the in-memory (stacked) layout loads too."""
    hf = hf_model(ds_config())
    per_expert, stacked = tmp_path / "per_expert", tmp_path / "stacked"
    hf.save_pretrained(per_expert)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in load_file(str(per_expert / "model.safetensors")))
    stacked.mkdir()
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(stacked / "model.safetensors"))
    a, b = from_hf(per_expert).state_dict(), from_hf(stacked).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_declared_mtp_without_weights_loads_without_mtp(tmp_path):
    cfg = ds_config(num_nextn_predict_layers=1)
    hf_model(cfg).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ours = from_hf(tmp_path)
    assert ours.cfg.num_nextn_predict_layers == 0 and len(ours.mtp) == 0


def test_fp8_block_scaled_checkpoint_is_dequantized(tmp_path):
    """DeepSeek's release format: linear weights in float8_e4m3fn with a weight_scale_inv per block
    (blocks may be partial at the edges). Loading equals loading the dequantized values in fp32."""
    block = [8, 16]
    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    hf_model(ds_config()).save_pretrained(fp8)
    tensors = load_file(str(fp8 / "model.safetensors"))
    dequantized = dict(tensors)
    quantized = 0
    for key in [k for k in tensors if k.endswith("proj.weight") and tensors[k].dim() == 2]:
        w = tensors[key]
        rows, cols = w.shape
        r, c = math.ceil(rows / block[0]), math.ceil(cols / block[1])
        padded = torch.zeros(r * block[0], c * block[1])
        padded[:rows, :cols] = w
        scale = padded.view(r, block[0], c, block[1]).abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
        q = (w / full).to(torch.float8_e4m3fn)
        tensors[key], tensors[key + "_scale_inv"] = q, scale
        dequantized[key] = q.float() * full
        quantized += 1
    assert quantized > 20 and any(".experts.0.gate_proj" in k for k in tensors if k.endswith("_scale_inv"))
    save_file(tensors, str(fp8 / "model.safetensors"))
    edit_config(fp8, lambda c: c.update(quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}))
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({k: v for k, v in json.loads(
        (fp8 / "config.json").read_text()).items() if k != "quantization_config"}))
    save_file(dequantized, str(plain / "model.safetensors"))
    a, b = from_hf(fp8).state_dict(), from_hf(plain).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    original = load_file(str(tmp_path / "fp8" / "model.safetensors"))  # fp8 really changed the weights
    assert original["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn


# ----------------------------------------------------------------------------- Llama: HF -> ours

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

LLAMA_CASES = {
    "gqa": dict(),
    "tied_llama3_rope_sdpa": dict(tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE),
                                  attn_implementation="sdpa"),
    "mqa_head_dim_attention_bias": dict(num_key_value_heads=1, head_dim=16, attention_bias=True),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_logits_match_transformers(case, tmp_path):
    cfg = llama_config(**LLAMA_CASES[case])
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    assert ours.cfg.arch == "llama3"
    x = ids(cfg.vocab_size)
    ref = logits(hf, x)
    assert max_diff(logits(ours, x), ref) < TOL
    assert ref.abs().max() > 1.0
    if cfg.tie_word_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight
    if "rope_parameters" in LLAMA_CASES[case]:
        default = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
        assert not torch.allclose(ours.rotary.inv_freq, default)  # the scaling is in effect


# ----------------------------------------------------------------------------- ours -> HF -> ours

ROUND_TRIP = {
    "deepseek_mtp2_yarn": lambda: tiny_ours(num_nextn_predict_layers=2, max_position_embeddings=1280, rope_scaling={
        k: v for k, v in YARN.items() if k != "rope_theta"}, bias_update_speed=0.01, seq_aux_loss_alpha=1e-4),
    "deepseek_tied_noshared_noqlora": lambda: tiny_ours(tie_word_embeddings=True, n_shared_experts=0,
                                                        q_lora_rank=None, n_group=1, topk_group=1,
                                                        num_nextn_predict_layers=1),
    "llama_tied_llama3_rope": lambda: tiny_llama(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}),
}


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_round_trip_is_exact(case, stacked, tmp_path):
    cfg = ROUND_TRIP[case]()
    model = randomize_(build_model(cfg, seed=3), seed=3)
    to_hf(model, tmp_path / "hf", stacked_experts=stacked)
    back = from_hf(tmp_path / "hf")
    assert back.cfg == cfg
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    if cfg.num_nextn_predict_layers:
        assert any(k.startswith("mtp.1." if cfg.num_nextn_predict_layers > 1 else "mtp.0.") for k in b)
        written = load_file(str(tmp_path / "hf" / "model.safetensors"))
        mtp_layer = f"model.layers.{cfg.num_hidden_layers}"
        assert f"{mtp_layer}.eh_proj.weight" in written and f"{mtp_layer}.shared_head.norm.weight" in written


@pytest.mark.parametrize("case", ["deepseek_mtp2_yarn", "deepseek_tied_noshared_noqlora", "llama_tied_llama3_rope"])
def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    cfg = ROUND_TRIP[case]()
    ours = randomize_(build_model(cfg, seed=5), seed=5)
    to_hf(ours, tmp_path / "hf")
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                    attn_implementation="eager", dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # the only keys transformers does not take are DeepSeek's MTP layers after the main ones
    unexpected = info["unexpected_keys"]
    assert all(re.match(r"model\.layers\.(\d+)\.", k) and int(k.split(".")[2]) >= cfg.num_hidden_layers
               for k in unexpected)
    assert bool(unexpected) == bool(cfg.num_nextn_predict_layers)
    x = ids(cfg.vocab_size)
    ref = logits(ours, x)
    assert max_diff(logits(hf, x), ref) < TOL
    assert ref.abs().max() > 1.0


def test_config_round_trip_through_dicts():
    for cfg in (tiny_ours(num_nextn_predict_layers=1, capacity_factor=1.25, moe_impl="loop"), tiny_llama(head_dim=16)):
        hf = model_config_to_hf(cfg)
        assert hf_config_to_model_config(json.loads(json.dumps(hf))) == cfg
    hf = model_config_to_hf(tiny_ours())
    assert hf["num_key_value_heads"] == hf["num_attention_heads"]  # transformers repeats kv heads by this ratio
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_legacy_rope_scaling_fields_are_read():
    """DeepSeek-V3's released config.json: rope_scaling with `type`, rope_theta beside it."""
    hf = model_config_to_hf(tiny_ours())
    del hf["rope_parameters"]
    hf.update(rope_theta=20000, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                              "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
              topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
    cfg = hf_config_to_model_config(hf)
    assert cfg.rope_theta == 20000.0
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40


# ----------------------------------------------------------------------------- bad input

@pytest.fixture
def saved_ds(tmp_path):
    hf_model(ds_config()).save_pretrained(tmp_path)
    return tmp_path


def test_missing_key_is_named(saved_ds):
    rewrite_weights(saved_ds, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight"))
    with pytest.raises(HFFormatError, match=r"missing .*model\.layers\.0\.self_attn\.o_proj\.weight"):
        from_hf(saved_ds)


def test_missing_expert_is_named(saved_ds):
    rewrite_weights(saved_ds, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(HFFormatError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        from_hf(saved_ds)


def test_unexpected_key_is_named(saved_ds):
    rewrite_weights(saved_ds, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(HFFormatError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        from_hf(saved_ds)


def test_wrong_shape_is_named(saved_ds):
    rewrite_weights(saved_ds, lambda t: t.update({"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(80, 15)}))
    with pytest.raises(HFFormatError, match=r"kv_b_proj\.weight has shape \(80, 15\) .* \(80, 16\)"):
        from_hf(saved_ds)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(model_type="mistral"), "model_type"),
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "foo": 1}), "foo"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(topk_method="greedy"), "topk_method"),
    (lambda c: c.update(n_group=3), "n_group"),
    (lambda c: c.update(quantization_config={"quant_method": "gptq"}), "quant_method"),
])
def test_unsupported_config_value_names_the_field(saved_ds, edit, field):
    edit_config(saved_ds, edit)
    with pytest.raises(ValueError, match=field) as err:
        from_hf(saved_ds)
    assert isinstance(err.value, HFFormatError)
    assert "\n" not in str(err.value)


def test_unknown_architecture_and_missing_files(tmp_path):
    with pytest.raises(HFFormatError, match="architectures"):
        hf_config_to_model_config({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(HFFormatError, match="config.json"):
        from_hf(tmp_path)
    llama_dir = tmp_path / "llama"
    hf_model(llama_config()).save_pretrained(llama_dir)
    (llama_dir / "model.safetensors").rename(llama_dir / "pytorch_model.bin")
    with pytest.raises(HFFormatError, match="safetensors"):
        from_hf(llama_dir)
    edit_config(llama_dir, lambda c: c.update(mlp_bias=True))
    with pytest.raises(HFFormatError, match="mlp_bias"):
        from_hf(llama_dir)


def test_to_hf_refuses_softmax_router_and_existing_output(tmp_path):
    with pytest.raises(HFFormatError, match="scoring_func"):
        to_hf(build_model(tiny_ours(scoring_func="softmax")), tmp_path / "a")
    assert not (tmp_path / "a").exists()
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(HFFormatError, match="already exists"):
        to_hf(build_model(tiny_llama()), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    to_hf(build_model(tiny_llama()), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_sharded_export(tmp_path):
    model = randomize_(build_model(tiny_ours()))
    to_hf(model, tmp_path / "hf", max_shard_bytes=20_000)
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 2
    back = from_hf(tmp_path / "hf")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- the command-line tool

def _cli():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_import_then_export_round_trips_through_transformers(tmp_path, capsys):
    cli = _cli()
    hf = hf_model(ds_config(num_nextn_predict_layers=0))
    hf.save_pretrained(tmp_path / "src")
    assert cli.main(["import", str(tmp_path / "src"), str(tmp_path / "w.safetensors")]) == 0
    assert (tmp_path / "w.yaml").is_file()
    assert cli.main(["export", "--config", str(tmp_path / "w.yaml"), "--weights", str(tmp_path / "w.safetensors"),
                     str(tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    x = ids(96)
    assert max_diff(logits(again, x), logits(hf, x)) < TOL


def test_cli_exports_a_run_checkpoint_directory(tmp_path):
    """runs/X/checkpoints/step_N/ (sharded parts, our names) + runs/X/config.yaml, no --config."""
    from moe_trainer.checkpoint import read_full, verify, write_model
    cli = _cli()
    cfg = tiny_llama(tie_word_embeddings=True)
    model = randomize_(build_model(cfg))
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_5"
    write_model(model, step, 5)
    assert verify(step) is None  # every file's size and sha256 as its manifest says
    assert "lm_head.weight" not in read_full(step)  # as the trainer stores it
    (run / "config.yaml").write_text(model_yaml(cfg))
    assert cli.main(["export", "--weights", str(step), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(hf.model.embed_tokens.weight, model.embed_tokens.weight.detach().to(torch.bfloat16))


def test_cli_bad_input_is_one_sentence(tmp_path, capsys):
    cli = _cli()
    assert cli.main(["import", str(tmp_path / "nope"), str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err and "Traceback" not in err
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(b"not safetensors")
    assert cli.main(["export", "--weights", str(bad), "--set", "model.arch=llama3", str(tmp_path / "o")]) == 2
    assert "config" in capsys.readouterr().err  # no config.yaml beside it and no --config
    assert not (tmp_path / "o").exists()


def test_cli_help_runs_as_a_script():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    assert "import" in proc.stdout and "export" in proc.stdout
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf.py"), "import", "/nonexistent/dir",
                           "/tmp/unused.safetensors"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "/nonexistent/dir" in proc.stderr

"""Config tree: YAML + typed --set overrides, and every validation error path."""
import subprocess
import sys

import pytest

from moe_trainer.config import ConfigError, validate_layout
from moe_trainer.resolve import load_config, overlap_runs
from moe_trainer.parallel.zero import deepspeed_config

from conftest import ROOT, env

BASE = str(ROOT / "configs" / "moe_tiny.yaml")


def test_defaults_file_and_overrides_compose():
    cfg = load_config(BASE, ["train.max_steps=7", "train.lr=1e-3", "model.q_lora_rank=null",
                             "model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 64}"])
    assert cfg.train.max_steps == 7 and cfg.train.lr == 1e-3
    assert cfg.model.q_lora_rank is None
    assert cfg.model.rope_scaling["factor"] == 4
    assert cfg.model.arch == "deepseek_v3"


def test_int_accepted_for_float():
    assert load_config(BASE, ["train.lr=1"]).train.lr == 1.0


@pytest.mark.parametrize("override, words", [
    (["train.max_stepz=3"], ["unknown key train.max_stepz", "max_steps"]),
    (["nosection.x=1"], ["unknown key nosection", "train"]),
    (["train.max_steps=abc"], ["train.max_steps", "int"]),
    (["train.max_steps=1.5"], ["train.max_steps", "int"]),
    (["model.tie_word_embeddings=3"], ["model.tie_word_embeddings", "bool"]),
    (["model.arch=gpt"], ["model.arch", "deepseek_v3, llama3"]),
    (["train.dtype=fp16"], ["train.dtype", "fp32, bf16"]),
    (["parallel.recompute=some"], ["parallel.recompute", "selective"]),
    (["model.scoring_func=relu"], ["model.scoring_func", "sigmoid"]),
    (["model.n_group=3"], ["model.n_group (3)", "n_routed_experts (16)"]),
    (["model.topk_group=5"], ["model.topk_group", "n_group (4)"]),
    (["model.num_experts_per_tok=17"], ["model.num_experts_per_tok", "n_routed_experts"]),
    (["model.n_group=8", "model.topk_group=1", "model.num_experts_per_tok=4"], ["topk_group (1)", "cannot supply"]),
    (["model.capacity_factor=0"], ["model.capacity_factor", "positive"]),
    (["model.qk_rope_head_dim=7"], ["qk_rope_head_dim", "even"]),
    (["train.global_batch_size=13"], ["global_batch_size (13)", "micro_batch_size (2)"]),
    (["train.seq_len=0"], ["train.seq_len", "positive"]),
    (["parallel.pp=9"], ["num_hidden_layers (4)", "parallel.pp (9)"]),
    (["parallel.pp=2", "parallel.pp_partition=[1, 1]"], ["parallel.pp_partition", "summing to 4"]),
    (["parallel.cp=3"], ["seq_len (128)", "2 * parallel.cp"]),
    (["parallel.ep=2", "parallel.tp=2"], ["parallel.ep and parallel.tp"]),
    (["model.arch=llama3", "parallel.ep=2"], ["parallel.ep must be 1", "llama3"]),
    (["model.arch=llama3", "model.num_key_value_heads=3"], ["num_key_value_heads (3)", "num_attention_heads (4)"]),
    (["model.arch=llama3", "parallel.tp=8"], ["num_attention_heads (4)", "parallel.tp (8)"]),
    (["model.rope_scaling={rope_type: ntk}"], ["rope_scaling.rope_type", "yarn"]),
    (["data.val_fraction=0.7"], ["data.val_fraction"]),
    (["train.keep_checkpoints=0"], ["train.keep_checkpoints"]),
    (["train.max_steps"], ["--set expects key=value"]),
])
def test_bad_values_fail_with_one_sentence(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(BASE, override)
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith(".")
    for w in words:
        assert w in msg, msg


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train: 5\n")
    with pytest.raises(ConfigError, match="train must be a mapping"):
        load_config(str(wrong))


@pytest.mark.parametrize("world, override, words", [
    (3, ["parallel.pp=2"], ["world size (3)", "parallel.pp * parallel.tp * parallel.cp (2)"]),
    (4, ["parallel.ep=3"], ["parallel.ep (3)", "divide"]),
    (4, ["parallel.ep=4", "model.n_routed_experts=6", "model.n_group=1", "model.topk_group=1"],
     ["n_routed_experts (6)", "parallel.ep"]),
    (4, ["train.global_batch_size=8", "train.micro_batch_size=4"], ["global_batch_size (8)", "4 * 4 = 16"]),
    (2, ["parallel.micro_batches=3"], ["parallel.micro_batches (3)"]),
])
def test_layout_errors(world, override, words):
    cfg = load_config(BASE, override)
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg, world)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_layout_derivation_and_deepspeed_json():
    cfg = load_config(BASE, ["train.global_batch_size=32", "train.micro_batch_size=4", "parallel.ep=2",
                             "train.dtype=bf16"])
    layout = validate_layout(cfg, 4)
    assert (layout.dp, layout.ep, layout.edp, layout.grad_accum) == (4, 2, 2, 2)
    ds = deepspeed_config(cfg, layout)
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["type"] == "AdamW" and ds["gradient_clipping"] == cfg.train.grad_clip


def test_cli_reports_config_error_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "moe_trainer.train", "--config", BASE, "--set", "model.arch=gpt"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "model.arch must be one of deepseek_v3, llama3" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("config, worlds", [
    ("moe_tiny.yaml", [1, 2, 4, 8]), ("llama3_tiny.yaml", [1, 2, 4, 8]),  # ./scripts/train.sh on any GPU count
    ("moe_1b_gpu.yaml", [1]), ("moe_1b_8gpu.yaml", [8]), ("moe_1b_16gpu.yaml", [16])])
def test_gpu_configs_train_as_is_at_their_world_sizes(config, worlds):
    cfg = load_config(str(ROOT / "configs" / config), [])
    for world in worlds:
        layout = validate_layout(cfg, world)
        assert layout.world == world and layout.dp * layout.pp * layout.tp * layout.cp == world


def test_dtype_auto_is_bf16_on_accelerators_and_fp32_on_cpu():
    import torch

    from moe_trainer.train import resolve_device_settings
    for device, want in (("cpu", "fp32"), ("meta", "bf16")):  # meta: any device but a CPU (TF32 is set on CUDA only)
        cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), [])
        assert cfg.train.dtype == "auto"
        resolve_device_settings(cfg, torch.device(device))
        assert cfg.train.dtype == want


def test_compile_auto_is_on_for_cuda_only_and_takes_no_other_word():
    import torch

    from moe_trainer.train import resolve_device_settings
    precision = torch.get_float32_matmul_precision()  # a "cuda" device sets TF32 for the process
    try:
        for device, want in (("cpu", False), ("meta", False), ("cuda", True)):  # a torch.device needs no GPU
            cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), [])
            assert cfg.train.compile == "auto"
            resolve_device_settings(cfg, torch.device(device))
            assert cfg.train.compile is want
        for given in (True, False):
            cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), [f"train.compile={str(given).lower()}"])
            resolve_device_settings(cfg, torch.device("cuda"))
            assert cfg.train.compile is given
    finally:
        torch.set_float32_matmul_precision(precision)
    with pytest.raises(ConfigError, match="train.compile must be one of auto, True, False, got 'sometimes'"):
        load_config(str(ROOT / "configs/moe_tiny.yaml"), ["train.compile=sometimes"])


def test_cuda_asked_for_without_a_gpu_is_one_sentence(tmp_path):
    e = env()
    e["DS_ACCELERATOR"] = "cuda"
    proc = subprocess.run([sys.executable, "-m", "moe_trainer.train", "--config", "configs/moe_tiny.yaml",
                           "--set", f"run.out_dir={tmp_path}"], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rank 0: DS_ACCELERATOR=cuda asks for CUDA, but torch" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_overlap_auto_is_a2a_on_gpus_where_it_runs_and_none_elsewhere():
    """parallel.overlap auto: none at load where the overlapped executor cannot run (ep 1, plain 1F1B
    at pp > 1); where it can, a2a on an accelerator whose run stays eager (train.compile false), none
    where it compiles (compile auto on CUDA: the measured compiled path keeps its graphs, where the
    overlap would have made it eager and host-bound) and on CPU ranks, whose shared-memory exchange has
    nothing to hide; an explicit value is kept. The planner and the dry run resolve it alike."""
    import torch

    from moe_trainer.plan.memory import overlapped
    from moe_trainer.train import resolve_device_settings
    tiny = str(ROOT / "configs/moe_tiny.yaml")
    assert load_config(tiny, []).parallel.overlap == "none"  # ep 1
    assert load_config(tiny, ["parallel.ep=2", "parallel.pp=2"]).parallel.overlap == "none"  # plain 1F1B
    precision = torch.get_float32_matmul_precision()
    try:
        for device, compile_, overlap, compiled in (("cpu", "auto", "none", False), ("cuda", "auto", "none", True),
                                                    ("cuda", "false", "a2a", False), ("cuda", "true", "none", True),
                                                    ("xpu", "auto", "a2a", False)):
            cfg = load_config(tiny, ["parallel.ep=2", f"train.compile={compile_}"])
            assert cfg.parallel.overlap == "auto"
            assert overlapped(cfg, 4) == (device == "cuda" and overlap == "a2a")  # the planner plans CUDA ranks
            assert overlap_runs(cfg, device) == (overlap == "a2a")
            resolve_device_settings(cfg, torch.device(device))
            assert (cfg.parallel.overlap, cfg.train.compile) == (overlap, compiled), device
        cfg = load_config(tiny, ["parallel.ep=2", "parallel.overlap=a2a"])
        assert overlap_runs(cfg, "cuda") and overlapped(cfg, 4) and not overlapped(cfg, 1)
        resolve_device_settings(cfg, torch.device("cpu"))
        assert cfg.parallel.overlap == "a2a"
    finally:
        torch.set_float32_matmul_precision(precision)

"""Rank-local construction: each rank's module, built on the meta device from its coordinates,
holds exactly what the planner says, and materialises exactly the single-process weights."""
import resource
import time

import pytest
import torch

from moe_trainer import plan
from moe_trainer.resolve import load_config
from moe_trainer.models.init import init_values
from moe_trainer.models.registry import build_model
from moe_trainer.parallel.local import rank_local_model
from moe_trainer.parallel.tensor import shard_param

from conftest import TINY


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("config, coords", [
    ("configs/deepseek_v3_671b.yaml", "ep"),  # PP 16 x EP 64
    ("configs/llama3_405b.yaml", "tp"),  # TP 8 x PP 16
])
def test_rank_local_parameters_equal_the_planners_per_stage_figures(config, coords):
    cfg = load_config(config, [])
    par = cfg.parallel
    partition = plan.stage_partition(cfg)
    expected = plan.rank_params(cfg.model, par, partition)
    t0 = time.perf_counter()
    last_sig = None
    for stage in range(par.pp):
        sig = (partition[stage], stage == 0, stage == par.pp - 1)
        if sig == last_sig:  # the same stage shape as the one before: the same counts
            continue
        last_sig = sig
        index = (par.ep if coords == "ep" else par.tp) - 1  # the last rank: offsets are not zero
        module = rank_local_model(cfg, pp=stage, **{coords: index})
        assert all(p.device.type == "meta" for p in module.parameters())
        want = expected[stage].dense + expected[stage].expert
        assert _count(module) == pytest.approx(want, rel=0, abs=0.5), (stage, _count(module), want)
    assert time.perf_counter() - t0 < 30


def test_building_one_rank_of_the_671b_config_is_cheap():
    cfg = load_config("configs/deepseek_v3_671b.yaml", [])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    module = rank_local_model(cfg, pp=5, ep=63)
    assert time.perf_counter() - t0 < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2 * 1024 * 1024  # KB: under 2 GB
    assert _count(module) > 1e9  # 4 MoE layers of 4 experts + attention: billions of (meta) parameters


def _tiny_cfg(extra):
    return load_config("configs/moe_tiny.yaml", TINY + extra)


def test_every_layout_materialises_the_single_process_weights():
    """pp 2 x ep 4: each rank's experts and layers are the same slices of build_model's weights."""
    cfg = _tiny_cfg(["parallel.pp=2", "parallel.ep=4", "model.num_nextn_predict_layers=1"])
    full = dict(build_model(cfg.model, cfg.run.seed).named_parameters())
    seen = set()
    for stage in range(2):
        for ep in range(4):
            local = rank_local_model(cfg, pp=stage, ep=ep, materialized=True)
            for name, p in local.named_parameters():
                seen.add(name)
                ref = full[name]
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    n = ref.shape[0] // 4
                    ref = ref[ep * n:(ep + 1) * n]
                assert torch.equal(p, ref), name
    assert seen == set(full)


def test_tensor_parallel_shards_materialise_the_single_process_weights():
    cfg = load_config("configs/llama3_tiny.yaml", ["model.num_attention_heads=4", "model.num_key_value_heads=2",
                                                   "parallel.tp=2", "parallel.pp=2", "model.num_hidden_layers=2"])
    full = dict(build_model(cfg.model, cfg.run.seed).named_parameters())
    for stage in range(2):
        for tp in range(2):
            local = rank_local_model(cfg, pp=stage, tp=tp, materialized=True)
            for name, p in local.named_parameters():
                ref, _ = shard_param(name, full[name], cfg.model, 2, tp)
                assert torch.equal(p, ref), name


def test_init_values_depend_on_seed_name_and_expert_only():
    a = init_values("layers.1.mlp.experts.gate_up_proj", (8, 6, 4), (2, 0, 0), (3, 6, 4), std=0.1, seed=5)
    b = init_values("layers.1.mlp.experts.gate_up_proj", (8, 6, 4), std=0.1, seed=5)
    assert torch.equal(a, b[2:5])
    big = (3000, 2000)  # several row blocks, a column shard across them
    c = init_values("layers.0.mlp.down_proj.weight", big, (0, 1000), (3000, 1000), std=0.1, seed=1)
    d = init_values("layers.0.mlp.down_proj.weight", big, std=0.1, seed=1)
    assert torch.equal(c, d[:, 1000:])
    assert not torch.equal(d, init_values("layers.0.mlp.down_proj.weight", big, std=0.1, seed=2))
    assert not torch.equal(d, init_values("layers.0.mlp.up_proj.weight", big, std=0.1, seed=1))

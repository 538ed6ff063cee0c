"""A run's measured expert load in the step-time model (plan/replacement.py): the online re-placement
replayed on it out of sample, its moves' and copies' traffic (time.replacement_seconds), the layout
search meeting the load at each ep, and the command line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_trainer.expert_load.files import write_expert_load
from moe_trainer.moe.placement import eplb_reference, rebalance_experts
from moe_trainer.moe.placement.online import home_row, rank_loads, replan
from moe_trainer.plan.gpus import Efficiency, gpu_named
from moe_trainer.plan.replacement import natural_imbalance, read_load, replaced
from moe_trainer.plan.search import search
from moe_trainer.plan.time import Mechanisms, Replacement, replacement_seconds, step_time
from moe_trainer.plan.work import setup_from_config
from moe_trainer.resolve import load_config

ROOT = Path(__file__).resolve().parents[1]


def _load(tmp_path, per_interval, steps=40, log_every=2, layers=2):
    """expert_load/ files every `log_every` steps; `per_interval(k)`: one layer's counts in the k-th
    8-step interval (the same for every layer)."""
    for step in range(log_every, steps + 1, log_every):
        write_expert_load(tmp_path, step, torch.stack([per_interval((step - 1) // 8)] * layers))
    return read_load(str(tmp_path))


def test_replacement_is_replayed_out_of_sample_with_its_moves_and_copies(tmp_path):
    # two hot experts, both on EP rank 0 at home: one decision parts them, the later ones keep
    hot_pair = _load(tmp_path / "pair", lambda k: torch.tensor([10.0, 10, 1, 1, 1, 1, 1, 1]))
    assert natural_imbalance(hot_pair, 2) == pytest.approx(22 / 13)
    r = replaced(hot_pair, 2, 8, 0)
    assert r.imbalance == pytest.approx(1.0) and r.decisions == 4 and not r.in_sample
    # 5 intervals, the last 4 decisions replayed: only the first moves experts (as many each way)
    first = replaced(_load(tmp_path / "pair2", lambda k: torch.tensor([10.0, 10, 1, 1, 1, 1, 1, 1]), steps=16),
                     2, 8, 0)
    assert first.decisions == 1 and first.replacement.moved >= 1 and first.replacement.changed == 1
    assert r.replacement == Replacement(every=8, moved=first.replacement.moved / 4, changed=0.25, copies=0.0)
    # one expert above a rank's share: no permutation helps, a copy does (and is refreshed each step)
    one_hot = _load(tmp_path / "one", lambda k: torch.tensor([30.0, 1, 1, 1, 1, 1, 1, 1]))
    assert replaced(one_hot, 2, 8, 0).imbalance == pytest.approx(33 / 18.5)
    copies = replaced(one_hot, 2, 8, 1)
    # expert 0 halved onto rank 1 (19 against 18), then a light expert of rank 1 halved onto rank 0: each rank
    # holds one copy and gives one, refreshed and handed back every step
    assert copies.imbalance == pytest.approx(1.0) and copies.replacement.copies == 1.0
    # the hot expert changes every interval: a placement meets load it was not made for
    moving = _load(tmp_path / "moving", lambda k: torch.tensor([30.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]).roll(4 * (k % 2)))
    assert replaced(moving, 2, 8, 1).imbalance > 1.5
    # a run that logged one interval is placed on the load it is held against, and says so
    once = _load(tmp_path / "once", lambda k: torch.tensor([30.0, 1, 1, 1, 1, 1, 1, 1]), steps=8)
    r = replaced(once, 2, 8, 1)
    assert r.in_sample and r.decisions == 1 and "optimistic" in r.source(8, 1)


def test_a_decision_is_applied_where_the_step_model_says_it_pays(tmp_path):
    """The Replacer's auto policy in the planner: a placement that saves less step time over the interval than
    its moves cost is kept (no move, no traffic); a skew worth moving for is placed."""
    from moe_trainer.plan.replacement import paying
    from moe_trainer.plan.search import layout_mechanisms
    cfg = load_config(str(ROOT / "configs" / "moe_1b_16gpu.yaml"), [])
    s = setup_from_config(cfg, 16, gpus_per_node=8)
    # compiled, as the trainer runs this layout on CUDA (eager, its step would wait on the host's launches
    # and no balance would pay)
    pays = paying(s, gpu_named("h100"), Efficiency(), layout_mechanisms(cfg, Mechanisms()))
    gen = torch.Generator().manual_seed(0)
    noise = _load(tmp_path / "noise", lambda k: 1000 + torch.rand(24, generator=gen, dtype=torch.float64))
    kept = replaced(noise, 8, 8, 0, pays)
    assert kept.applied == 0 and kept.replacement == Replacement(every=8, moved=0.0, changed=0.0, copies=0.0)
    assert kept.imbalance == pytest.approx(natural_imbalance(noise, 8), rel=1e-3)
    assert replaced(noise, 8, 8, 0).applied == 4  # without the rule every decision moves
    skew = _load(tmp_path / "skew", lambda k: torch.arange(24, dtype=torch.float64) ** 2 + 1)
    placed = replaced(skew, 8, 8, 0, pays)
    assert placed.applied >= 1 and placed.imbalance < natural_imbalance(skew, 8) and placed.replacement.moved > 0


def test_the_planners_placement_is_an_upper_bound_of_the_replacers():
    """The planner places with EPLB's greedy, the trainer with rebalance_experts (never worse per layer)."""
    gen = torch.Generator().manual_seed(0)
    load = torch.distributions.Gamma(0.7, 1.0).sample((6, 64)) * 1000 + torch.rand(6, 64, generator=gen)
    rows = [home_row(64)] * 6
    for ep in (4, 16):
        ours, _ = replan(load, rows, ep, 0, eplb_reference)
        trainer, _ = replan(load, rows, ep, 0, rebalance_experts)
        for i in range(6):
            assert rank_loads(load[i], trainer[i], ep).max() <= rank_loads(load[i], ours[i], ep).max() + 1e-9


def test_replacement_seconds_are_its_bytes_over_the_links():
    cfg = load_config(str(ROOT / "configs" / "moe_1b_16gpu.yaml"), [])
    s = setup_from_config(cfg, 16, gpus_per_node=8)
    gpu, eff = gpu_named("h100"), Efficiency()
    m = cfg.model
    numel = 3 * m.hidden_size * m.moe_intermediate_size
    n_moe = sum(1 for i in range(m.first_k_dense_replace, m.num_hidden_layers) if i < sum(s.partition[:1]))
    copies = replacement_seconds(s, 0, gpu, eff, Replacement(every=8, moved=0.0, changed=0.0, copies=2.0))
    # two all-to-alls (refresh, gradients back) of 2 expert rows in bf16 per MoE layer, inside the node
    one = 2 * numel * 2 / (gpu.nvlink_gbs * eff.a2a * 1e9) + eff.a2a_latency_us * 1e-6
    assert s.ep <= 8 and copies == {"moves": 0.0, "copies": pytest.approx(n_moe * 2 * one)}
    # moves: fp32 rows and moments per decision, the layer's optimizer state gathered over edp, shared by `every`
    moves = [replacement_seconds(s, 0, gpu, eff, Replacement(every=e, moved=1.0, changed=1.0, copies=0.0))["moves"]
             for e in (8, 16)]
    assert moves[0] == pytest.approx(2 * moves[1]) and moves[0] > 0
    no_edp = setup_from_config(cfg, s.ep * s.pp, gpus_per_node=8)
    assert no_edp.edp == 1
    alone = replacement_seconds(no_edp, 0, gpu, eff, Replacement(every=1, moved=1.0, changed=1.0, copies=0.0))["moves"]
    assert alone == pytest.approx(n_moe * (numel * 16 / (gpu.nvlink_gbs * eff.a2a * 1e9) + eff.a2a_latency_us * 1e-6))
    # the step charges it, exposed, beside the re-placed share
    rep = Replacement(every=8, moved=1.0, changed=0.5, copies=1.0)
    plain, with_rep = step_time(s, gpu, eff, Mechanisms(), 1.1), step_time(s, gpu, eff, Mechanisms(), 1.1, rep)
    charged = sum(replacement_seconds(s, with_rep.stage, gpu, eff, rep).values())
    assert with_rep.split["replacement"] == pytest.approx(charged) and charged > 0
    assert with_rep.step == pytest.approx(plain.step + charged)


def test_the_search_meets_the_load_at_each_ep(tmp_path):
    load = _load(tmp_path, lambda k: torch.arange(24, dtype=torch.float64) ** 2 + 1)  # moe_1b's 24 experts
    cfg = load_config(str(ROOT / "configs" / "moe_1b_16gpu.yaml"), [])
    best, _, _ = search(cfg, 16, gpu_named("h100"), Efficiency(), Mechanisms(), 80.0, top=300, load=load)
    assert len({c.setup.ep for c in best}) > 2
    for c in best:
        assert c.time.imbalance == pytest.approx(natural_imbalance(load, c.setup.ep))
        assert c.time.split["replacement"] == 0
    placed = load_config(str(ROOT / "configs" / "moe_1b_16gpu.yaml"), ["parallel.replace_every=8"])
    best, _, _ = search(placed, 16, gpu_named("h100"), Efficiency(), Mechanisms(), 80.0, top=300, load=load)
    at_ep: dict = {}
    for c in best:  # one replay per ep, never above the load at home
        assert at_ep.setdefault(c.setup.ep, c.time.imbalance) == c.time.imbalance
        assert c.time.imbalance <= natural_imbalance(load, c.setup.ep) + 1e-9
    moved = [c for c in best if c.time.imbalance < natural_imbalance(load, c.setup.ep) - 0.1]
    assert moved and all(c.time.split["replacement"] > 0 for c in moved)


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_cli_time_shows_the_replaced_column(tmp_path):
    _load(tmp_path / "run", lambda k: torch.tensor([60.0] + [1.0] * 23))  # moe_1b's 24 experts, one hot
    sets = ["--set", "parallel.replace_every=8", "--set", "parallel.redundant_slots=1"]
    out = _cli("--config", "configs/moe_1b_16gpu.yaml", "--gpus", "16", "--time", "--load", str(tmp_path / "run"),
               *sets, "--json", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    assert "re-placed (imbalance" in out.stdout and "exposed expert re-placement" in out.stdout
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["replaced"]["imbalance"] < data["natural"]["imbalance"]
    assert data["replaced"]["replacement"]["copies"] >= 1 and "re-placed every 8 steps" in data["replaced"]["source"]
    hint = _cli("--config", "configs/moe_1b_16gpu.yaml", "--gpus", "16", "--time", *sets)
    assert hint.returncode == 0 and "give --load RUN_DIR" in hint.stdout and "re-placed (" not in hint.stdout
    bad = _cli("--config", "configs/moe_1b_16gpu.yaml", "--gpus", "16", "--time", "--load", str(tmp_path / "none"),
               *sets)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not a run directory" in bad.stderr


def test_the_cpu_prediction_of_the_replace_bench(tmp_path):
    """bench.replace --predict: each configuration at the share the planner replays from the off run's load,
    on this machine's measured rates; only the copies pay the copies' traffic."""
    from moe_trainer.bench.replace import predict
    load = _load(tmp_path, lambda k: torch.tensor([60.0] + [1.0] * 15), steps=24)
    p = predict(2, tmp_path, 8, 1, 1, ())
    off, on, copies = p["off"], p["on"], p["copies"]
    assert off["share"] == pytest.approx(natural_imbalance(load, 2))
    assert copies["share"] < on["share"] <= off["share"] + 1e-9
    assert copies["step_s"] < off["step_s"] and copies["copies_s"] > 0 == on["copies_s"] == off["copies_s"]
    assert on["moves_s"] >= 0 and off["moves_s"] == 0
    x = p["experts"]
    assert x["share"] == pytest.approx(off["share"], rel=0.05) and x["even_s"] > 0 and x["busiest_s"] > 0

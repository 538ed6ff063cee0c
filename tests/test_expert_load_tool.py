"""tools/expert_load.py and moe_trainer.expert_load: format, statistics, report, plan, errors."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_trainer import expert_load as el
from moe_trainer.moe import placement as pl

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "expert_load.py"


def run_tool(*args, cwd=None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a fresh interpreter, the script path, no PYTHONPATH."""
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd or ROOT)


def table(md: str, title: str) -> dict[str, list[float]]:
    """Rows of the markdown table under '## title': first cell -> numbers."""
    section = md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {r[0].strip(): [float(x) for x in r[1:]] for r in rows if r[0].strip() != "layer"}


# counts per step, [2 MoE layers (global ids 1 and 3), 4 experts]
STEPS = {
    10: [[10, 10, 10, 10], [40, 0, 0, 0]],
    20: [[20, 20, 0, 0], [10, 10, 10, 10]],
    30: [[30, 10, 0, 0], [0, 0, 0, 40]],
}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    for step, counts in STEPS.items():
        el.write_expert_load(run, step, torch.tensor(counts, dtype=torch.float32),
                             bias=torch.full((2, 4), 0.01 * step), layer_ids=[1, 3])
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 100}) + "\n"
                                               for s in range(1, 31)))
    return run


def test_imbalance_stats_hand_computed():
    s = el.imbalance_stats(torch.tensor([[10.0, 10, 10, 10], [40, 0, 0, 0]]))
    assert s["max_over_mean"].tolist() == pytest.approx([1.0, 4.0])
    assert s["cv"].tolist() == pytest.approx([0.0, math.sqrt(3)])
    assert s["frac_below_10pct"].tolist() == pytest.approx([0.0, 0.75])
    empty = el.imbalance_stats(torch.zeros(1, 8))  # no tokens: balanced, not NaN
    assert [empty[k].item() for k in ("max_over_mean", "cv", "frac_below_10pct")] == [1.0, 0.0, 0.0]
    batched = el.imbalance_stats(torch.ones(3, 2, 5))
    assert batched["cv"].shape == (3, 2)


def test_write_and_read_round_trip(tmp_path):
    counts = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    bias = torch.randn(3, 4)
    path = el.write_expert_load(tmp_path, 7, counts, bias=bias, layer_ids=[1, 2, 5])
    assert path == tmp_path / "expert_load" / "step_00000007.safetensors"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    rec = el.read_expert_load(path)
    assert rec.step == 7 and rec.layer_ids == [1, 2, 5]
    assert rec.counts.dtype == torch.float32 and torch.equal(rec.counts, counts.float())
    assert torch.equal(rec.bias, bias)
    rec = el.read_expert_load(el.write_expert_load(tmp_path, 8, counts.float()))  # bias, ids optional
    assert rec.bias is None and rec.layer_ids == [0, 1, 2]
    with pytest.raises(el.ExpertLoadError, match="layer_ids has 2 entries"):
        el.write_expert_load(tmp_path, 9, counts, layer_ids=[1, 2])


def test_report_numbers_and_plots(run_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_tool(run_dir, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    md = (out / "expert_load.md").read_text()
    assert "steps 10 to 30" in md and "step 10: 2.9000" in md
    # columns: step 10 (first), step 20 (middle), step 30 (last), overall (sum of the three)
    # overall: layer 1 [60, 40, 10, 10] (mean 30), layer 3 [50, 10, 10, 50] (mean 30)
    mm = table(md, "max/mean")
    assert mm["1"] == pytest.approx([1.0, 2.0, 3.0, 2.0], abs=1e-3)
    assert mm["3"] == pytest.approx([4.0, 1.0, 4.0, 5 / 3], abs=1e-3)
    cv = table(md, "coefficient of variation")
    assert cv["1"] == pytest.approx([0.0, 1.0, math.sqrt(1.5), math.sqrt(0.5)], abs=1e-3)
    assert cv["3"] == pytest.approx([math.sqrt(3), 0.0, math.sqrt(3), 2 / 3], abs=1e-3)
    below = table(md, "share of experts below 10% of the mean load")
    assert below["1"] == pytest.approx([0.0, 0.5, 0.5, 0.0], abs=1e-3)
    assert below["3"] == pytest.approx([0.75, 0.0, 0.75, 0.0], abs=1e-3)
    for png in ("expert_load_heatmap_step_00000030.png", "expert_load_max_over_mean.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png})" in md


def test_chosen_step_and_run_in_progress(run_dir, tmp_path, capsys):
    newest = run_dir / "expert_load" / "step_00000040.safetensors"
    data = (run_dir / "expert_load" / "step_00000030.safetensors").read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a writer that died half-way
    assert el.main([str(run_dir), "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "step_00000040.safetensors is unreadable" in err and "Traceback" not in err
    md = (tmp_path / "a" / "expert_load.md").read_text()
    assert "steps 10 to 30" in md and "1 unreadable or inconsistent file(s) skipped" in md
    assert (tmp_path / "a" / "expert_load_heatmap_step_00000030.png").exists()
    assert el.main([str(run_dir), "--out", str(tmp_path / "b"), "--step", "20"]) == 0
    assert (tmp_path / "b" / "expert_load_heatmap_step_00000020.png").exists()


def test_bad_inputs_exit_with_one_sentence(run_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    for args, words in [
        ((tmp_path / "missing", "--out", tmp_path / "o"), "does not exist"),
        ((tmp_path / "empty", "--out", tmp_path / "o"), "has no expert-load files"),
        ((run_dir, "--out", tmp_path / "o", "--step", 25), "Step 25 is not logged"),
    ]:
        proc = run_tool(*args)
        assert proc.returncode == 1, proc
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert not (tmp_path / "o" / "expert_load.md").exists()


def test_plan_from_load_file(tmp_path):
    g = torch.Generator().manual_seed(3)
    load = (torch.rand(3, 16, generator=g) ** 4 * 1000).round()
    save_file({"load": load}, str(tmp_path / "load.safetensors"))
    plan_path = tmp_path / "plans" / "plan.json"
    proc = run_tool("plan", "--load", tmp_path / "load.safetensors", "--replicas", 20, "--groups", 4,
                    "--nodes", 2, "--gpus", 4, "--out", plan_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(plan_path.read_text())
    phy2log = torch.tensor(plan["phy2log"])
    assert phy2log.shape == (3, 20) and plan["layout"]["policy"] == "hierarchical"
    assert all(set(row) == set(range(16)) for row in plan["phy2log"])
    mom = torch.tensor(plan["max_over_mean"], dtype=torch.float64)
    assert torch.allclose(mom, pl.max_over_mean(load, phy2log, 4), atol=1e-5)
    assert (mom <= torch.tensor(plan["eplb_max_over_mean"]) + 1e-6).all()
    assert (torch.tensor(plan["lower_bound"]) <= mom + 1e-6).all()
    assert "lower bound" in proc.stdout


def test_plan_from_run_dir_uses_the_newest_files(run_dir, tmp_path):
    assert el.main(["plan", "--load", str(run_dir), "--last", "2", "--replicas", "6", "--gpus", "2",
                    "--out", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    newest_two = torch.tensor(STEPS[20]) + torch.tensor(STEPS[30])
    assert plan["layer_ids"] == [1, 3]
    want = el.make_plan(newest_two.double(), 6, 1, 1, 2)
    assert plan["max_over_mean"] == want["max_over_mean"] and plan["phy2log"] == want["phy2log"]


def test_plan_bad_inputs(tmp_path, capsys):
    save_file({"other": torch.ones(2, 8)}, str(tmp_path / "x.safetensors"))
    save_file({"load": torch.ones(2, 8)}, str(tmp_path / "ok.safetensors"))
    for args, words in [
        (["--load", str(tmp_path / "x.safetensors"), "--replicas", "8", "--gpus", "2"], "has no tensor 'load'"),
        (["--load", str(tmp_path / "nope.safetensors"), "--replicas", "8", "--gpus", "2"], "does not exist"),
        (["--load", str(tmp_path / "ok.safetensors"), "--replicas", "9", "--gpus", "2"], "must divide replicas"),
        (["--load", str(tmp_path / "ok.safetensors"), "--replicas", "6", "--gpus", "2"], "at least the number"),
    ]:
        assert el.main(["plan", *args, "--out", str(tmp_path / "p.json")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "p.json").exists()


def test_help(capsys):
    proc = run_tool("--help")
    assert proc.returncode == 0 and "expert_load.py RUN_DIR --out DIR" in proc.stdout and "plan" in proc.stdout
    with pytest.raises(SystemExit) as exit_info:
        el.main(["plan", "--help"])
    assert exit_info.value.code == 0 and "--replicas" in capsys.readouterr().out

"""The headline driver (moe_trainer/bench/headline.py) and bench_all's table: every job runs alone
(no two jobs' processes alive at once), rounds alternate which job goes first, the medians and
spreads are those of the reports, and the table between the markers is rewritten in place."""
import json
import sys
from pathlib import Path

import pytest

from moe_trainer.bench import bench_all, headline
from moe_trainer.bench.turns import worker_env

ROOT = Path(__file__).resolve().parents[1]

# reports step i as taking (1 + i) * scale seconds, then closes with its token count
JOB = r'''
import sys
from moe_trainer.bench.turns import Turns
spec, scale, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
turns = Turns(spec)
for i in range(steps):
    turns.wait()
    turns.report({"step_s": (1 + i) * scale, "forward": scale, "backward": scale})
turns.close({"tokens_per_step": 100})
'''


def test_summaries_are_medians_and_spreads():
    reports = [{"step_s": s, "forward": 1.0} for s in (9.0, 2.0, 4.0, 3.0)]
    one = headline.round_summary(reports, warmup=1)
    assert one["median_s"] == 3.0 and one["steps"] == 3 and one["forward"] == 1.0
    rounds = [{"median_s": 3.0, "forward": 1.0}, {"median_s": 2.0, "forward": 1.0}, {"median_s": 5.0, "forward": 2.0}]
    job = headline.over_rounds(rounds, tokens_per_step=60)
    assert (job["median_s"], job["fastest_s"], job["slowest_s"], job["tok_s"]) == (3.0, 2.0, 5.0, 20.0)
    assert job["split"] == {"forward": 1.0}
    peer = headline.over_rounds([{"median_s": 6.0}, {"median_s": 4.0}, {"median_s": 8.0}], 60)
    assert headline.ratio(job, peer) == {"ratio": 2.0, "low": 4.0 / 5.0, "high": 8.0 / 2.0}
    with pytest.raises(ValueError):
        headline.round_summary(reports, warmup=4)


def test_jobs_run_alone_in_alternating_rounds(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    order, alive = [], []

    def factory(name: str, scale: float):
        def make(turns: str):
            order.append(name)
            return [sys.executable, str(script), turns, str(scale), "3"], worker_env(1, ROOT)
        return make

    real = headline.Referee

    class Watching(real):  # a job is only started while no other job's process is alive
        def start(self, name, cmd, env=None, cwd=None):
            assert not alive, alive
            super().start(name, cmd, env, cwd)
            alive.append(self.jobs[name].proc)

        def close(self):
            super().close()
            alive.clear()

    monkeypatch.setattr(headline, "Referee", Watching)
    out = headline.run_alone({"ours": factory("ours", 0.01), "peer": factory("peer", 0.02)}, steps=3, warmup=1,
                             rounds=2, cwd=ROOT, log=None)
    assert order == ["ours", "peer", "peer", "ours"]
    assert out["ours"]["median_s"] == pytest.approx(0.025) and out["peer"]["median_s"] == pytest.approx(0.05)
    assert out["ours"]["tok_s"] == pytest.approx(4000) and out["ours"]["split"] == {"forward": 0.01,
                                                                                   "backward": 0.01}
    assert headline.ratio(out["ours"], out["peer"])["ratio"] == pytest.approx(2.0)


def test_bench_all_rewrites_only_its_table(tmp_path):
    job = {"median_s": 2.0, "fastest_s": 1.5, "slowest_s": 2.5, "tok_s": 50.0, "tokens_per_step": 100,
           "split": {"forward": 0.5, "backward": 1.0, "optimizer": 0.2}}
    slower = {"median_s": 4.0, "fastest_s": 3.0, "slowest_s": 5.0, "tok_s": 25.0, "tokens_per_step": 100}
    train = {"command": "scripts/bench_train.sh --mode alone", "date": "2026-12-02 03:00",
             "bf16": {"jobs": {"ours1": job, "hfk": slower, "hf": slower},
                      "peer": "eager+grouped_mm", "same_allocator": {"ratio": 2.0, "low": 1.5, "high": 2.5},
                      "stock": {"ratio": 2.5, "low": 2.0, "high": 3.0}}}
    rows = bench_all.table_rows(train, None)
    assert len(rows) == 1 and "**2.00x** (1.50-2.50)" in rows[0] and "eager+grouped_mm" in rows[0][0]
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# title\n\nbefore\n\n{bench_all.BEGIN}\nold table\n{bench_all.END}\n\nafter 1.69x\n")
    bench_all.rewrite_doc(doc, bench_all.render(rows, smoke=False))
    text = doc.read_text()
    assert "old table" not in text and "**2.00x**" in text and "scripts/bench_train.sh --mode alone" in text
    assert text.startswith("# title\n\nbefore\n") and text.endswith("after 1.69x\n")
    bench_all.plots(train, None, tmp_path)
    assert (tmp_path / "train_tokens_per_s.png").stat().st_size > 5_000
    assert (tmp_path / "train_split.png").stat().st_size > 5_000
    json.dumps(train)  # what bench_all reads back is plain JSON


def test_every_bench_module_finds_the_checkout():
    """The bench modules that start jobs find configs/ and tools/ from their own path (scale.py's
    once pointed at the package folder after the move into moe_trainer/bench, and every run failed)."""
    import importlib
    import pkgutil
    import moe_trainer.bench as bench
    roots = {}
    for info in pkgutil.iter_modules(bench.__path__):
        module = importlib.import_module(f"moe_trainer.bench.{info.name}")
        if hasattr(module, "ROOT"):
            roots[info.name] = Path(module.ROOT)
    assert {"scale", "train", "ep"} <= set(roots)
    assert all(r == ROOT and (r / "configs" / "moe_tiny.yaml").is_file() for r in roots.values()), roots


def test_code_comparison_alternates_trees_and_reports_after_over_before(tmp_path, monkeypatch):
    """bench/codes.py: a warm-up run per tree, then rounds alternating which tree goes first; the
    ratio is the baseline's median step over the new tree's (faster = above 1); a --code-set override
    reaches only its tree's measured runs."""
    from moe_trainer.bench import codes
    calls = []
    step = {"old": 2.0, "new": 1.0}

    def fake_run(tree, job, steps, out, threads, extra=()):
        calls.append((tree.name, steps, *extra))
        return [9.0] * 2 + [step[tree.name]] * (steps - 2), 100.0
    monkeypatch.setattr(codes, "run_job", fake_run)
    trees = {"before": tmp_path / "old", "after": tmp_path / "new"}
    res = codes.compare(trees, ["ep2"], steps=5, warmup=2, rounds=3, threads=2, log=None,
                        code_sets={"after": ["parallel.overlap=a2a"]})
    new = ("new", 5, "parallel.overlap=a2a")
    assert calls == [("old", 1), ("new", 1), ("old", 5), new, new, ("old", 5), ("old", 5), new]
    assert res["ep2"]["ratio"] == {"ratio": 2.0, "low": 2.0, "high": 2.0}
    assert res["ep2"]["after"]["tok_s"] == 100.0 and res["ep2"]["before"]["tok_s"] == 50.0
    assert "**2.00x**" in codes.table(res, list(trees))

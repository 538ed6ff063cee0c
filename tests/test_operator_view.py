"""What an operator sees, as a new user meets it: a start over in a run directory keeps what the
directory recorded, a finished run says so before any launcher starts, the console reports interval
means and checkpoint lines while DeepSpeed's INFO lines go to the run directory's log, and the build
cache of DeepSpeed's ops belongs to the environment."""
import re
import sys

from moe_trainer.metrics import Interval
from moe_trainer.train import keep_build_cache_per_environment, use_this_environments_ninja

from conftest import TINY, check, launch, read_metrics

RUN = TINY + ["train.max_steps=3", "train.checkpoint_every=3", "train.resume=auto", "train.log_every=3"]


def test_interval_means_are_the_means_of_the_steps_since_the_last_log_step():
    interval = Interval()
    for seconds in (3.0, 1.0, 2.0):
        interval.add({"step_time_s": seconds, "time.data_s": seconds / 4})
    assert interval.take() == (3, {"step_time_s": 2.0, "time.data_s": 0.5})
    interval.add({"step_time_s": 5.0})
    assert interval.take() == (1, {"step_time_s": 5.0})  # a new interval began


def test_the_op_build_cache_is_kept_per_environment(monkeypatch):
    monkeypatch.setattr(sys, "prefix", "/opt/venv")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    environ = {}
    keep_build_cache_per_environment(environ)
    assert environ == {"TORCH_EXTENSIONS_DIR": "/opt/venv/torch_extensions"}
    mine = {"TORCH_EXTENSIONS_DIR": "/scratch/ext"}
    keep_build_cache_per_environment(mine)
    assert mine == {"TORCH_EXTENSIONS_DIR": "/scratch/ext"}  # the user's choice stands
    monkeypatch.setattr(sys, "prefix", "/usr")  # no virtual environment: torch's default
    none = {}
    keep_build_cache_per_environment(none)
    assert none == {}


def test_the_environments_own_ninja_goes_first_on_path(tmp_path):
    (tmp_path / "bin").mkdir()
    python = str(tmp_path / "bin" / "python")
    environ = {"PATH": "/usr/bin:/bin"}
    use_this_environments_ninja(environ, python)
    assert environ == {"PATH": "/usr/bin:/bin"}  # no ninja beside this python: PATH as it was
    (tmp_path / "bin" / "ninja").touch()
    use_this_environments_ninja(environ, python)
    assert environ["PATH"] == f"{tmp_path / 'bin'}:/usr/bin:/bin"
    use_this_environments_ninja(environ, python)
    assert environ["PATH"] == f"{tmp_path / 'bin'}:/usr/bin:/bin"  # once, not again and again


def test_a_finished_run_has_nothing_left_and_a_start_over_keeps_the_earlier_records(tmp_path):
    """One run through scripts/train.sh's entry (the restart wrapper around the deepspeed command);
    then the same command again (finished); then again with its only checkpoint damaged."""
    out = tmp_path / "run"
    first = check(launch(1, out, RUN, launcher="deepspeed-cli", max_restarts=0))
    # the console: interval means over the 3 steps of the log interval, the last step's beside them
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert [(r["step"], r["interval_steps"]) for r in rows] == [(3, 3)]
    r = rows[0]
    assert abs(r["tokens_per_s"] - 256 / r["step_time_s"]) < 1e-6 * r["tokens_per_s"]
    assert abs(r["tokens_per_s_last"] - 256 / r["step_time_last_s"]) < 1e-6 * r["tokens_per_s_last"]
    assert re.search(r"step 3/3 \| .* tok/s \| MFU .* s/step \(data [\d.]+, fwd [\d.]+, bwd [\d.]+, opt [\d.]+\) "
                     r"\| means of 3 steps", first.stdout)
    assert re.search(r"checkpoint step 3: \S+/checkpoints/step_3 \([\d.,]+ MB in \d+ files, [\d.]+ s\)", first.stdout)
    # DeepSpeed's INFO lines (launcher and rank) in the run directory's log, not on the console
    assert "[INFO]" not in first.stdout and "[INFO] [launch.py" in (out / "deepspeed.log").read_text()

    again = check(launch(1, out, RUN, launcher="deepspeed-cli", max_restarts=0))
    assert "nothing left to do" in again.stdout and "already reached step 3" in again.stdout
    assert "starting deepspeed" not in again.stdout  # said before the launcher
    assert len((out / "config_history.jsonl").read_text().splitlines()) == 1  # no start recorded

    (out / "checkpoints" / "step_3" / "part-r00000.safetensors").unlink()
    over = check(launch(1, out, RUN, launcher="deepspeed-cli", max_restarts=0))
    assert over.stderr.count("skipping checkpoint") == 1, over.stderr
    kept = [p for p in (out / "previous").iterdir()]
    assert len(kept) == 1 and f"earlier records kept in {kept[0]}" in over.stdout
    assert [r["step"] for r in read_metrics(kept[0]) if "loss" in r] == [3]  # the first run's metrics
    assert (kept[0] / "checkpoints" / "step_3" / "manifest.json").is_file()  # the damaged one, as it was
    assert len(list((kept[0] / "tensorboard").iterdir())) == 1  # the first run's events, apart
    assert len(list((out / "tensorboard").iterdir())) == 1
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [3]

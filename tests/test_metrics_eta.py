"""The console line's ETA: none until two log steps give an interval to time (the first line
showed 'ETA 0.0 min'), then the time per step so far times the steps left."""
from moe_trainer import metrics
from moe_trainer.metrics import MetricSink


def test_no_eta_on_the_first_line_then_time_per_step_times_steps_left(tmp_path, capsys, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics.time, "time", lambda: now[0])
    sink = MetricSink(tmp_path, tensorboard=False, max_steps=100, resume_step=0)
    sink.progress(10, {"loss": 2.0})  # a resumed run's first log step: nothing timed yet
    now[0] += 60.0
    sink.progress(20, {"loss": 1.5})  # 10 steps in 60 s: 80 left take 8 min
    sink.close()
    first, second = capsys.readouterr().out.splitlines()
    assert first == "step 10/100 | loss 2.0000"
    assert second == "step 20/100 | loss 1.5000 | ETA 8.0 min"

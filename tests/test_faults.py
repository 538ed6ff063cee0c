"""Faults that do not kill a process, injected on purpose (debug.faults) and survived (faults.py):
a bit flipped in one replica is found and repaired before the next forward, so the run goes on
exactly as a clean one; a diverging step rolls back to the checkpoint before it and skips its
batches; a slow rank is named; each fault fires once per run directory."""
import json

import pytest
import torch

from moe_trainer.config import ConfigError
from moe_trainer.resolve import load_config
from moe_trainer.faults import (Fault, FaultSpecError, Faults, SpikeGuard, checksums, parse_faults,
                                straggler_events)

from conftest import TINY, check, launch, read_metrics, train_losses

BASE = TINY + ["train.max_steps=6"]


def test_fault_specs_parse_or_give_one_sentence():
    assert parse_faults(["bitflip@3:1", "spike@9", "slow@2", "bitflip_master@4:1"]) == [
        Fault("bitflip", 3, 1), Fault("spike", 9, None), Fault("slow", 2, 0), Fault("bitflip_master", 4, 1)]
    for bad, words in (("flip@3", "KIND@STEP"), ("spike@9:1", "whole step"), ("kill@0:1", "count from 1"),
                       ("kill@2:5", "rank 5")):
        with pytest.raises(FaultSpecError, match=words):
            parse_faults([bad], world=2)
    with pytest.raises(ConfigError, match="debug.faults entry"):
        load_config("configs/moe_tiny.yaml", ["debug.faults=[bitflip@x]"])


def test_each_fault_fires_once_per_run_directory(tmp_path):
    plan = parse_faults(["spike@2", "nan@3"])
    first = Faults(plan, tmp_path, rank=0)
    assert first.lr_factor(1) == 1.0 and first.lr_factor(2) == 1000.0 and first.lr_factor(2) == 1.0
    assert first.poison(3) and not first.poison(3)
    again = Faults(plan, tmp_path, rank=0)  # a restart (or a rollback's replay) in the same directory
    assert again.lr_factor(2) == 1.0 and not again.poison(3)
    assert [json.loads(x)["fault"] for x in (tmp_path / Faults.RECORD).read_text().splitlines()] == ["spike@2", "nan@3"]


def test_checksums_see_one_flipped_bit_and_nothing_else():
    w = [torch.randn(64, 8), torch.randn(5).to(torch.bfloat16)]
    ref = checksums(w)
    assert torch.equal(checksums([x.clone() for x in w]), ref)
    w[1].view(torch.int16)[3] ^= 1 << 14
    got = checksums(w)
    assert got[0] == ref[0] and got[1] != ref[1]


def test_spike_guard_flags_a_jump_over_its_history_and_keeps_it_out():
    g = SpikeGuard()
    for loss in (5.0, 4.0, 3.5, 3.2, 3.0, 2.9, 2.8, 2.8):  # a falling loss is never a spike
        assert g.check(loss, 1.0) is None
    assert "loss 9" in g.check(9.0, 1.0)
    assert g.check(2.7, 1.0) is None  # the spike did not enter the history
    assert "gradient norm" in g.check(2.7, 50.0)


def test_straggler_events_name_ranks_far_above_the_median():
    assert straggler_events([1.0, 1.0, 1.0, 1.6], 7, 1.5) == [{"event": "straggler", "rank": 3, "step": 7,
                                                                "ratio": 1.6}]
    assert straggler_events([1.0, 1.2], 7, 1.5) == []


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The run without faults, on 2 ranks (dp 2)."""
    out = tmp_path_factory.mktemp("clean")
    check(launch(2, out, BASE))
    return out


def test_bitflip_on_one_replica_is_repaired_before_the_next_forward_and_the_run_equals_a_clean_one(clean, tmp_path):
    flipped, unchecked = tmp_path / "flip", tmp_path / "unchecked"
    check(launch(2, flipped, BASE + ["train.replica_check_every=1", "debug.faults=[bitflip@3:1,slow@2:1]"]))
    check(launch(2, unchecked, BASE + ["train.replica_check_every=0", "debug.faults=[bitflip@3:1]"]))
    a, b, c = train_losses(clean), train_losses(flipped), train_losses(unchecked)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # exactly: the copy was repaired
    assert any(c[s] != a[s] for s in (4, 5, 6))  # without the check the flip trains on
    events = [r for r in read_metrics(flipped) if r.get("event") == "replica_mismatch"]
    assert len(events) == 1 and events[0]["step"] == 3 and events[0]["ranks"] == [1]
    assert events[0]["action"] == "repaired" and len(events[0]["params"]) == 1
    slow = [r for r in read_metrics(flipped) if r.get("event") == "straggler"]
    assert min(r["step"] for r in slow) >= 2  # the first logged step (one-time costs) is not judged
    assert len([r for r in slow if r["rank"] == 1]) >= 4  # rank 1, slow from step 2, named at most steps
    assert len([r for r in slow if r["rank"] == 0]) <= 1  # noise on a loaded machine, at most once


def test_a_flipped_bit_in_an_owners_master_partition_rolls_back_and_the_run_equals_a_clean_one(clean, tmp_path):
    """bitflip_master@3:1: rank 1's ZeRO-1 fp32 partition is corrupt after step 3's update while both
    model copies agree; the check before step 4 sees it differ from the copy it wrote, and the run
    goes back to step 2's checkpoint (step 3's was written after the flip) and trains 3-6 again."""
    out = tmp_path / "master"
    proc = check(launch(2, out, BASE + ["train.replica_check_every=1", "train.checkpoint_every=1",
                                        "train.keep_checkpoints=3", "debug.faults=[bitflip_master@3:1]"]))
    assert "master partition of rank(s) [1] differs" in proc.stderr
    rows = read_metrics(out)
    rollback = [r for r in rows if r.get("event") == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 3 and rollback[0]["to"] == 2
    assert rollback[0]["ranks"] == [1] and rollback[0]["cause"] == "owner_partition"
    assert not [r for r in rows if r.get("event") == "replica_mismatch"]  # not taken for a replica's fault
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 3, 4, 5, 6]  # step 3 trained again
    assert train_losses(out) == train_losses(clean)  # exactly: replayed from a good state, same batches


def test_a_spike_rolls_back_to_the_checkpoint_before_it_and_skips_its_batches(tmp_path):
    # the final validation loss (fixed batches) compares the models; a training batch of 256 tokens
    # moves the last step's loss by a few percent whichever batches came before
    run = BASE[:-1] + ["train.max_steps=14", "train.checkpoint_every=2", "train.keep_checkpoints=3",
                       "train.eval_every=14", "train.eval_batches=4"]
    clean, spiked = tmp_path / "clean", tmp_path / "spiked"
    check(launch(1, clean, run, launcher="python"))
    out = check(launch(1, spiked, run + ["debug.faults=[spike@9]"], launcher="python"))
    assert "loss spike at step 10" in out.stderr
    rows = read_metrics(spiked)
    rollback = [r for r in rows if r.get("event") == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 10 and rollback[0]["to"] == 8
    assert rollback[0]["skipped_steps"] == [9, 10]
    val = [[r["val_loss"] for r in read_metrics(d) if "val_loss" in r] for d in (clean, spiked)]
    assert len(val[0]) == len(val[1]) == 1 and abs(val[1][0] - val[0][0]) / val[0][0] < 0.03
    assert train_losses(spiked)[10] < 1.5 * train_losses(clean)[10]  # step 10 trained again, on later batches
    state = json.loads((spiked / "checkpoints" / "step_14" / "state.json").read_text())
    assert state["data_position"] == 16  # two batches skipped, and a resume keeps skipping them


def test_a_second_spike_after_a_rollback_stops_the_run_naming_the_steps_and_the_last_good_checkpoint(tmp_path):
    """spike@9 rolls back to step 8; the guard needs 8 steps of history again, and spike@16 (before a
    checkpoint from after the rollback that is older than the spike) stops the run at step 17."""
    out = tmp_path / "twice"
    proc = launch(1, out, BASE[:-1] + ["train.max_steps=20", "train.checkpoint_every=8", "train.keep_checkpoints=3",
                                       "debug.faults=[spike@9,spike@16]"], launcher="python")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "loss spike at step 10" in proc.stderr
    assert "stopped at step 17: " in proc.stderr and "again after rolling back to step 8" in proc.stderr
    assert f"the last good state is {out / 'checkpoints' / 'step_8'}." in proc.stderr
    assert [r["to"] for r in read_metrics(out) if r.get("event") == "rollback"] == [8]


def test_a_slow_rank_at_ep_2_is_named_not_its_expert_parallel_peer(tmp_path):
    """At ep 2 the forward's all-to-alls make rank 0 wait for slow rank 1 each step, so their time
    to the end of the forward is alike; the time outside those collectives tells them apart."""
    out = tmp_path / "slow_ep"
    check(launch(2, out, BASE[:-1] + ["train.max_steps=5", "parallel.ep=2", "debug.faults=[slow@2:1]"]))
    slow = [r for r in read_metrics(out) if r.get("event") == "straggler"]
    assert len([r for r in slow if r["rank"] == 1]) >= 3, slow  # judged at steps 2-5
    assert len([r for r in slow if r["rank"] == 0]) <= 1, slow


def test_a_killed_rank_restarts_the_job_which_resumes_and_ends_as_a_clean_run(clean, tmp_path):
    out = tmp_path / "killed"
    proc = check(launch(2, out, BASE + ["train.checkpoint_every=1", "train.resume=auto", "debug.faults=[kill@3:1]"],
                        max_restarts=1))
    assert "restarting (1 of 1)" in proc.stderr
    restarts = [r for r in read_metrics(out) if r.get("event") == "restart"]
    assert len(restarts) == 1 and restarts[0]["attempt"] == 1 and restarts[0]["step"] == 2  # resumed at step 2
    assert train_losses(out) == train_losses(clean)  # every step, exactly: the restart lost nothing
    fired = [json.loads(x)["fault"] for x in (out / Faults.RECORD).read_text().splitlines()]
    assert fired == ["kill@3:1"]  # and the restarted job did not fire it again


def test_restart_wrapper_does_not_retry_bad_input(tmp_path):
    proc = launch(1, tmp_path / "bad", BASE + ["train.lr=-1"], launcher="python", max_restarts=3)
    assert proc.returncode == 2 and "restarting" not in proc.stderr


def test_a_spike_with_no_checkpoint_before_it_is_recorded_and_training_goes_on(tmp_path):
    out = tmp_path / "nockpt"
    proc = check(launch(1, out, BASE[:-1] + ["train.max_steps=11", "debug.faults=[spike@9]"], launcher="python"))
    assert "no checkpoint from before it" in proc.stderr
    spikes = [r for r in read_metrics(out) if r.get("event") == "spike"]
    # flagged at step 10 (after step 9's update) and on while the loss stays up; the run still ends
    assert spikes and spikes[0]["step"] == 10 and max(train_losses(out)) == 11


def test_a_hung_rank_ends_the_job_within_the_timeout_naming_it(tmp_path):
    """hang@3:1: rank 1 stops without exiting; rank 0 waits in the replica check's all-gather on a
    subgroup, which parallel.timeout_s bounds too (torch gives new groups 30 minutes otherwise)."""
    import time
    t0 = time.time()
    proc = launch(2, tmp_path / "hang", BASE + ["train.replica_check_every=1", "parallel.timeout_s=10",
                                                "debug.faults=[hang@3:1]"], timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 90
    # its watch thread still answers, but its heartbeat stopped at step 3's start, before the collective
    assert "Rank(s) 1 stopped making progress (at step 3: start)" in proc.stderr


def test_spike_guard_state_round_trips_and_judges_as_the_uninterrupted_guard():
    a, b = SpikeGuard(), SpikeGuard()
    for i in range(10):
        a.check(3.0 - 0.1 * i, 1.0 + 0.01 * i)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # through state.json's JSON
    assert b.state_dict() == a.state_dict()
    assert b.check(9.0, 1.0) == a.check(9.0, 1.0) is not None
    assert b.check(2.0, 30.0) == a.check(2.0, 30.0) is not None


def test_a_resumed_run_guards_its_first_steps_as_the_uninterrupted_run_does(tmp_path):
    """The guards' state travels in state.json: a run stopped at step 9 and resumed sees spike@10 at
    step 11 and rolls back to step 9 exactly as the run that never stopped (before, the resumed guard
    had no history for 8 steps and trained on through the spike)."""
    run = BASE[:-1] + ["train.max_steps=13", "train.checkpoint_every=3", "train.keep_checkpoints=5",
                       "debug.faults=[spike@10]"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check(launch(1, straight, run, launcher="python"))
    check(launch(1, resumed, run + ["train.stop_at_step=9"], launcher="python"))
    saved = json.loads((resumed / "checkpoints" / "step_9" / "state.json").read_text())["guards"]
    assert saved == json.loads((straight / "checkpoints" / "step_9" / "state.json").read_text())["guards"]
    assert len(saved["spike_guard"]["losses"]) == 9
    proc = check(launch(1, resumed, run, launcher="python"))
    assert "loss spike at step 11" in proc.stderr
    rollbacks = [[{k: r[k] for k in ("step", "to", "skipped_steps")} for r in read_metrics(d)
                  if r.get("event") == "rollback"] for d in (straight, resumed)]
    assert rollbacks[0] == rollbacks[1] == [{"step": 11, "to": 9, "skipped_steps": [10, 11]}]
    assert train_losses(resumed) == train_losses(straight)
    final = [json.loads((d / "checkpoints" / "step_13" / "state.json").read_text()) for d in (straight, resumed)]
    assert final[0]["guards"] == final[1]["guards"] and final[0]["data_position"] == final[1]["data_position"]


def test_a_bitflip_in_a_run_shorter_than_the_check_interval_is_found_before_the_last_checkpoint(tmp_path):
    """train.replica_check_every=100 (the default) in a 6-step run: the check before the final
    checkpoint finds the bit flipped in rank 1's copy after the last update and repairs it (before,
    the run ended without a word). (A flip in a model copy before the last step is overwritten by
    the next step's ZeRO all-gather; only the check before that step's forward sees it.)"""
    out = tmp_path / "short"
    proc = check(launch(2, out, BASE + ["debug.faults=[bitflip@6:1]"]))
    events = [r for r in read_metrics(out) if r.get("event") == "replica_mismatch"]
    assert [(r["step"], r["ranks"], r["action"]) for r in events] == [(6, [1], "repaired")]
    assert "replica mismatch before step 7: rank(s) [1]" in proc.stderr

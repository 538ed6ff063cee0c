"""The fault drill of the README, run by the suite: every fault kind of debug.faults (bitflip, spike,
nan, slow, hang, kill) injected once into its own 2-rank job under the restart wrapper, detected, and
the final weights equal to a clean run's where they should be (after a bit flip, a hang, a kill and a
slow rank). --steps 14 is the shortest drill (a spike needs the guard's 8 steps of history first);
`./scripts/fault_drill.sh --faults all` runs the same at 40 steps."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, env


@pytest.mark.timeout(1800)  # 7 jobs and 2 restarts of 2 ranks: minutes on an idle 2-core machine, more when shared
def test_fault_drill_every_kind_is_detected_and_survived(tmp_path):
    out = tmp_path / "drill"
    proc = subprocess.run([sys.executable, "-m", "moe_trainer.fault_drill", "--faults", "all", "--steps", "14",
                           "--out", str(out)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = json.loads((out / "fault_drill.json").read_text())
    assert sorted(r["fault"].split("@")[0] for r in rows) == sorted(["bitflip", "spike", "nan", "slow", "hang", "kill"])
    for r in rows:
        assert r["detected"] and r["exit"] == 0 and r["final_equal_clean"] == r["expected_equal"], r

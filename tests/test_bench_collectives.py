"""Collective benchmark: pure helpers, then one real 2-rank gloo run through
torchrun and the CLI (tools/bench_collectives.py)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_trainer.bench import collectives as bc

REPO_ROOT = Path(__file__).resolve().parents[1]

ALL_OPS = {"broadcast", "all_reduce", "reduce_scatter", "all_gather", "rs_then_ag",
           "all_to_all", "all_to_all_uneven", "send_recv"}


# --- pure helpers -----------------------------------------------------------

def test_parse_and_format_bytes():
    assert bc.parse_bytes("1K") == 1024
    assert bc.parse_bytes("64M") == 64 << 20
    assert bc.parse_bytes("16mb") == 16 << 20
    assert bc.parse_bytes("4096") == 4096
    assert bc.format_bytes(16 << 20) == "16M"
    assert bc.format_bytes(1020) == "1020"


def test_message_sizes_default_ladder():
    sizes = bc.message_sizes(1 << 10, 64 << 20, 4)
    assert sizes[0] == 1 << 10 and sizes[-1] == 64 << 20 and len(sizes) == 9
    assert bc.HEADLINE_BYTES in sizes
    assert bc.message_sizes(1024, 4096, 2) == [1024, 2048, 4096]
    with pytest.raises(ValueError):
        bc.message_sizes(4096, 1024, 4)


def test_element_count_shards_evenly():
    assert bc.element_count(1024, 4, 2) == 256
    assert bc.element_count(1024, 4, 3) == 255  # rounded down to a multiple of 3
    assert bc.element_count(4, 4, 8) == 8  # at least one element per rank


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_uneven_splits_rows_send_count_and_rank0_is_hot(n):
    count = 1000 * n
    splits = bc.uneven_splits(count, n)
    assert len(splits) == n and all(len(row) == n for row in splits)
    assert all(sum(row) == count for row in splits)
    received = [sum(splits[s][d] for s in range(n)) for d in range(n)]
    assert sum(received) == n * count
    if n > 1:
        assert received[0] > max(received[1:])  # the hot rank receives more than the even share
        assert splits[0][0] == pytest.approx(bc.HOT_RANK_WEIGHT * splits[0][1], abs=1)


def test_bus_factors_match_nccl_tests():
    n = 4
    assert bc.bus_factor("all_reduce", n) == pytest.approx(1.5)
    assert bc.bus_factor("rs_then_ag", n) == pytest.approx(1.5)
    assert bc.bus_factor("all_reduce_shm", n) == pytest.approx(1.5)
    for op in ("reduce_scatter", "all_gather", "all_to_all", "all_to_all_uneven"):
        assert bc.bus_factor(op, n) == pytest.approx(0.75)
    assert bc.bus_factor("broadcast", n) == 1.0
    assert bc.bus_factor("send_recv", n) == 1.0


def test_parse_args_ignores_launcher_local_rank():
    cfg = bc.parse_args(["--local_rank=3", "--max-bytes", "64K", "--iters", "2", "--dtype", "bfloat16"])
    assert cfg.max_bytes == 64 << 10 and cfg.iters == 2 and cfg.dtype == "bfloat16"
    assert bc.parse_args(["--local-rank", "1"]).max_bytes == 64 << 20
    with pytest.raises(SystemExit):
        bc.parse_args(["--min-bytes", "1M", "--max-bytes", "1K"])


def test_write_json_atomic_leaves_only_the_file(tmp_path):
    path = tmp_path / "sub" / "out.json"
    bc.write_json_atomic(str(path), {"a": 1})
    bc.write_json_atomic(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(path.parent) == ["out.json"]


# --- two real ranks over gloo ----------------------------------------------

def test_two_ranks_over_gloo(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO_ROOT / "tools" / "bench_collectives.py"),
           "--min-bytes", "1K", "--max-bytes", "64K", "--iters", "2", "--trials", "2", "--warmup", "1",
           "--json", str(out)]
    # --standalone rendezvous picks a free port; the timeout turns a hang into a failure.
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout

    report = json.loads(out.read_text())
    assert report["meta"]["world_size"] == 2 and report["meta"]["backend"] == "gloo"
    sizes = [1 << 10, 4 << 10, 16 << 10, 64 << 10]

    checks = report["checks"]
    assert checks["passed"]
    assert [c["bytes"] for c in checks["per_size"]] == sizes
    assert all(c["rs_ag_equals_all_reduce"] and c["all_reduce_exact"] for c in checks["per_size"])

    shm = report["shm_all_reduce"]
    ops = ALL_OPS | ({"all_reduce_shm"} if shm["available"] else set())
    measured = {(r["op"], r["bytes"]): r for r in report["results"]}
    assert set(measured) == {(op, b) for op in ops for b in sizes}
    for row in measured.values():
        for key in ("time_us", "min_us", "max_us", "algbw_gbps", "busbw_gbps"):
            assert math.isfinite(row[key]) and row[key] > 0, row
        assert row["min_us"] <= row["time_us"] <= row["max_us"]

    assert set(report["rs_ag_over_all_reduce"]) == {str(b) for b in sizes}
    if shm["available"]:
        assert all(c["shm_equals_all_reduce"] for c in checks["per_size"])
        assert set(shm["speedup_over_all_reduce"]) == {str(b) for b in sizes}
    else:
        assert shm["detail"] and "unavailable" in proc.stdout
    assert any("reduce-scatter + all-gather is" in line for line in report["conclusions"])

"""parallel.overlap=a2a (parallel/overlap.py): the overlapped executor trains what the blocking path
trains. Loss and gradient norm every step at fp32 to 1e-6, the expert load and every byte count
identical, through the real trainer and DeepSpeed engine on gloo ranks; and the layouts it refuses."""
import pytest

from conftest import TINY, assert_same_steps, check, launch, read_metrics
from moe_trainer.config import ConfigError
from moe_trainer.resolve import load_config

STEPS = ["train.max_steps=2"]
COMPILED = ["train.compile=true", "train.compile_backend=aot_eager"]
# pp 2 x ep 2 on 4 ranks, 4 micro-batches of 2, one MTP depth
PP2 = ["parallel.pp=2", "parallel.ep=2", "model.num_nextn_predict_layers=1", "train.global_batch_size=16"]


def _exact(r: dict, with_bytes: bool) -> dict:
    """What must be bit-identical: the expert-load figures and (with_bytes) every byte count."""
    return {k: v for k, v in r.items()
            if k.startswith("expert") or (with_bytes and k.startswith("comm.") and k.endswith("_bytes"))}


def _compare(tmp_path, world: int, overrides: list[str], with_bytes: bool = True, compiled: bool = False) -> tuple:
    """The blocking run against the overlapped one (and with `compiled`, the overlapped run under
    train.compile too); returns their metrics rows, in that order."""
    runs = {"none": ["parallel.overlap=none"], "a2a": ["parallel.overlap=a2a"]}
    if compiled:
        runs["a2a_compiled"] = runs["a2a"] + COMPILED
    rows = []
    for name, extra in runs.items():
        out = tmp_path / name
        proc = check(launch(world, out, TINY + STEPS + overrides + extra))
        # compiled by sub-layer region (layer 0 is dense, compiled whole)
        assert ("layers.1.mlp.experts" in proc.stdout) == (name == "a2a_compiled"), proc.stdout[-2000:]
        if name != "none":
            assert_same_steps(tmp_path / "none", out, steps=(1, 2), rel=1e-6)
        rows.append(read_metrics(out))
    blocking = _steps(rows[0])
    for other in rows[1:]:
        for a, b in zip(blocking, _steps(other)):
            assert _exact(a, with_bytes) == _exact(b, with_bytes) and any(k.startswith("expert.") for k in a)
            assert not with_bytes or any(k.startswith("comm.dispatch") for k in _exact(a, True))
    return tuple(rows)


def _steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "loss" in r]


def test_overlap_matches_blocking_ep2_mtp_full_recompute_aux_losses(tmp_path):
    """ep 2 x dp 2 micro-batches of 2 (grad_accum 2: one overlapped pair per step), one MTP depth
    (its MoE block blocking inside the last stage), full recomputation, both auxiliary losses, and
    the emulated link on (the same delays on both paths). And overlapped under train.compile
    (compile.py: the MoE layers compiled by sub-layer region, the all-to-alls between the regions):
    the blocking eager run's losses and norms too (fp32 at 1e-6; the regions are the eager ops, run
    op by op by aot_eager), and the eager overlapped run's every byte count and timed all-to-all kind."""
    blocking, overlapped, compiled = _compare(tmp_path, 2, [
        "parallel.ep=2", "model.num_nextn_predict_layers=1", "parallel.recompute=full", "model.seq_aux_loss_alpha=0.01",
        "model.router_z_loss_coef=0.001", "train.global_batch_size=8", "debug.link_latency_us=300"], with_bytes=False,
        compiled=True)
    for a, b, c in zip(_steps(blocking), _steps(overlapped), _steps(compiled)):
        # the exposed wait is part of the all-to-alls' time, and there is some of each
        for r in (b, c):
            assert 0 < r["time.exposed_all_to_all_s"] <= r["time.all_to_all_s"]
            assert r["comm.a2a_wait_s"] > 0 and r["comm.overlapped_dispatch_s"] > 0
        assert _exact(b, True) == _exact(c, True) and {k for k in b if k.endswith("_s") and k.startswith("comm.")} == \
            {k for k in c if k.endswith("_s") and k.startswith("comm.")}
        # full recomputation re-runs a blocking layer's all-to-alls in backward; a stage keeps the rows it
        # received (its input), so only the MTP block's (blocking, inside the last stage) are sent again
        for kind in ("dispatch", "combine"):
            assert b[f"comm.{kind}_sent_bytes"] < a[f"comm.{kind}_sent_bytes"]
            assert b[f"comm.{kind}_grad_sent_bytes"] == a[f"comm.{kind}_grad_sent_bytes"]


def test_overlap_matches_blocking_ep4_dedup_capacity_documents(tmp_path):
    """ep 4 on 4 ranks, dedup dispatch, a capacity factor (dropped copies), document masks with
    position resets, selective recomputation, an evaluation; grad_accum 2."""
    blocking, overlapped = _compare(tmp_path, 4, [
        "parallel.ep=4", "parallel.dedup_dispatch=true", "model.capacity_factor=1.0", "data.document_mask=true",
        "data.position_reset=true", "parallel.recompute=selective", "train.global_batch_size=16",
        "train.eval_every=2"])
    # the evaluation's blocking forward on the overlapped run's transports (its shm rings on their thread)
    evals = [[r["val_loss"] for r in rows if "val_loss" in r] for rows in (blocking, overlapped)]
    assert evals[0] == evals[1] and len(evals[0]) == 1


def test_overlap_matches_blocking_pp2_v2_ep2_mtp_full_recompute(tmp_path):
    """Interleaved 1F1B at pp 2 x v 2 x ep 2 on 4 ranks: 4 layers (one a virtual stage), 4 micro-batches
    (steady (backward, forward) pairs on both ranks, the last rank's chunk 0 feeding rank 0's chunk 1),
    one MTP depth (its embeddings carried from the first stage), both auxiliary losses on both stages,
    full recomputation (byte counts differ: see the ep 2 test); point-to-point held to NCCL's rule
    (the launcher's wrapper)."""
    _, overlapped = _compare(tmp_path, 4, PP2 + ["model.num_hidden_layers=4", "parallel.virtual_stages=2",
                                                 "parallel.recompute=full", "model.seq_aux_loss_alpha=0.01",
                                                 "model.router_z_loss_coef=0.001"], with_bytes=False)
    _hid(overlapped)


def _hid(rows: list[dict]) -> None:
    """The overlapped run's all-to-alls went through the asynchronous path, each kind and its gradient."""
    for r in _steps(rows):
        assert all(r[f"comm.overlapped_{k}_s"] > 0 for k in ("dispatch", "combine", "dispatch_grad", "combine_grad"))


@pytest.mark.parametrize("overrides, why", [
    (["parallel.ep=1"], "parallel.ep is 1"),
    (["model.arch=llama3"], "llama3"),
    (["parallel.ep=2", "parallel.pp=2", "parallel.schedule=gpipe"], "schedule is gpipe"),
    (["parallel.ep=2", "parallel.pp=2"], "virtual_stages is 1"),
    (["parallel.ep=2", "parallel.cp=2"], "tp or parallel.cp > 1"),
])
def test_overlap_refuses_what_it_does_not_run(overrides, why):
    with pytest.raises(ConfigError, match=why):
        load_config("configs/moe_tiny.yaml", overrides + ["parallel.overlap=a2a"])


def test_link_settings_are_checked():
    with pytest.raises(ConfigError, match="debug.link_gbps"):
        load_config("configs/moe_tiny.yaml", ["debug.link_gbps=-1"])
    assert load_config("configs/moe_tiny.yaml", ["parallel.ep=2", "parallel.overlap=a2a"]).parallel.overlap == "a2a"

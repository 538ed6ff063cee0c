"""Sharded checkpoints load under any layout, exactly: a checkpoint is loaded by another layout's
ranks (each reading only its pieces) and written again by them (moe_trainer.reshard); the two
hold the same weights, Adam moments and balancing biases to 1e-6. A chain of layouts covers
ep2/w2 -> w1, w1 -> ep4/w4, pp2 x ep2 in the old rank order (pipeline innermost) -> the MoE order
-> pp1 x ep4 and llama3 tp2 x pp2 -> w1."""
import base64
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

import random

from moe_trainer.checkpoint import Piece, _place, _place_reference, read_full

from conftest import ROOT, TINY, check, env, free_port, launch

BASE = TINY + ["train.global_batch_size=8", "train.micro_batch_size=2"]
DENSE = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.intermediate_size=128", "train.seq_len=32",
         "train.micro_batch_size=2", "train.global_batch_size=8", "train.warmup_steps=2", "train.log_every=1",
         "train.eval_every=0", "train.resume=none", "metrics.peak_tflops=1.0"]


def reshard(n: int, src: Path, out: Path, overrides: list[str], config: str = "configs/moe_tiny.yaml") -> Path:
    """src's checkpoint loaded and written again by n ranks of another layout; returns the new one."""
    args = [f"--config={config}"] + [a for o in overrides + [f"run.out_dir={out}", f"train.resume={src}"]
                                      for a in ("--set", o)]
    if n == 1:
        cmd = [sys.executable, "-m", "moe_trainer.reshard", *args]
    else:
        world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(n))}).encode()).decode()
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--module", "moe_trainer.reshard", *args]
    check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300))
    return out / "checkpoints" / src.name


def assert_same_state(a: Path, b: Path) -> None:
    x, y = read_full(a, moments=True), read_full(b, moments=True)
    assert x.keys() == y.keys()
    assert any(k.endswith(".exp_avg_sq") for k in x)
    assert any(k.endswith("e_score_correction_bias") for k in x) == any("experts" in k for k in x)
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=1e-6, atol=1e-6, msg=k)


def test_moe_checkpoint_moves_between_layouts(moe_reference, tmp_path):
    one = moe_reference / "checkpoints" / "step_5"  # written by one rank (conftest)
    ep4 = reshard(4, one, tmp_path / "ep4", BASE + ["parallel.ep=4"])  # w1 -> ep4/w4
    assert len(list(ep4.glob("part-r*.safetensors"))) == 4
    assert_same_state(one, ep4)
    # pp2 x ep2 written under the rank order MoE runs had before (pipeline innermost), read under today's
    old = reshard(4, ep4, tmp_path / "pp2ep2_old", BASE + ["parallel.pp=2", "parallel.ep=2",
                                                           "parallel.rank_order=tp-cp-pp-dp"])
    assert json.loads((old / "state.json").read_text())["layout"]["order"] == "tp-cp-pp-dp"
    pp2 = reshard(4, old, tmp_path / "pp2ep2", BASE + ["parallel.pp=2", "parallel.ep=2"])
    assert json.loads((pp2 / "state.json").read_text())["layout"]["order"] == "tp-cp-dp-pp"
    assert_same_state(one, old)
    assert_same_state(one, pp2)
    ep2 = reshard(2, pp2, tmp_path / "ep2", BASE + ["parallel.ep=2"])  # pp2 x ep2 on 4 ranks -> pp1 x ep2 on 2
    w1 = reshard(1, ep2, tmp_path / "w1", BASE)  # ep2/w2 -> w1
    assert_same_state(one, w1)


def test_llama_checkpoint_moves_from_tp_and_pp_to_one_rank(tmp_path):
    config = "configs/llama3_tiny.yaml"
    ref = tmp_path / "ref"
    check(launch(4, ref, DENSE + ["train.max_steps=2", "parallel.tp=2", "parallel.pp=2"], config=config))
    ckpt = ref / "checkpoints" / "step_2"
    one = reshard(1, ckpt, tmp_path / "w1", DENSE, config=config)  # tp2 x pp2 -> w1
    assert_same_state(ckpt, one)
    assert len(list(ckpt.glob("part-r*.safetensors"))) == 4 and len(list(one.glob("part-r*.safetensors"))) == 1


def _rank_dying_mid_write(rank: int, world: int, port: int, out: str, overrides: list) -> None:
    """A trainer rank; rank 1 dies (SIGKILL-like, no clean-up) half-way through writing step 2's part."""
    import os
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from moe_trainer import checkpoint, train
    real = checkpoint.write_safetensors

    def dying(filename, tensors, metadata=None):
        digest = real(filename, tensors, metadata)
        if rank == 1 and ".step_2.tmp" in str(filename):
            with open(filename, "r+b") as f:
                f.truncate(Path(filename).stat().st_size // 2)
            os._exit(9)
        return digest

    checkpoint.write_safetensors = dying
    os._exit(train.main([f"--config={ROOT / 'configs' / 'moe_tiny.yaml'}"] + [a for o in overrides + [f"run.out_dir={out}"]
                                                               for a in ("--set", o)]))


def test_a_rank_killed_mid_write_leaves_latest_on_the_previous_checkpoint(tmp_path):
    import multiprocessing as mp
    steps = BASE + ["train.max_steps=3", "train.checkpoint_every=1", "parallel.ep=2", "parallel.timeout_s=30",
                    "parallel.cpu_alltoall=gloo"]
    out, port = tmp_path / "run", free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_dying_mid_write, args=(r, 2, port, str(out), steps)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
    assert procs[1].exitcode == 9 and procs[0].exitcode != 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_1" and not (ckpts / "step_2").exists()
    # a restart resumes from step 1 and ends where an uninterrupted run ends
    proc = check(launch(2, out, steps + ["train.resume=auto"]))
    assert "resumed from" in proc.stdout and "step_1" in proc.stdout
    ref = tmp_path / "ref"
    check(launch(2, ref, steps))
    a, b = read_full(ref / "checkpoints" / "step_3"), read_full(ckpts / "step_3")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7, msg=k)


def test_fragment_placement_matches_the_mask_reference_on_random_layouts():
    """checkpoint._place (index arithmetic on contiguous ranges) against _place_reference (a mask per
    piece): a writer's block cut into random flat fragments (ZeRO partitions), read into random
    target blocks; the same elements land in the same places, and the count is what the mask marks."""
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        lo = tuple(rng.randrange(n) for n in shape)
        block = tuple(rng.randint(1, n - a) for n, a in zip(shape, lo))  # the writer's box
        cuts = sorted(rng.sample(range(1, math.prod(block)), min(rng.randint(0, 4), math.prod(block) - 1)))
        bounds = [0, *cuts, math.prod(block)]
        offsets = tuple(rng.randrange(n) for n in shape)
        sizes = tuple(rng.randint(1, n - a) for n, a in zip(shape, offsets))  # the reader's box
        fast, ref = torch.full(sizes, float("nan")), torch.full(sizes, float("nan"))
        written = torch.zeros(sizes, dtype=torch.bool)
        for a, b in zip(bounds, bounds[1:]):
            piece = Piece("part", "w", shape, lo, block, a, b - a)
            data = torch.randn(b - a)
            before = int(written.sum())
            _place_reference(piece, data, ref, written, offsets)
            assert _place(piece, data, fast, offsets) == int(written.sum()) - before, (shape, lo, block, a, b)
        torch.testing.assert_close(fast, ref, equal_nan=True, rtol=0, atol=0)

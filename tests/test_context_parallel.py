"""Context parallelism (Llama 3's all-gather of K and V, load-balanced chunks)
alone and with tensor + sequence parallelism, against the single-rank model."""
import pytest
import torch
import torch.distributed as dist

from moe_trainer.parallel.comm import CommCounter
from moe_trainer.parallel.context import (apply_context_parallel, cp_causal_mask, cp_mean_loss, cp_shard_indices,
                                          shard_sequence)
from moe_trainer.parallel.tensor import apply_tensor_parallel, gather_logits

from test_tensor_parallel import B, L, T, assert_grads_match, reference, spawn, start, tiny_cfg


def test_shard_indices_pair_early_and_late_chunks():
    assert cp_shard_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_shard_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([cp_shard_indices(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    x = torch.arange(16).view(2, 8)
    assert shard_sequence(x, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    # every rank gets the same causal work: the same number of allowed (query, key) pairs
    assert cp_causal_mask(8, 2, 0).sum() == cp_causal_mask(8, 2, 1).sum()
    with pytest.raises(ValueError):
        cp_shard_indices(10, 2, 0)


def _cp_worker(rank, world, port, tp, kv_heads):
    mesh = start(rank, world, port, tp=tp, cp=world // tp)
    cp, cp_rank = mesh.size("cp"), mesh.index("cp")
    cfg = tiny_cfg(kv_heads)
    ref, model, ref_out, ids, labels = reference(cfg)
    counter = CommCounter()
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    apply_context_parallel(model, mesh, counter)
    positions = shard_sequence(torch.arange(T), cp, cp_rank, dim=0)
    out = model(shard_sequence(ids, cp, cp_rank), shard_sequence(labels, cp, cp_rank), positions=positions)
    sent = counter.reset()["sent"]
    out.loss.backward()

    logits = gather_logits(out.logits, mesh)
    assert (logits - shard_sequence(ref_out.logits, cp, cp_rank)).abs().max() < 1e-5
    torch.testing.assert_close(cp_mean_loss(out.loss, mesh), ref_out.loss, rtol=1e-6, atol=1e-6)
    assert_grads_match(model, ref, cfg, mesh, reduce_cp=True)
    # K and V, each (B, Hkv/tp, T/cp, head_dim), all-gathered over cp in every layer
    kv_local = max(kv_heads // tp, 1)
    assert sent["cp_all_gather"] == L * 2 * (cp - 1) * B * kv_local * (T // cp) * (32 // 4) * 4
    dist.destroy_process_group()


@pytest.mark.parametrize("world,tp,kv_heads", [(2, 1, 2), (4, 2, 1)], ids=["cp2", "tp2-sp-cp2-kv-replicated"])
def test_context_parallel_equals_single_rank(world, tp, kv_heads):
    spawn(_cp_worker, world, tp, kv_heads)

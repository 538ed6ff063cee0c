"""Document masking (data.document_mask, data.position_reset): a packed window's per-token losses
equal those of each document run alone, for Llama 3 (GQA) and DeepSeek-V3 (MLA, MTP), on the CPU,
accelerator and reference kernels; the CUDA path (FlexAttention with a block mask made from the
document ids, no (T, S) tensor) held against the mask path on this CPU; pipeline stages and
context parallelism (cp 2, real gloo ranks) carrying the ids."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_trainer import kernels
from moe_trainer.config import ConfigError, ModelConfig
from moe_trainer.resolve import load_config
from moe_trainer.data.documents import document_ids, document_positions
from moe_trainer.kernels import document_attention as da
from moe_trainer.kernels.reference import ReferenceBackend
from moe_trainer.models import deepseek_v3
from moe_trainer.models.registry import build_model
from moe_trainer.parallel.context import apply_context_parallel, cp_shard_indices, shard_sequence
from moe_trainer.parallel.pipeline import PipelineStage

from test_context_parallel import TensorSizes, qkv
from test_tensor_parallel import assert_grads_match, spawn, start

EOS, V, T = 1, 64, 24
# document lengths of each row of the packed (2, 24) window, an EOS ending each (the last one cut)
DOCS = ([5, 9, 2, 8], [11, 13])
BACKENDS = ["cpu", "accelerator", "reference"]


def tiny(arch: str) -> ModelConfig:
    if arch == "llama3":
        return ModelConfig(arch="llama3", vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, initializer_range=0.2)
    return ModelConfig(arch="deepseek_v3", vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                       v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                       n_group=1, topk_group=1, moe_intermediate_size=16, num_nextn_predict_layers=1,
                       max_position_embeddings=64, initializer_range=0.2)


def packed_window(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) (2, T): random tokens other than EOS, EOS at the end of every document but the last."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(2, V, (2, T + 1), generator=g)
    for row, lengths in enumerate(DOCS):
        ends = torch.tensor(lengths).cumsum(0)[:-1] - 1
        window[row, ends] = EOS
    return window[:, :-1], window[:, 1:]


def spans(row: int) -> list[tuple[int, int]]:
    ends = torch.tensor(DOCS[row]).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")  # (B, T)


def test_document_ids_and_positions():
    ids = torch.tensor([[4, 1, 5, 6, 1, 1, 7], [1, 2, 3, 4, 5, 6, 1]])
    docs = document_ids(ids, eos_id=1)
    assert docs.dtype == torch.int32
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]  # an EOS ends its own document
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_config_keys_and_their_sentence():
    cfg = load_config(None, ["data.document_mask=true", "data.position_reset=true"])
    assert cfg.data.document_mask and cfg.data.position_reset
    assert not load_config(None).data.document_mask  # off by default
    with pytest.raises(ConfigError, match="data.position_reset needs data.document_mask"):
        load_config(None, ["data.position_reset=true"])
    with pytest.raises(ConfigError, match="data.document_mask must be of type bool"):
        load_config(None, ["data.document_mask=3"])


def model_of(arch: str, backend: str):
    with kernels.using(backend):
        return build_model(tiny(arch), seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama3", "deepseek_v3"])
def test_packed_window_equals_documents_alone(arch, backend, monkeypatch):
    """Per-token losses (and MTP logits) of the packed window equal each document's alone, with
    positions restarting at documents; the gradient of their sum equals the sum of the documents'.
    Without the reset a document alone at its window positions is matched; without the mask not."""
    model = model_of(arch, backend)
    ids, labels = packed_window()
    docs = document_ids(ids, EOS)
    mtp_logits = []
    real_lm_loss = deepseek_v3.lm_loss
    monkeypatch.setattr(deepseek_v3, "lm_loss", lambda lg, lb: (mtp_logits.append(lg), real_lm_loss(lg, lb))[1])

    out = model(ids, labels, document_positions(docs), docs)
    packed = token_losses(out.logits, labels)
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    packed_mtp = mtp_logits[-1] if arch == "deepseek_v3" else None
    model.zero_grad()
    alone_total = 0.0
    for row in range(2):
        for s, e in spans(row):
            alone = model(ids[row:row + 1, s:e], labels[row:row + 1, s:e])
            losses = token_losses(alone.logits, labels[row:row + 1, s:e])
            torch.testing.assert_close(packed[row, s:e], losses[0], rtol=1e-5, atol=1e-5)
            if arch == "deepseek_v3" and e - s > 1:  # depth 1 at i sees t_{i+1}: inside the document up to e - 2
                torch.testing.assert_close(packed_mtp[row, s:e - 1], mtp_logits[-1][0], rtol=1e-5, atol=1e-5)
            alone_total = alone_total + losses.sum()
    alone_total.backward()
    for name, p in model.named_parameters():
        if name in packed_grads:
            torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)

    with torch.no_grad():
        kept = token_losses(model(ids, documents=docs).logits, labels)  # mask, window positions
        for row in range(2):
            for s, e in spans(row):
                at = model(ids[row:row + 1, s:e], positions=torch.arange(s, e)).logits
                torch.testing.assert_close(kept[row, s:e], token_losses(at, labels[row:row + 1, s:e])[0],
                                           rtol=1e-5, atol=1e-5)
        plain = token_losses(model(ids).logits, labels)
    first = DOCS[0][0]
    torch.testing.assert_close(plain[0, :first], kept[0, :first])  # the first document sees only itself anyway
    assert (plain[:, first:] - kept[:, first:]).abs().max() > 1e-2  # later ones see earlier documents unmasked


def test_pipeline_stages_carry_the_documents():
    """Two stages (layers 0 and 1) fed the micro-batch's ids and positions each: the last one's
    loss is the whole model's under the mask, which differs from the unmasked one."""
    model = model_of("llama3", "cpu")
    ids, labels = packed_window(1)
    docs = document_ids(ids, EOS)
    pos = document_positions(docs)
    first, last = PipelineStage(model, [[0]], True, False), PipelineStage(model, [[1]], False, True)
    with torch.no_grad():
        carried, _ = first(None, ids, None, pos, docs)
        out, _ = last(carried, ids, labels, pos, docs)
        whole = model(ids, labels, pos, docs)
        unmasked = model(ids, labels)
    torch.testing.assert_close(out.loss, whole.loss, rtol=0, atol=0)
    assert abs(out.loss - unmasked.loss) > 1e-3


def docs_of(*rows: list[int]) -> torch.Tensor:
    """(len(rows), sum of each row) int32 document ids from each row's document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r), dtype=torch.int32), torch.tensor(r))
                        for r in rows])


class _Window:
    """A batch source that always gives the same (2, T + 1) window."""

    def __init__(self, window):
        self.window = window

    def micro_batch(self, *args):
        return self.window


@pytest.mark.parametrize("cp", [1, 2])
def test_trainer_micro_batch_carries_ids_and_reset_positions(cp):
    """Trainer.micro_batch with data.document_mask and data.position_reset: document ids of the whole
    window, positions restarting at documents and sharded like the tokens under cp; without the
    keys the batch is as before (no ids, positions 0..T-1)."""
    from types import SimpleNamespace
    from moe_trainer.trainer import Trainer
    ids, labels = packed_window(3)
    window = torch.cat([ids, labels[:, -1:]], 1)
    cfg = load_config(None, [f"train.seq_len={T}", "data.document_mask=true", "data.position_reset=true"])
    mesh = SimpleNamespace(dp_rank=0, index=lambda dim: 1 if dim == "cp" else 0)
    trainer = SimpleNamespace(cfg=cfg, faults=None, step=0, data_offset=0, train_data=_Window(window), mesh=mesh,
                              layout=SimpleNamespace(dp=1, cp=cp), device=torch.device("cpu"), eos_id=EOS)
    inputs, got_labels, positions, documents = Trainer.micro_batch(trainer, 0)
    docs = document_ids(ids, EOS)
    assert torch.equal(documents, docs)  # the whole window's, whatever the cp rank
    assert torch.equal(inputs, shard_sequence(ids, cp, 1) if cp > 1 else ids)
    assert torch.equal(got_labels, shard_sequence(labels, cp, 1) if cp > 1 else labels)
    reset = document_positions(docs)
    assert torch.equal(positions, shard_sequence(reset, cp, 1) if cp > 1 else reset)
    trainer.eos_id = None  # data.document_mask false
    _, _, positions, documents = Trainer.micro_batch(trainer, 0)
    assert documents is None and torch.equal(positions, shard_sequence(torch.arange(T), cp, 1, dim=0) if cp > 1
                                             else torch.arange(T))


def sorted_docs(batch: int, t: int, n_docs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_docs, (batch, t), generator=g).sort(-1).values.to(torch.int32)


@pytest.mark.parametrize("q_chunks", [None, (0, 3), (1, 2)], ids=["whole", "cp-rank0", "cp-rank1"])
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_flex_path_equals_mask_path_and_reference(shape, q_chunks):
    """What CUDA runs (FlexAttention and its block mask; eager here, forward only: torch runs no
    FlexAttention backward on a CPU) against SDPA's mask path and the reference's explicit scores,
    with tiles of 8 so that empty, full and partial tiles all occur; the mask path's gradients
    against the reference's."""
    t, block, scale = 32, 8, 0.3
    q, k, v = qkv(shape, t)
    docs = docs_of([1, 3, 20, 8], [16, 16])  # documents spanning whole tiles, and tiles cut by documents
    if q_chunks is not None:  # a cp rank's queries: two chunks of t / 4
        c = t // 4
        q = torch.cat([q[:, :, a * c:(a + 1) * c] for a in q_chunks], 2).detach().requires_grad_()
        q_docs = torch.cat([docs[:, a * c:(a + 1) * c] for a in q_chunks], 1)
    else:
        q_docs = docs
    ref = ReferenceBackend.document_attention(q, k, v, scale, q_docs, docs, q_chunks)
    mask = da.document_attention(q, k, v, scale, q_docs, docs, q_chunks, kernel="mask")
    q_pos = da.query_positions(q.shape[2], q_chunks, q.device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        flex = da.flex_document_attention(q.detach(), k.detach(), v.detach(), scale, q_docs, docs, q_pos,
                                          torch.arange(t), compiled=False, block=block)
    torch.testing.assert_close(mask, ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=2e-6)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
    for a, b in zip(torch.autograd.grad(mask, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)

    # the block mask: its tiles cover every allowed pair; full tiles hold only allowed pairs;
    # without cp (queries and keys in one order) exactly the tiles that hold one
    dense = da.document_mask(q_docs, docs, q_pos, torch.arange(t))[:, 0]  # (B, Tq, S)
    tiles = dense.unflatten(1, (-1, block)).unflatten(3, (-1, block))  # (B, nq, bq, nk, bk)
    some, every = tiles.any(4).any(2), tiles.all(4).all(2)
    partial, full = da.tile_kinds(q_docs, docs, q_pos, torch.arange(t), block)
    assert not (some & ~(partial | full)).any() and not (full & ~every).any() and full.any() and partial.any()
    if q_chunks is None:
        assert torch.equal(partial | full, some)
    block_mask = da.document_block_mask(q_docs, docs, q_pos, torch.arange(t), block)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), partial | full)


def test_block_mask_is_made_without_a_sequence_by_sequence_tensor():
    """The CUDA path's block mask at T = 1024 (tiles of 128): nothing of T x T elements is made."""
    t = 1024
    docs = sorted_docs(1, t, 5, seed=3)
    pos = torch.arange(t)
    with TensorSizes() as sizes:
        da.document_block_mask(docs, docs, pos, pos)
    assert max(torch.Size(s).numel() for s in sizes.shapes) < t * t // 16
    assert da.kernel_for("cuda") == "flex" and da.kernel_for("cpu") == "mask"
    # ids, positions and block mask on the meta device: nothing reads a value on the host (no sync)
    ids = torch.randint(0, 9, (2, t), device="meta")
    docs = document_ids(ids, EOS)
    assert document_positions(docs).shape == (2, t)
    pos = torch.arange(t, device="meta")
    mask = da.document_block_mask(docs, docs, pos, pos)
    assert mask.kv_indices.device.type == "meta" and mask.kv_num_blocks.shape == (2, 1, t // da.BLOCK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_compiled_flex_on_cuda_equals_mask_path_without_host_sync(dtype, tol, shape):
    """What CUDA runs (compiled FlexAttention, forward and backward) against the fp32 mask path,
    whole sequences and a cp rank's chunks; the second call under sync debug mode "error"."""
    t, scale = 512, 0.3
    q, k, v = (x.detach().cuda() for x in qkv(shape, t))
    docs = docs_of([40, 200, 100, 172], [512]).cuda()
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], device="cuda")
    for q_chunks in (None, (1, 2)):
        c = t // 4
        qq = q if q_chunks is None else torch.cat([q[:, :, a * c:(a + 1) * c] for a in q_chunks], 2)
        q_docs = docs if q_chunks is None else torch.cat([docs[:, a * c:(a + 1) * c] for a in q_chunks], 1)
        d = dout[:, :, :qq.shape[2]]
        truth = [x.requires_grad_() for x in (qq.clone(), k.clone(), v.clone())]
        ref = da.document_attention(*truth, scale, q_docs, docs, q_chunks, kernel="mask")
        ref_grads = torch.autograd.grad(ref, truth, d)
        for attempt in range(2):
            low = [x.detach().to(dtype).requires_grad_() for x in (qq, k, v)]
            if attempt:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                out = da.document_attention(*low, scale, q_docs, docs, q_chunks)
                grads = torch.autograd.grad(out, low, d.to(dtype))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for a, b in zip([out, *grads], [ref, *ref_grads]):
            assert ((a.float() - b).norm() / b.norm()) < tol


def _cp_worker(rank, world, port):
    """cp 2 on real gloo ranks: each rank's per-token losses under the mask with reset positions
    equal the single-process packed run's and the documents' alone; the cp-averaged gradients
    equal the single-process ones; on the CPU and the accelerator kernels."""
    mesh = start(rank, world, port, cp=world)
    cp, r = mesh.size("cp"), mesh.index("cp")
    ids, labels = packed_window(2)
    docs = document_ids(ids, EOS)
    pos = document_positions(docs)
    for backend in ("cpu", "accelerator"):
        ref, model = model_of("llama3", backend), model_of("llama3", backend)
        with kernels.using(backend):
            apply_context_parallel(model, mesh)
        whole = ref(ids, labels, pos, docs)
        whole.loss.backward()
        out = model(shard_sequence(ids, cp, r), shard_sequence(labels, cp, r), shard_sequence(pos, cp, r), docs)
        out.loss.backward()
        mine = token_losses(out.logits, shard_sequence(labels, cp, r))
        torch.testing.assert_close(mine, shard_sequence(token_losses(whole.logits, labels), cp, r),
                                   rtol=1e-5, atol=1e-5, msg=backend)
        assert_grads_match(model, ref, tiny("llama3"), mesh, reduce_cp=True)
        where = cp_shard_indices(T, cp, r)
        with torch.no_grad():
            for row in range(2):
                for s, e in spans(row):
                    alone = token_losses(ref(ids[row:row + 1, s:e]).logits, labels[row:row + 1, s:e])[0]
                    local = (where >= s) & (where < e)
                    torch.testing.assert_close(mine[row, local], alone[where[local] - s], rtol=1e-5, atol=1e-5)
    dist.destroy_process_group()


def test_context_parallel_chunks_carry_their_documents():
    spawn(_cp_worker, 2)


@pytest.mark.parametrize("backend", ["cpu", "accelerator"])
def test_the_mask_is_built_once_per_micro_batch(backend, monkeypatch):
    """The mask is built by the first layer that attends the micro-batch's ids and carried by them to
    the others: one for the window's layers and one per MTP depth (a shorter window), not one per
    layer; the model's logits and gradients are those of a mask built in every layer. The CUDA path's
    block mask likewise (FlexAttention without gradients: what a CPU runs), equal to the mask path."""
    built = []

    def counted(build):
        return lambda *args, **kw: (built.append(build.__name__), build(*args, **kw))[1]
    ids, labels = packed_window()
    runs = {}
    for once in (True, False):
        model = model_of("deepseek_v3", backend)
        if not once:  # the reference: every layer builds its own
            monkeypatch.setattr(da, "built_once", lambda q_docs, k_docs, key, build: build())
        monkeypatch.setattr(da, "document_mask", counted(da.document_mask))
        built.clear()
        docs = document_ids(ids, EOS)
        out = model(ids, labels, document_positions(docs), docs)
        out.loss.backward()
        runs[once] = (list(built), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()})
        monkeypatch.undo()
    assert runs[True][0] == ["document_mask"] * 2  # the 2 layers' window, MTP depth 1's
    assert runs[False][0] == ["document_mask"] * 3  # one per layer before
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=0)
    for name, grad in runs[True][2].items():
        torch.testing.assert_close(grad, runs[False][2][name], rtol=0, atol=0, msg=name)

    q, k, v = (torch.randn(2, 2, T, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    docs = document_ids(ids, EOS)
    monkeypatch.setattr(da, "document_block_mask", counted(da.document_block_mask))
    built.clear()
    with torch.no_grad():
        outs = [da.document_attention(q, k, v, 0.25, docs, docs, kernel="flex-eager") for _ in range(3)]
        masked = da.document_attention(q, k, v, 0.25, docs, docs, kernel="mask")
    assert built == ["document_block_mask"]
    for out in outs:
        torch.testing.assert_close(out, masked, rtol=1e-5, atol=1e-5)

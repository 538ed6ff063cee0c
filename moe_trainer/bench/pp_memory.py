"""Pipeline benchmark, the parts measured in one process (python -m moe_trainer.bench.pp runs them):
peak saved-activation bytes of every stage under GPipe and 1F1B order and of every rank under
interleaved 1F1B; for each parallel.recompute mode, the largest micro-batch within a fixed
activation budget and training tokens/s at it."""
from __future__ import annotations

import json
import statistics
import time
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/moe_tiny.yaml"  # the model every part of the pipeline benchmark measures


# ----------------------------------------------------------------------------- activation memory


class StorageMeter:
    """Like pipeline.ActivationMeter (which counts numel * element_size per save, so a tensor saved by
    two ops counts twice), plus the deduplicated figure: bytes of distinct storages kept alive by saves."""

    def __init__(self, module: torch.nn.Module):
        from ..parallel.pipeline import ActivationMeter
        self.inner = ActivationMeter(module)
        self.refs: dict[int, list] = {}  # storage ptr -> [count, nbytes]
        self.live = self.peak = 0

    def _release(self, ptr: int) -> None:
        ref = self.refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[ptr]

    def pack(self, t: torch.Tensor):
        holder = self.inner.pack(t)
        if holder is t:  # a parameter
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.refs:
            self.refs[ptr][0] += 1
        else:
            self.refs[ptr] = [1, st.nbytes()]
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def hooks(self):
        from ..parallel.pipeline import ActivationMeter
        return torch.autograd.graph.saved_tensors_hooks(self.pack, ActivationMeter.unpack)


def _memory_cfg(pp: int, seq: int, extra: list[str] = ()):
    from ..resolve import load_config
    return load_config(str(ROOT / CONFIG), [f"parallel.pp={pp}", f"train.seq_len={seq}", *extra])


def stage_peaks(pp: int, m: int, mbs: int, seq: int, schedule: str) -> list[dict]:
    """Peak saved-activation bytes of every stage running `schedule`'s order for m micro-batches, one
    process. Stage s's inputs come from stages < s run without grad (what it would receive)."""
    from ..models.registry import build_model
    from ..parallel.pipeline import SCHEDULES, PipelineStage, stage_layers
    cfg = _memory_cfg(pp, seq)
    model = build_model(cfg.model, cfg.run.seed)
    layers = stage_layers(cfg, seq)
    stages = [PipelineStage(model, [layers[s]], s == 0, s == pp - 1) for s in range(pp)]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (mbs, seq + 1), generator=g) for _ in range(m)]
    out = []
    for s, stage in enumerate(stages):
        inputs = []
        with torch.no_grad():
            for b in batches:
                carried = None
                for prev in stages[:s]:
                    carried, _ = prev(carried, b[:, :-1])
                inputs.append(carried)
        meter = StorageMeter(stage)
        saved = {}
        for kind, i, _ in SCHEDULES[schedule](s, pp, m):
            x, y = batches[i][:, :-1], batches[i][:, 1:]
            if kind == "F":
                carried = inputs[i].clone().requires_grad_() if inputs[i] is not None else None
                with meter.hooks():
                    res, aux = stage(carried, x, y if stage.last else None)
                saved[i] = res.loss if stage.last else (res, aux)
            else:
                held = saved.pop(i)
                if stage.last:
                    held.backward()
                else:
                    res, aux = held
                    surrogate = (res * torch.ones_like(res)).sum() + (aux if aux is not None else 0.0)
                    surrogate.backward()
        stage.zero_grad(set_to_none=True)
        out.append({"stage": s, "layers": layers[s], "peak_saved": meter.inner.peak, "peak_storage": meter.peak,
                    "leak": meter.inner.live})
    return out


def bench_memory(pp: int, m: int, mbs: int, seq: int) -> list[dict]:
    one = stage_peaks(pp, 1, mbs, seq, "1f1b")  # one micro-batch in flight: the unit
    g = stage_peaks(pp, m, mbs, seq, "gpipe")
    f = stage_peaks(pp, m, mbs, seq, "1f1b")
    rows = []
    for s in range(pp):
        rows.append({"stage": s, "layers": g[s]["layers"], "one_mb": one[s]["peak_saved"],
                     "gpipe": g[s]["peak_saved"], "1f1b": f[s]["peak_saved"],
                     "gpipe_storage": g[s]["peak_storage"], "1f1b_storage": f[s]["peak_storage"],
                     "expect_gpipe": m, "expect_1f1b": min(pp - s, m)})
    print(json.dumps(rows), flush=True)
    return rows


def memory_table(rows: list[dict]) -> str:
    mib = 2 ** 20
    out = ["| stage | layers | 1 micro-batch MiB | GPipe peak MiB (x one) | 1F1B peak MiB (x one) | "
           "1F1B / GPipe | expected in flight G / 1F1B | distinct storages MiB G / 1F1B |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['stage']} | {','.join(map(str, r['layers']))} | {r['one_mb'] / mib:.1f} | "
                   f"{r['gpipe'] / mib:.1f} ({r['gpipe'] / r['one_mb']:.2f}) | "
                   f"{r['1f1b'] / mib:.1f} ({r['1f1b'] / r['one_mb']:.2f}) | {r['1f1b'] / r['gpipe']:.2f} | "
                   f"{r['expect_gpipe']} / {r['expect_1f1b']} | "
                   f"{r['gpipe_storage'] / mib:.1f} / {r['1f1b_storage'] / mib:.1f} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- interleaved (virtual stages)

INTERLEAVED_LAYERS = 8  # moe_tiny deepened so that pp 4 x v 2 and pp 2 x v 4 have a layer per chunk


def chunk_peaks(pp: int, v: int, m: int, mbs: int, seq: int) -> list[int]:
    """Peak saved-activation bytes of every rank running the (interleaved when v > 1) 1F1B order of its
    v chunks for m micro-batches, one process; a chunk's inputs come from the virtual stages before it,
    run without grad (what the rank would receive)."""
    from ..models.registry import build_model
    from ..parallel.pipeline import SCHEDULES, PipelineStage, rank_chunks, stage_layers
    cfg = _memory_cfg(pp, seq, [f"model.num_hidden_layers={INTERLEAVED_LAYERS}", f"parallel.virtual_stages={v}"])
    model = build_model(cfg.model, cfg.run.seed)
    virtual = stage_layers(cfg, seq)
    ranks = [PipelineStage(model, rank_chunks(virtual, s, pp), s == 0, s == pp - 1) for s in range(pp)]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (mbs, seq + 1), generator=g) for _ in range(m)]
    inputs = {}  # (virtual stage, micro) -> its input
    with torch.no_grad():
        for i, b in enumerate(batches):
            carried = None
            for h in range(pp * v - 1):
                inputs[(h + 1, i)] = carried = ranks[h % pp](carried, b[:, :-1], chunk=h // pp)[0]
    peaks = []
    for s, stage in enumerate(ranks):
        meter = StorageMeter(stage)
        saved = {}
        for kind, i, c in SCHEDULES["1f1b"](s, pp, m, v):
            x, y = batches[i][:, :-1], batches[i][:, 1:]
            last = stage.is_last(c)
            if kind == "F":
                x_in = inputs.get((c * pp + s, i))
                carried = x_in.clone().requires_grad_() if x_in is not None else None
                with meter.hooks():
                    res, aux = stage(carried, x, y if last else None, chunk=c)
                saved[(i, c)] = res.loss if last else (res, aux)
            else:
                held = saved.pop((i, c))
                if last:
                    held.backward()
                else:
                    res, aux = held
                    ((res * torch.ones_like(res)).sum() + (aux if aux is not None else 0.0)).backward()
        stage.zero_grad(set_to_none=True)
        peaks.append(meter.inner.peak)
    return peaks


# ----------------------------------------------------------------------------- recomputation


def _recompute_model(mode: str, seq: int):
    from ..models.registry import build_model
    from ..parallel.recompute import apply_recompute
    cfg = _memory_cfg(1, seq, [f"parallel.recompute={mode}"])
    return cfg, apply_recompute(build_model(cfg.model, cfg.run.seed), mode)


def peak_bytes(mode: str, mbs: int, seq: int) -> tuple[int, int]:
    """(peak saved bytes as ActivationMeter counts them, distinct storages) of one micro-batch's
    forward + backward on the whole model under `mode`."""
    cfg, model = _recompute_model(mode, seq)
    x = torch.randint(0, cfg.model.vocab_size, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    meter = StorageMeter(model)
    with meter.hooks():
        loss = model(x[:, :-1], x[:, 1:]).loss
    loss.backward()
    return meter.inner.peak, meter.peak


def layer_working_set(seq: int) -> int:
    """Saved bytes of the largest decoder layer for one sequence without recomputation: what full
    recomputation rebuilds in backward, one layer at a time. ActivationMeter cannot see it (the
    checkpoint's own saved-tensor hooks take precedence inside the layer), so it is measured here
    per layer and added for the `full (+ working set)` row."""
    cfg, model = _recompute_model("none", seq)
    per_layer = []
    for layer in model.layers.values():
        meter = StorageMeter(layer)
        fwd = layer.forward

        def run(*args, _fwd=fwd, _meter=meter, **kw):
            with _meter.hooks():
                return _fwd(*args, **kw)
        layer.forward = run
        per_layer.append(meter)
    x = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    model(x[:, :-1], x[:, 1:]).loss.backward()
    return max(m.inner.peak for m in per_layer)


def largest_fit(mode: str, budget: int, seq: int, limit: int, extra_per_seq: int = 0) -> tuple[int, int]:
    """Largest micro-batch (a search over integers, saved bytes grow linearly with it) whose peak
    saved bytes (+ extra_per_seq per sequence) fit `budget`; returns (micro-batch, its peak bytes)."""
    def cost(b: int) -> int:
        return peak_bytes(mode, b, seq)[0] + b * extra_per_seq
    per1, per2 = cost(1), cost(2)
    slope, base = per2 - per1, 2 * per1 - per2
    b = max(1, min(limit, int((budget - base) // max(1, slope))))
    while True:  # verify the prediction by measuring
        p = cost(b)
        if p <= budget or b == 1:
            break
        b -= 1
    while b < limit:
        q = cost(b + 1)
        if q > budget:
            break
        b, p = b + 1, q
    return b, p


def train_tokens_per_s(mode: str, mbs: int, seq: int, steps: int) -> dict:
    cfg, model = _recompute_model(mode, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        x = torch.randint(0, cfg.model.vocab_size, (mbs, seq + 1), generator=g)
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:] if len(times) > 1 else times)
    return {"step_s": step, "tokens_per_s": mbs * seq / step}


def bench_recompute(budget_mbs: int, seq: int, steps: int, limit: int) -> tuple[list[dict], int]:
    budget = peak_bytes("none", budget_mbs, seq)[0]  # `none` fits exactly budget_mbs sequences
    rows = []
    ws = layer_working_set(seq)
    for mode, extra in (("none", 0), ("selective", 0), ("full", 0), ("full", ws)):
        b, p = largest_fit(mode, budget, seq, limit, extra)
        per_seq = peak_bytes(mode, 1, seq)[0] + extra
        t = train_tokens_per_s(mode, b, seq, steps)
        same = t if mode == "none" else None if extra else train_tokens_per_s(mode, budget_mbs, seq, steps)
        row = {"mode": mode + (" (+ working set)" if extra else ""), "per_seq": per_seq, "mbs": b, "peak": p,
               "tokens_per_s": t["tokens_per_s"], "step_s": t["step_s"],
               "tokens_per_s_at_budget_mbs": same and same["tokens_per_s"], "working_set_per_seq": extra}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, budget


def recompute_table(rows: list[dict], budget: int, budget_mbs: int, seq: int) -> str:
    mib = 2 ** 20
    base = rows[0]["tokens_per_s"]
    out = [f"Budget: {budget / mib:.1f} MiB of saved activations (= `none` at micro-batch {budget_mbs} x {seq} "
           "tokens).", "",
           f"| recompute | saved MiB per sequence | largest micro-batch in budget | its peak MiB | step s | "
           f"tokens/s | vs none | tokens/s at micro-batch {budget_mbs} |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['per_seq'] / mib:.2f} | {r['mbs']} | {r['peak'] / mib:.1f} | "
                   f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
                   + (f"{r['tokens_per_s_at_budget_mbs']:.0f} |" if r["tokens_per_s_at_budget_mbs"] else "= full |"))
    return "\n".join(out)

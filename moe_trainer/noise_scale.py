"""Gradient noise scale: the critical batch size, nearly free under data parallelism.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"), appendix A:
with gradients measured at two batch sizes B_small < B_big (in tokens here),

    |G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S     ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

are unbiased estimates of the true gradient's squared norm and of tr(Sigma), the
per-token gradient covariance's trace. The "simple" noise scale B_simple =
tr(Sigma)/|G|^2 is where the batch size stops paying: below it a doubled batch
almost halves the steps, far above it adds compute for little gain. Both
estimates are noisy (S can be negative on one step), so each is smoothed with
an exponential moving average and the ratio is taken of the averages.

In training, B_small is a rank's micro-batch (its local gradient before
DeepSpeed's reduction, recorded by `MicroGradNorms`' tensor hooks) and B_big
the global batch (the all-reduced gradient, whose norm DeepSpeed computes for
clipping; `ReducedGradNorm` keeps the part over the same parameters). Both sets
must cover the same parameters:

- parameters split across model-parallel ranks (tp shards, pipeline stages)
  contribute partial squared norms that must be summed over the model-parallel
  group (`mesh.group("mp")`); parameters replicated over tp are counted on tp
  rank 0 only (as DeepSpeed's norm does), so tp ranks do not count them twice;
- expert-parallel expert parameters (`p.allreduce is False`, set when ep > 1)
  are excluded: after the all-to-all their local gradient mixes the tokens of
  every EP rank, so it is not a per-micro-batch gradient. With ep == 1 the
  experts are ordinary local parameters and are included;
- with context parallelism a rank's micro-batch gradient covers its
  sequence shard: B_small = micro_batch_size * seq_len / cp tokens.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import nn


def unbiased_estimates(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) from the mean squared norm of gradients over b_small
    samples and the squared norm of one gradient over b_big samples."""
    if not b_big > b_small > 0:
        raise ValueError(f"need b_big > b_small > 0, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    s = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, s


class NoiseScale:
    """Exponential moving averages of the two unbiased estimates and their ratio.

    `alpha` is the weight of each new estimate (0.05: a ~20-step memory). The
    averages start at zero and are bias-corrected as Adam's moments are; the
    ratio `value` needs no correction (the factors cancel).
    """

    def __init__(self, alpha: float = 0.05):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.g2_ema = 0.0
        self.s_ema = 0.0
        self.steps = 0
        self.last_g2 = math.nan
        self.last_s = math.nan

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float:
        """Add one step's measurement; returns the smoothed noise scale (units of B)."""
        g2, s = unbiased_estimates(float(small_sq), float(big_sq), float(b_small), float(b_big))
        if not (math.isfinite(g2) and math.isfinite(s)):
            return self.value  # a skipped (non-finite) step does not poison the averages
        self.last_g2, self.last_s = g2, s
        self.g2_ema += self.alpha * (g2 - self.g2_ema)
        self.s_ema += self.alpha * (s - self.s_ema)
        self.steps += 1
        return self.value

    @property
    def _debias(self) -> float:
        return 1.0 - (1.0 - self.alpha) ** self.steps if self.steps else math.nan

    @property
    def grad_sq(self) -> float:
        """Smoothed |G|^2."""
        return self.g2_ema / self._debias

    @property
    def trace_sigma(self) -> float:
        """Smoothed tr(Sigma) (per sample of the B unit)."""
        return self.s_ema / self._debias

    @property
    def value(self) -> float:
        """B_simple = tr(Sigma) / |G|^2 from the averages; nan before the first
        update or while the averaged |G|^2 is not positive."""
        if not self.steps or self.g2_ema <= 0:
            return math.nan
        return self.s_ema / self.g2_ema

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "g2_ema": self.g2_ema, "s_ema": self.s_ema, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.alpha, self.g2_ema, self.s_ema, self.steps = (
            state["alpha"], state["g2_ema"], state["s_ema"], state["steps"])


def is_expert_parallel(p: torch.Tensor) -> bool:
    """DeepSpeed's mark for expert-parallel parameters (deepspeed.moe.utils.is_moe_param)."""
    return getattr(p, "allreduce", True) is False


def is_tensor_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


def counted_params(module: nn.Module, count_replicated: bool = True) -> list[nn.Parameter]:
    """The parameters both norms cover on this rank: trainable, not expert-parallel,
    and (tp-sharded, or replicated and `count_replicated`, i.e. tp rank 0)."""
    out, seen = [], set()
    for p in module.parameters():
        if id(p) in seen or not p.requires_grad or is_expert_parallel(p):
            continue
        seen.add(id(p))
        if is_tensor_parallel(p) or count_replicated:
            out.append(p)
    return out


SQ_NORM_ROW = 4096


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """|t|^2 as a 0-dim float32 tensor, fast and accurate on large bf16 gradients.

    One vector_norm over a whole tensor accumulates serially in float32 (about
    1e-3 relative error at 16M elements) and, asked for a float32 result from
    bf16, first copies the tensor to float32. Norms of 4096-element rows,
    squared and summed in float32, are accurate to ~1e-6; with at least 1024
    rows they are taken in the tensor's own dtype, ~6x faster than the whole-
    tensor norm on a CPU and still ~1e-4 accurate (the rows' rounding errors
    average out).
    """
    flat = t.reshape(-1)
    n = flat.numel() - flat.numel() % SQ_NORM_ROW
    if n < 16 * SQ_NORM_ROW:
        return torch.linalg.vector_norm(flat, dtype=torch.float32).square()
    rows = flat[:n].view(-1, SQ_NORM_ROW)
    native = rows.shape[0] >= 1024 and t.dtype in (torch.bfloat16, torch.float16)
    norms = torch.linalg.vector_norm(rows, dim=1, dtype=None if native else torch.float32)
    return norms.float().square().sum() + torch.linalg.vector_norm(flat[n:], dtype=torch.float32).square()


class MicroGradNorms:
    """Squared norms of each micro-batch's local gradient, via tensor hooks.

    A hook on a leaf parameter sees the gradient of that one backward before it
    is accumulated into `.grad` (and before DeepSpeed reduces anything), so the
    sum of |grad|^2 over every hook call of one optimizer step, divided by the
    number of micro-batches, is the mean over micro-batches of |g_micro|^2 on
    this rank's counted parameters. `unscale` multiplies each gradient first:
    DeepSpeed's `engine.backward` divides the loss by gradient_accumulation_steps,
    so pass that (times 1/loss_scale under fp16's loss scaling).

    The value is a partial sum: sum it over the model-parallel group (tp
    shards, pipeline stages) and average it over the data-parallel ranks to
    get E|G_small|^2. Kept as a device tensor (no host sync per hook).
    """

    def __init__(self, module: nn.Module, unscale: float = 1.0, count_replicated: bool = True,
                 params: Optional[Iterable[nn.Parameter]] = None):
        self.unscale = float(unscale)
        self.params = list(params) if params is not None else counted_params(module, count_replicated)
        self._sq: Optional[torch.Tensor] = None
        self._handles = []
        self.attach()

    def attach(self) -> None:
        """Register the hooks (again after remove())."""
        if not self._handles:
            self._handles = [p.register_hook(self._hook) for p in self.params]

    def _hook(self, grad: Optional[torch.Tensor]) -> None:
        if grad is None:  # a weight whose gradient is held back (kernels/wgrad.py): it comes later, whole
            return None
        sq = squared_norm(grad.detach())
        self._sq = sq if self._sq is None else self._sq + sq
        return None  # the gradient itself is unchanged

    def take(self, micro_batches: int) -> torch.Tensor:
        """Mean over the step's `micro_batches` of |g_micro|^2 (this rank's part,
        unscaled); resets for the next step. A 0-dim float32 tensor."""
        sq = self._sq if self._sq is not None else torch.zeros((), dtype=torch.float32)
        self._sq = None
        return sq * (self.unscale ** 2) / micro_batches

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ReducedGradNorm:
    """The squared norm of the all-reduced (global-batch) gradient over the same
    parameters, read from what DeepSpeed's optimizer computes anyway.

    Both ZeRO-1 optimizers DeepSpeed picks are supported (parallel/zero.py):
    - DeepSpeedZeroOptimizer (fp32 runs; bf16 with train.grad_accum_dtype=bf16):
      `scaled_global_norm` calls `get_grad_norm_direct` once per optimizer param
      group on the averaged gradient partitions, all-reduced over the data-parallel
      and model-parallel groups. This wraps that method to keep the per-group norms;
      `take()` returns the squared sum of the groups that are not MoE groups
      (expert-parallel experts live in their own 'moe' groups when ep > 1), so no
      extra communication is needed.
    - BF16_Optimizer (bf16 with fp32 accumulation): `step` computes the norm of the
      whole, already all-reduced fp32 gradients, summed over the model-parallel
      group. Without MoE groups (ep == 1) that norm is the one wanted
      (`_global_grad_norm`). With them it adds the experts' norm inside one
      DeepSpeed call, so the non-expert part is computed here again from the
      gradients BF16_Optimizer hands its norm (`get_grads_for_norm`): one more pass
      over the dense gradients and one scalar all-reduce over the model-parallel
      group, only on steps that measure the noise scale.
    """

    def __init__(self, engine):
        from .parallel.zero import uses_bf16_optimizer
        opt = engine.optimizer
        self.opt = opt
        self._norms: list[torch.Tensor] = []
        self.active = True  # False: the optimizer's steps are not recorded (no extra pass, no collective)
        if uses_bf16_optimizer(engine):
            self._wrap_bf16(opt)
            return
        if not hasattr(opt, "get_grad_norm_direct") or not hasattr(opt, "bit16_groups"):
            raise TypeError(f"ReducedGradNorm needs DeepSpeed's ZeRO stage 1/2 optimizer or its BF16_Optimizer, "
                            f"got {type(opt).__name__}")
        self.bf16 = False
        inner = opt.get_grad_norm_direct

        def recording(gradients, params, norm_type=2):
            norm = inner(gradients, params, norm_type)
            if self.active:
                self._norms.append(norm.detach().float().reshape(()))
            return norm
        opt.get_grad_norm_direct = recording

    def _wrap_bf16(self, opt) -> None:
        self.bf16 = True
        inner = opt.get_grads_for_norm

        def recording(for_clipping=False):
            out = inner(for_clipping=for_clipping)
            if self.active and not for_clipping:  # step() asks for (dense grads, {ep group: expert grads})
                # with MoE groups the dense part is ours to compute; without, take() reads the optimizer's norm
                self._norms.append(self._dense_sq(out[0]) if opt.has_moe_layers else None)
            return out
        opt.get_grads_for_norm = recording

    def _dense_sq(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Squared norm of the non-expert gradients of every model-parallel rank (tp shards counted once
        each, replicated parameters on tp rank 0: get_grads_for_norm chose them). A device scalar."""
        import torch.distributed as dist
        sq = torch.zeros((), dtype=torch.float32, device=self.opt.fp32_groups_flat_partition[0].device)
        for g in grads:
            sq = sq + squared_norm(g)
        group = self.opt.mpu.get_model_parallel_group() if self.opt.mpu is not None else None
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        return sq

    def take(self) -> Optional[torch.Tensor]:
        """Squared global-batch gradient norm over the non-MoE groups of the last
        optimizer step (0-dim tensor, already global), or None when no norm was
        computed (e.g. an overflow step)."""
        if self.bf16:
            return self._take_bf16()
        norms, self._norms = self._norms, []
        n = len(self.opt.bit16_groups)
        if len(norms) < n:
            return None
        norms = norms[-n:]
        if any(float(x) < 0 for x in norms):  # DeepSpeed masks a non-finite norm as -1
            return None
        moe = list(getattr(self.opt, "is_moe_param_group", [False] * n))
        scale = float(getattr(self.opt, "loss_scale", 1.0) or 1.0)
        total = sum(norms[i].square() for i in range(n) if not moe[i])
        return torch.as_tensor(total, dtype=torch.float32) / scale ** 2

    def _take_bf16(self) -> Optional[torch.Tensor]:
        norms, self._norms = self._norms, []
        if not norms:
            return None  # no optimizer step since the last take()
        # BF16_Optimizer has no loss scale; on a non-finite norm it skips the step and records inf
        norm = self.opt._global_grad_norm
        if not math.isfinite(float(norm)):  # host sync: once per step, as the ZeRO path's check
            return None
        if norms[-1] is None:  # no MoE groups: the optimizer's norm is the dense one
            return torch.as_tensor(norm, dtype=torch.float32).square()
        return norms[-1]


class NoiseScaleMeter:
    """The trainer's gradient noise scale (metrics.noise_scale), measured on the steps it logs.

    A measurement costs a pass over every gradient per micro-batch (the hooks) and, at ep > 1 in bf16,
    one more over the dense gradients and a scalar all-reduce over the model-parallel group, plus two
    scalar all-reduces; on moe_1b_gpu at ep 1 that is ~16 x 5.6 GB of reads and ~20k launches a step.
    So only the steps whose figures are logged (every `every` steps, and the `last`) measure: the hooks
    are registered for those steps alone, and the averages move once per measurement. Off (or with one
    micro-batch per step, where both batch sizes are one) nothing is registered or wrapped and no
    collective is made. The steps are numbered from 1, the same on every rank, so the collectives are."""

    def __init__(self, engine, mesh, grad_accum: int, b_small: float, b_big: float, alpha: float,
                 enabled: bool = True, every: int = 1, last: int = 0):
        self.noise = NoiseScale(alpha=alpha)
        self.mesh, self.grad_accum, self.every, self.last = mesh, grad_accum, max(1, every), last
        self.batches = (b_small, b_big)
        self.enabled = enabled and b_big > b_small
        self.micro = self.reduced = None
        self.measuring = False
        if self.enabled:
            self.micro = MicroGradNorms(engine.module, unscale=grad_accum, count_replicated=mesh.index("tp") == 0)
            self.micro.remove()
            self.reduced = ReducedGradNorm(engine)
            self.reduced.active = False

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.every == 0 or step == self.last)

    def begin(self, step: int) -> None:
        """Before step `step`'s first forward: its hooks, if it measures."""
        self.measuring = self.due(step)
        if self.measuring:
            self.micro.attach()
            self.reduced.active = True

    def end(self, skipped: bool, device: torch.device) -> None:
        """After the optimizer step: McCandlish's simple estimate from the mean squared micro-batch
        gradient norm (B_small = one micro-batch) and the reduced gradient's (B_big = the global
        batch); expert-parallel experts are left out of both. Collective on measuring steps."""
        if not self.measuring:
            return
        from .parallel.comm import all_reduce_small
        self.measuring = False
        self.micro.remove()
        self.reduced.active = False
        small = self.micro.take(self.grad_accum).to(device)
        if self.mesh.group("mp") is not None:  # partial norms of tp shards and pp stages add up
            all_reduce_small(small, self.mesh.group("mp"))
        if self.mesh.group("dpcp") is not None:
            all_reduce_small(small, self.mesh.group("dpcp"))
            small /= self.mesh.size("dpcp")
        big = self.reduced.take()
        if big is not None and not skipped:
            self.noise.update(float(small), float(big), *self.batches)  # host sync, on measuring steps

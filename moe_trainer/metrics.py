"""Throughput accounting (model FLOPs, MFU), memory, and the run's metric sinks
(metrics.jsonl, TensorBoard, a console progress line)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .kernels.cpu import extension as cpu_kernels
from .config import ModelConfig

# Dense peaks (TFLOP/s, no sparsity) from vendor datasheets: bf16 tensor cores, and fp32 without TF32
# (torch's default fp32 matmul precision, "highest"). Names as torch.cuda.get_device_name gives them, the
# more specific first (an "H100 PCIe" is not an SXM H100).
GPU_PEAK_TFLOPS = {"H100 PCIe": (756.0, 51.0), "H100 NVL": (835.0, 60.0), "H200": (989.0, 67.0),
                   "H100": (989.0, 67.0), "H800": (989.0, 67.0), "A100": (312.0, 19.5), "A800": (312.0, 19.5),
                   "L40S": (362.0, 91.6), "A10G": (70.0, 31.2), "L4": (121.0, 30.3), "V100": (125.0, 15.7),
                   "MI300X": (1307.0, 163.4)}
# fp32 with TF32 allowed (torch.set_float32_matmul_precision("high")): the dense TF32 tensor-core peak
GPU_TF32_TFLOPS = {"H100 PCIe": 378.0, "H100 NVL": 418.0, "H200": 494.5, "H100": 494.5, "H800": 494.5,
                   "A100": 156.0, "A800": 156.0, "L40S": 183.0, "A10G": 35.0, "L4": 60.0, "MI300X": 653.7}


class StepClock:
    """Phase boundaries of a step without a host sync. On CUDA a mark is an event recorded on the
    current stream (the host clock would time kernel launches, not kernels), read once the step's
    one sync (the loss reduction) has passed; elsewhere the host clock."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.events = device.type == "cuda"

    def mark(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.events else b - a


def matmul_flops_per_token(cfg: ModelConfig) -> dict[str, float]:
    """Forward multiply-adds x 2 per token for the matmuls a token activates.

    MoE layers count the router, the shared experts and top-k routed experts
    only; MLA counts its real projection shapes; the embedding lookup is free
    and the output head is counted once (plus once per MTP depth).
    """
    d = cfg.hidden_size
    parts = {"attention": 0.0, "dense_ffn": 0.0, "moe": 0.0, "head": 2.0 * d * cfg.vocab_size, "mtp": 0.0}
    attn = attention_proj_params(cfg)
    ffn_dense = 3 * d * cfg.intermediate_size
    ffn_moe = (3 * d * cfg.moe_intermediate_size * (cfg.n_shared_experts + cfg.num_experts_per_tok)
               + d * cfg.n_routed_experts)
    for i in range(cfg.num_hidden_layers):
        parts["attention"] += 2.0 * attn
        if cfg.arch == "deepseek_v3" and i >= cfg.first_k_dense_replace:
            parts["moe"] += 2.0 * ffn_moe
        else:
            parts["dense_ffn"] += 2.0 * ffn_dense
    if cfg.arch == "deepseek_v3":
        per_depth = 2.0 * (attn + ffn_moe + 2 * d * d) + 2.0 * d * cfg.vocab_size
        parts["mtp"] = per_depth * cfg.num_nextn_predict_layers
    return parts


def attention_proj_params(cfg: ModelConfig) -> int:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.arch == "llama3":
        hd = cfg.head_dim or d // h
        kv = cfg.num_key_value_heads or h
        return d * h * hd * 2 + d * kv * hd * 2
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = d * h * qk if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * d


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward score + value FLOPs per token with the causal half: a query at
    position t attends to t + 1 keys, (T + 1) / 2 on average."""
    h = cfg.num_attention_heads
    if cfg.arch == "llama3":
        dqk = dv = cfg.head_dim or cfg.hidden_size // h
    else:
        dqk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    ctx = (seq_len + 1) / 2
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if cfg.arch == "deepseek_v3" else 0)
    return 2.0 * h * (dqk + dv) * ctx * layers


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward (3x forward) model FLOPs per trained token, without recomputation."""
    return 3.0 * (sum(matmul_flops_per_token(cfg).values()) + attention_flops_per_token(cfg, seq_len))


# (m, k, n): the projection shapes of a small MoE/MLA model on a few thousand tokens
ROOFLINE_SHAPES = ((4096, 512, 2048), (4096, 2048, 512), (2048, 2048, 2048))


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, shapes=ROOFLINE_SHAPES,
                          seconds: float = 1.0, trials: int = 5) -> float:
    """This rank's achieved TFLOP/s on plain matmuls (the roofline for MFU on a CPU).

    Each shape gets `trials` short timed trials (after a warm-up) within about
    `seconds` in all; the result is the best trial of the best shape. Best, not
    mean: on a shared machine a busy neighbour only ever makes a trial slower,
    so the fastest one is the closest to what the hardware sustains. On a CPU in
    fp32 with oneDNN's matmul on (cpu_kernels.onednn_linear_enabled, the GEMMs the
    model's projections and experts run), both it and torch.matmul (MKL's sgemm)
    are timed and the faster counts: the roofline is the best GEMM this rank has.
    """
    from deepspeed.accelerator import get_accelerator

    def sync():
        if device.type != "cpu":
            get_accelerator().synchronize()
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        gemms = [lambda a=a, b=b, out=out: torch.matmul(a, b, out=out)]
        if device.type == "cpu" and dtype == torch.float32 and cpu_kernels.onednn_linear_enabled():
            w = b.t().contiguous()  # (n, k), as a Linear's weight
            gemms.append(lambda a=a, w=w: cpu_kernels.onednn_linear(a, w))
        budget = seconds / (len(shapes) * len(gemms) * trials)
        for gemm in gemms:
            gemm()
            sync()
            t0 = time.perf_counter()
            gemm()
            sync()
            reps = max(1, int(budget / max(time.perf_counter() - t0, 1e-6)))
            for _ in range(trials):
                sync()
                start = time.perf_counter()
                for _ in range(reps):
                    gemm()
                sync()
                best = max(best, 2.0 * m * k * n * reps / (time.perf_counter() - start) / 1e12)
    return best


def peak_tflops(configured: Optional[float], dtype: torch.dtype, device: torch.device) -> tuple[float, str]:
    """(peak, where it came from): metrics.peak_tflops if set, else device_peak_tflops."""
    if configured:
        return configured, "config metrics.peak_tflops"
    return device_peak_tflops(dtype, device)


def datasheet_tflops(name: str, dtype: torch.dtype) -> Optional[tuple[float, str]]:
    """The datasheet peak of a GPU by its name (torch.cuda.get_device_name), or None if unknown."""
    for key, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
        if key in name:
            if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest" \
                    and key in GPU_TF32_TFLOPS:
                return GPU_TF32_TFLOPS[key], f"datasheet {key} tf32"
            if dtype == torch.float32:
                return fp32, f"datasheet {key} fp32"
            return bf16, f"datasheet {key} bf16"
    return None


def device_peak_tflops(dtype: torch.dtype, device: torch.device) -> tuple[float, str]:
    """(peak TFLOP/s of one rank, source) for MFU, the same for every run on this machine and dtype.

    A known GPU: its datasheet peak. Anything else: the matmul roofline of this rank
    (measure_matmul_tflops), measured once and cached per machine, dtype and threads per rank
    in peak_tflops.json beside the compiled kernels (MOE_TRAINER_KERNEL_DIR); delete the entry
    to measure again. Measured by one process at a time (an flock), so ranks starting together
    do not slow each other's measurement down and the later ones read the first one's."""
    if device.type == "cuda":
        known = datasheet_tflops(torch.cuda.get_device_name(device), dtype)
        if known is not None:
            return known
    path, key = _peak_cache_entry(dtype, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the holder exits, even killed
        cache = _read_json(path)
        if key not in cache:
            cache[key] = {"tflops": measure_matmul_tflops(dtype, device),
                          "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
    entry = cache[key]
    return float(entry["tflops"]), f"measured matmul {entry['measured']}, cached in {path}"


def _peak_cache_entry(dtype: torch.dtype, device: torch.device) -> tuple[Path, str]:
    """(cache file, key): the key names the CPU (model and flags) or device, the dtype, the threads
    this rank computes with, torch's version and whether oneDNN's fp32 matmul counts."""
    if device.type == "cpu":
        machine = cpu_kernels._cpu_signature()
        onednn = dtype == torch.float32 and cpu_kernels.onednn_linear_enabled()
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        machine, onednn = f"{device.type}:{name}", False
    sig = "|".join([machine, str(dtype), str(torch.get_num_threads()), torch.__version__, f"onednn={onednn}"])
    label = f"{str(dtype).removeprefix('torch.')}-{torch.get_num_threads()}threads"
    digest = hashlib.sha256(sig.encode()).hexdigest()[:12]
    return cpu_kernels.build_dir().parent / "peak_tflops.json", f"{label}-{digest}"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep records up to `last_step` (all of them when starting fresh, none of a
    previous run's tail after the resumed checkpoint); atomic rewrite."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


class Interval:
    """Sums of the steps since the last log step. Throughput, MFU and the step-time split are
    reported as means over them: one step's own figure swings with whatever else the machine did
    during it (2,935 / 6,573 / 3,345 tokens/s at three log steps of one run)."""

    def __init__(self):
        self.steps, self.sums = 0, {}

    def add(self, figures: dict) -> None:
        self.steps += 1
        for k, v in figures.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def take(self) -> tuple[int, dict]:
        """(steps, each figure's mean over them), and a new interval begins."""
        steps, means = self.steps, {k: v / max(self.steps, 1) for k, v in self.sums.items()}
        self.steps, self.sums = 0, {}
        return steps, means


class MetricSink:
    """metrics.jsonl + TensorBoard + console, written by one rank."""

    def __init__(self, out_dir: Path, tensorboard: bool, max_steps: int, resume_step: int = 0):
        self.out_dir = Path(out_dir)
        _truncate_jsonl(self.out_dir / "metrics.jsonl", resume_step)
        self.jsonl = open(self.out_dir / "metrics.jsonl", "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: events an interrupted run logged after the checkpoint are dropped
            self.tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        self.max_steps = max_steps
        self.start = time.time()
        self.first_step: Optional[int] = None

    def log(self, step: int, record: dict, tb_prefix: str = "") -> None:
        record = {"step": step, **record, "wall_time": time.time()}  # seconds since the epoch, as TensorBoard's
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("step", "wall_time") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(tb_prefix + key.replace(".", "/"), value, step)
                elif isinstance(value, dict):  # a map of numbers (source_samples): one scalar per entry
                    for sub, v in value.items():
                        if isinstance(v, (int, float)) and math.isfinite(v):
                            self.tb.add_scalar(f"{tb_prefix}{key.replace('.', '/')}/{sub}", v, step)
            self.tb.flush()

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        if self.tb is not None:
            self.tb.add_histogram(tag, values, step)

    def progress(self, step: int, record: dict) -> None:
        """The console line of a log step. Its ETA is the time per step since this start's first
        log step times the steps left: the first line has no interval to time, so it shows none."""
        if self.first_step is None:
            self.first_step, self.start = step, time.time()
        parts = [f"step {step}/{self.max_steps}", f"loss {record.get('loss', float('nan')):.4f}"]
        if "val_loss" in record:
            parts.append(f"val {record['val_loss']:.4f}")
        if "tokens_per_s" in record:
            parts.append(f"{record['tokens_per_s']:.0f} tok/s")
        if "mfu" in record:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        if "step_time_s" in record and "time.forward_s" in record:
            split = ", ".join(f"{name} {record[f'time.{key}_s']:.3f}" for name, key in (
                ("data", "data"), ("fwd", "forward"), ("bwd", "backward"), ("opt", "optimizer"))
                if f"time.{key}_s" in record)
            parts.append(f"{record['step_time_s']:.3f} s/step ({split})")
        if record.get("interval_steps", 1) > 1:
            parts.append(f"means of {record['interval_steps']} steps")
        if step > self.first_step:
            eta = (time.time() - self.start) / (step - self.first_step) * (self.max_steps - step)
            parts.append(f"ETA {eta / 60:.1f} min")
        print(" | ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()

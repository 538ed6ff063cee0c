"""One typed config tree: YAML file + typed `--set a.b=v` overrides + validation.

Every error is a `ConfigError` whose message is one sentence naming the key and
what would be valid. Validation runs before any process group is made.

The ground floor: it reads nothing but its YAML and imports nothing of the package.
What a config names outside it (a Hugging Face train.init_from, vocab_size auto, the
data's sources and tokenizer, debug.faults) is resolved and checked a floor above, in
resolve.py, which train, restart, the dry run and the tools call (resolve.load_config).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml


class ConfigError(ValueError):
    """Bad configuration: the message is a single user-facing sentence."""


@dataclass
class RunConfig:
    out_dir: str = "runs/moe_tiny"  # run directory (DESIGN.md)
    seed: int = 1234  # same seed -> same initial weights and batches on any layout


@dataclass
class ModelConfig:
    """Architecture. Field names follow the Hugging Face config of each arch."""

    arch: str = "deepseek_v3"  # deepseek_v3 | llama3
    # auto: the data's vocabulary (index.json's vocab_size, already padded to a multiple of 64: 320 for the
    # byte-level default corpus); an explicit value must be at least that
    vocab_size: Union[int, str] = "auto"
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: Optional[int] = None  # llama3 GQA; None = num_attention_heads
    head_dim: Optional[int] = None  # llama3; None = hidden_size // num_attention_heads
    intermediate_size: int = 1024  # dense FFN hidden size
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling as Hugging Face's `rope_parameters` minus rope_theta, e.g.
    # {rope_type: yarn, factor: 40, original_max_position_embeddings: 4096, mscale: 1, mscale_all_dim: 1}
    # or {rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192}
    rope_scaling: Optional[dict] = None
    rope_interleave: bool = True  # deepseek_v3: rotary dims stored as interleaved pairs
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_bias: bool = False
    # --- multi-head latent attention (deepseek_v3)
    q_lora_rank: Optional[int] = 64  # None = plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    # --- DeepSeekMoE
    first_k_dense_replace: int = 1  # the first k layers use a dense FFN
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    moe_intermediate_size: int = 128
    n_group: int = 4  # routed experts split into groups; a token picks topk_group groups
    topk_group: int = 2
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"  # sigmoid | softmax
    # aux-loss-free balancing: bias += gamma * sign(mean_load - load) after each step
    bias_update_speed: float = 0.001
    seq_aux_loss_alpha: float = 0.0  # sequence-wise balance loss weight (paper: 0.0001)
    router_z_loss_coef: float = 0.0
    capacity_factor: Optional[float] = None  # None = dropless
    moe_impl: str = "grouped"  # grouped (fast) | loop (reference)
    # --- multi-token prediction
    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.3


@dataclass
class TrainConfig:
    max_steps: int = 300
    seq_len: int = 128
    micro_batch_size: int = 8
    global_batch_size: int = 16  # sequences per optimizer step, whatever the layout
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "auto"  # auto (bf16 on accelerators, fp32 on CPU ranks) | fp32 | bf16
    # bf16 runs: the dtype micro-batch gradients are summed and data-parallel reduced in: fp32 (DeepSpeed's
    # BF16_Optimizer, fp32 gradients of the whole model: +4 bytes/param) | bf16 (summed in bf16 param.grad)
    grad_accum_dtype: str = "fp32"
    # regional torch.compile of each decoder layer and of the head and loss (moe_trainer/compile.py):
    # auto = on CUDA, off on CPU ranks (one H200, moe_1b_gpu: 1.98x eager's tokens/s after a 28 s first
    # step; on CPU ranks compiling costs a minute for 0.7-1.1x, docs/BENCHMARKS.md) | true | false
    compile: Union[bool, str] = "auto"
    # inductor (code generation: what runs fast) | aot_eager (dynamo + AOTAutograd, the same graphs run
    # op by op: what the CPU tests run, and a way to tell a tracing bug from a code-generation bug)
    compile_backend: str = "inductor"
    checkpoint_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | none | <checkpoint path>
    # start from these weights: a Hugging Face directory, our safetensors, a run checkpoint. A Hugging Face
    # directory's config.json gives the model section: the config may leave out model fields (or the whole
    # section) and gets the directory's; a model field it writes must agree with config.json, unless it only
    # shapes training (bias_update_speed, moe_impl, max_position_embeddings, ...). The run directory's
    # config.yaml records the model resolved so.
    init_from: str = ""
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    max_nan_skips: int = 3  # consecutive non-finite losses skipped before stopping
    # silent data corruption: every N steps, before the forward, the data-parallel replicas' weights are
    # compared by checksum and a differing copy repaired from the ZeRO-1 owners (faults.py); 0 = never
    replica_check_every: int = 100
    # a loss above 2x the median of the last 16 steps (or a gradient norm above 10x theirs) rolls back to
    # the last checkpoint before it and skips the batches that led into it; a second spike stops the run
    spike_guard: bool = True
    straggler_factor: float = 1.5  # a rank whose compute per step exceeds this x the median is named
    stop_at_step: Optional[int] = None  # end this job after that step (checkpoint written), keeping
    #                                    max_steps' LR schedule: for time-boxed allocations
    keep_freed_memory: bool = True  # CPU ranks on glibc: freed memory stays in the process for reuse
    #                                 instead of going back to the OS (no page faults on every step)
    # keys a resume may change although they change what is trained (run_dir.RESUMABLE lists those it
    # may always change), e.g. [train.global_batch_size, train.lr]
    resume_allow: list = field(default_factory=list)


@dataclass
class ParallelConfig:
    pp: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1
    micro_batches: int = 0  # per pipeline step; 0 = global_batch / (micro_batch * dp)
    sequence_parallel: bool = True  # with tp > 1
    dedup_dispatch: bool = False  # send a token's hidden state to a rank once
    # expert all-to-alls between CPU ranks (gloo) of one host: shm (through /dev/shm rings; gloo
    # wherever that cannot work) | gloo
    cpu_alltoall: str = "shm"
    # the pipeline stages' transfers between CPU ranks of one host: shm (through /dev/shm rings; gloo
    # wherever that cannot work) | gloo (batch_isend_irecv, the calls GPU ranks make on NCCL)
    cpu_p2p: str = "shm"
    recompute: str = "none"  # none | selective | full
    schedule: str = "1f1b"  # pipeline order: 1f1b (interleaved when virtual_stages > 1) | gpipe (the reference)
    virtual_stages: int = 1  # chunks per pipeline rank (v): rank s holds chunks s, s + pp, ...; > 1: interleaved
    pp_partition: Optional[list] = None  # layers per stage (pp * virtual_stages of them), e.g. [2, 3]; None = balanced
    timeout_s: int = 300  # collective timeout: a dead rank ends the job
    # GPUs (ranks) per node: 0 = the launcher's LOCAL_WORLD_SIZE (one node when there is none). The
    # rank order keeps TP and EP groups inside a node; the planner and the dry run read it from here
    gpus_per_node: int = 0
    # auto: MOE_ORDER for deepseek_v3, DENSE_ORDER for llama3; or an order such as tp-cp-pp-dp
    rank_order: str = "auto"
    # expert placement plan (tools/expert_load.py plan): none | <plan JSON> | auto (<run.out_dir>/
    # expert_placement.json when it exists at start or resume, written by `expert_load.py plan --apply`)
    expert_placement: str = "auto"
    # a2a: the expert all-to-alls of one micro-batch in flight while another computes (parallel/overlap.py;
    # deepseek_v3, ep > 1, tp = cp = 1, pp = 1 or interleaved 1F1B); none: every
    # all-to-all waited for where it is issued; auto: a2a where it runs on GPUs and the run stays eager
    # (train.compile false), else none (resolve.py check_overlap and overlap_runs, train.resolve_device_settings:
    # a compiled run keeps its measured compiled path; between CPU ranks the shared-memory exchange has nothing
    # to hide, it runs when waited for)
    overlap: str = "auto"
    # online re-placement (parallel/slots.py): every N optimizer steps the experts' slots may move between
    # EP ranks (weights and optimizer state) to balance the load measured since the last placement; 0 = off.
    # replace_policy: auto (move when the predicted saving over N steps exceeds the move's cost) | always
    # (whenever the search finds another placement) | rotate (a drill: every expert moves each time)
    replace_every: int = 0
    replace_policy: str = "auto"
    # redundant slots per EP rank (with replace_every): copies of other ranks' busy experts, routed to like
    # their owners; weights refreshed once per optimizer step, gradients summed over the step's micro-batches
    # and sent to the owner once, before the gradient reduction
    redundant_slots: int = 0


@dataclass
class DataConfig:
    path: str = ""  # tools/prepare_data.py token files or a Megatron PREFIX (.bin + .idx); empty = default corpus
    val_fraction: float = 0.02  # a Megatron prefix: the share of its last documents kept for validation
    tokenizer: str = ""  # tokenizer.json or a Hugging Face tokenizer directory: a Megatron prefix's vocabulary and EOS
    # attention stays inside each document of a packed window (documents end at the data's end-of-text id)
    document_mask: bool = False
    position_reset: bool = False  # with document_mask: RoPE positions restart at 0 at each document
    # a weighted mixture instead of data.path: [{path, weight, name}], token directories or Megatron prefixes of
    # one tokenizer; name defaults to the path's basename (metrics' source_samples and val_loss/<name> use it)
    sources: list = field(default_factory=list)
    # validation sets of a mixture, [{path, name}], each one's val split; empty = each source's own val split
    val_sources: list = field(default_factory=list)


@dataclass
class MetricsConfig:
    peak_tflops: Optional[float] = None  # per rank; None = measured (CPU) or datasheet (GPU)
    tensorboard: bool = True
    # the gradient noise scale (critical batch size), measured on the logged steps (train.log_every) only:
    # each measurement re-reads every gradient per micro-batch; false: no hooks and no collectives at all
    noise_scale: bool = True
    noise_scale_alpha: float = 0.05  # EMA weight of each measurement of it


@dataclass
class DebugConfig:
    trace_pipeline: bool = False  # write pipeline_trace.json/png of the last step
    # [first, last]: steps (1-based, inclusive) run under torch.profiler on the ranks profile_ranks lists; each
    # writes its Chrome trace and a summary (device busy by kind, idle) into <out_dir>/profile/ (profiling.py).
    # [] = off
    profile_steps: list = field(default_factory=list)
    profile_ranks: list = field(default_factory=lambda: [0])
    inject_nan_steps: Optional[list] = None  # fault drill: make the loss NaN at these steps (1-based)
    # faults injected on purpose (faults.py), each fired once per run directory: KIND@STEP[:RANK] with KIND
    # bitflip | spike | hang | slow | kill | nan, e.g. [bitflip@3:1, spike@9]
    faults: list = field(default_factory=list)
    # the emulated link (parallel/link.py), benchmarks and tests only: every EP all-to-all completes no earlier
    # than link_latency_us + bytes / link_gbps after it was issued; 0 = off
    link_gbps: float = 0.0
    link_latency_us: float = 0.0
    # skewed routing on purpose (re-placement tests and scripts/bench_replace.sh): every MoE layer's balancing
    # biases start at route_skew * (1 - 2 e / (E - 1)) (expert 0 favoured most), not 0; with
    # model.bias_update_speed=0 they stay. 0 = off
    route_skew: float = 0.0


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


CHOICES = {
    "model.arch": ("deepseek_v3", "llama3"),
    "model.hidden_act": ("silu",),
    "model.scoring_func": ("sigmoid", "softmax"),
    "model.moe_impl": ("grouped", "loop"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "train.grad_accum_dtype": ("fp32", "bf16"),
    "train.compile": ("auto", True, False),
    "train.compile_backend": ("inductor", "aot_eager"),
    "parallel.recompute": ("none", "selective", "full"),
    "parallel.schedule": ("1f1b", "gpipe"),
    "parallel.cpu_alltoall": ("shm", "gloo"),
    "parallel.cpu_p2p": ("shm", "gloo"),
    "parallel.overlap": ("auto", "none", "a2a"),
    "parallel.replace_policy": ("auto", "always", "rotate"),
}


# ----------------------------------------------------------------------------- parsing

def _field_type(cls, name: str):
    return typing.get_type_hints(cls)[name]


def is_number(value) -> bool:
    """An int or a float, not a bool (YAML's and JSON's true is an int to Python)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _coerce(key: str, value: Any, tp) -> Any:
    """Check `value` against the annotated type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for arg in args[1:]:  # Union[int, str]: the first type that takes the value
            if arg is str and isinstance(value, str) or arg is not str and _fits(value, arg):
                return _coerce(key, value, arg)
        return _coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if is_number(value):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    elif tp is list or origin is list:
        if isinstance(value, list):
            return value
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{key} must be of type {name}, got {value!r}.")


def _fits(value: Any, tp) -> bool:
    try:
        _coerce("", value, tp)
        return True
    except ConfigError:
        return False


def _apply(section_obj, prefix: str, values: dict) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'the config'} must be a mapping of keys, got {values!r}.")
    names = [f.name for f in dataclasses.fields(section_obj)]
    for key, value in values.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown key {full}; valid keys here are: {', '.join(names)}.")
        current = getattr(section_obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, full, value)
        else:
            setattr(section_obj, key, _coerce(full, value, _field_type(type(section_obj), key)))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=v` -> (['a', 'b'], v) with v parsed as YAML (so 3, 0.1, true, null, [1,2] work)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value (e.g. train.max_steps=20), got {text!r}.")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def read_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Defaults <- YAML file <- `--set` overrides, typed; not yet resolved nor validated
    (resolve.load_config resolves what needs files, then validates)."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist.")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML ({str(e).splitlines()[0]}).") from None
        _apply(cfg, "", data)
    for text in overrides or []:
        keys, value = parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, "", nested)
    return cfg


def typed_config(data: dict) -> Config:
    """A config tree from nested dicts ({'model': {...}, ...}), typed; not yet resolved nor validated."""
    cfg = Config()
    _apply(cfg, "", data)
    return cfg


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; dict-valued fields (model.rope_scaling) stay whole."""
    out = {}
    for key, value in tree.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and not prefix:
            out.update(flatten(value, full))
        else:
            out[full] = value
    return out


def given_keys(path: Optional[str], overrides: Optional[list[str]]) -> set[str]:
    """The keys a command sets itself (in its YAML file or a --set), as opposed to the defaults."""
    return set(given_values(path, overrides))


def given_values(path: Optional[str], overrides: Optional[list[str]]) -> dict[str, Any]:
    """given_keys with the values as the command wrote them, before `auto` is resolved (the later
    --set wins; a --set below a key, model.rope_scaling.factor=8, gives the key as None: written in part)."""
    values: dict[str, Any] = {}
    if path and Path(path).is_file():
        values.update(flatten(yaml.safe_load(Path(path).read_text()) or {}))
    for text in overrides or []:
        parts, value = parse_override(text)
        if len(parts) == 1 and isinstance(value, dict):
            values.update(flatten(value, parts[0]))
        else:
            values[".".join(parts[:2])] = value if len(parts) <= 2 else None
    return values


# ----------------------------------------------------------------------------- validation

def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    """Checks that need no process group (world-size checks: `validate_layout`)."""
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _require(value in choices, f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}.")
    m, t, p = cfg.model, cfg.train, cfg.parallel
    derived = m.vocab_size == "auto"  # load_config(resolve_data=False): resolved by a resume's merge
    _require(derived or isinstance(m.vocab_size, int),
             f"model.vocab_size must be a positive integer or auto, got {m.vocab_size!r}.")
    positive = {
        **({} if derived else {"model.vocab_size": m.vocab_size}), "model.hidden_size": m.hidden_size,
        "model.num_hidden_layers": m.num_hidden_layers, "model.num_attention_heads": m.num_attention_heads,
        "model.intermediate_size": m.intermediate_size, "train.seq_len": t.seq_len,
        "train.micro_batch_size": t.micro_batch_size, "train.global_batch_size": t.global_batch_size,
        "train.max_steps": t.max_steps, "train.log_every": t.log_every,
        "parallel.pp": p.pp, "parallel.ep": p.ep, "parallel.tp": p.tp, "parallel.cp": p.cp,
        "parallel.virtual_stages": p.virtual_stages, "parallel.timeout_s": p.timeout_s,
    }
    for key, value in positive.items():
        _require(value > 0, f"{key} must be a positive integer, got {value}.")
    for key, value in {"train.lr": t.lr, "train.min_lr": t.min_lr, "train.warmup_steps": t.warmup_steps,
                       "train.checkpoint_every": t.checkpoint_every, "train.eval_every": t.eval_every,
                       "train.keep_checkpoints": t.keep_checkpoints, "parallel.micro_batches": p.micro_batches,
                       "model.num_nextn_predict_layers": m.num_nextn_predict_layers,
                       "parallel.gpus_per_node": p.gpus_per_node}.items():
        _require(value >= 0, f"{key} must be >= 0, got {value}.")
    dims = p.rank_order.split("-")
    valid_order = sorted(dims) == ["cp", "dp", "pp", "tp"] and dims.index("cp") < dims.index("dp")
    _require(p.rank_order == "auto" or valid_order,
             f"parallel.rank_order must be auto or the four dimensions tp, cp, pp, dp joined by '-', innermost "
             f"first, cp inside dp (expert groups borrow (cp, dp) ranks; e.g. {MOE_ORDER}), got {p.rank_order!r}.")
    _require(t.replica_check_every >= 0, f"train.replica_check_every must be >= 0, got {t.replica_check_every}.")
    _require(t.straggler_factor > 1, f"train.straggler_factor must be above 1, got {t.straggler_factor}.")
    _require(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be at least 1, got {t.keep_checkpoints}.")
    _require(0.0 < cfg.data.val_fraction < 0.5, f"data.val_fraction must be in (0, 0.5), got {cfg.data.val_fraction}.")
    _require(cfg.data.document_mask or not cfg.data.position_reset,
             "data.position_reset needs data.document_mask: true (positions restart at documents that attention "
             "keeps apart); set both, or drop data.position_reset.")
    _require(t.seq_len + m.num_nextn_predict_layers <= m.max_position_embeddings or m.arch == "llama3",
             f"train.seq_len ({t.seq_len}) must not exceed model.max_position_embeddings ({m.max_position_embeddings}).")
    _require(t.global_batch_size % t.micro_batch_size == 0,
             f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
             f"({t.micro_batch_size}).")
    if m.arch == "deepseek_v3":
        _validate_deepseek(m)
    else:
        _validate_llama(m, p)
    _require(p.ep == 1 or m.arch == "deepseek_v3", "parallel.ep must be 1 for model.arch llama3 (a dense model).")
    _require(p.ep == 1 or p.tp == 1, "parallel.ep and parallel.tp cannot both exceed 1 (the MoE layout uses no TP).")
    _require(t.seq_len % (2 * p.cp) == 0 or p.cp == 1,
             f"train.seq_len ({t.seq_len}) must be divisible by 2 * parallel.cp ({2 * p.cp}).")
    _require(m.num_hidden_layers >= p.pp,
             f"model.num_hidden_layers ({m.num_hidden_layers}) must be at least parallel.pp ({p.pp}).")
    _require(p.virtual_stages == 1 or p.pp > 1,
             f"parallel.virtual_stages ({p.virtual_stages}) needs parallel.pp > 1 (chunks interleave across "
             f"pipeline ranks).")
    _require(m.num_hidden_layers >= p.pp * p.virtual_stages,
             f"parallel.pp * parallel.virtual_stages ({p.pp} * {p.virtual_stages} = {p.pp * p.virtual_stages} "
             f"chunks) must not exceed model.num_hidden_layers ({m.num_hidden_layers}): every chunk needs a layer.")
    _require(p.expert_placement.strip() != "",
             "parallel.expert_placement must be none, auto or the path of a plan JSON, got an empty string.")
    _require(p.replace_every >= 0, f"parallel.replace_every must be >= 0 (0 = off), got {p.replace_every}.")
    _require(p.replace_every == 0 or p.ep > 1,
             f"parallel.replace_every ({p.replace_every}) moves experts between EP ranks; it needs parallel.ep > 1.")
    _require(p.redundant_slots == 0 or (p.replace_every > 0 and 0 < p.redundant_slots <= m.n_routed_experts // p.ep),
             f"parallel.redundant_slots ({p.redundant_slots}) are copies placed by the online re-placement: they "
             f"need parallel.replace_every > 0 and at most n_routed_experts / ep "
             f"({m.n_routed_experts // max(1, p.ep)}) a rank.")
    _require(p.replace_every == 0 or p.expert_placement in ("none", "auto"),
             f"parallel.replace_every places the experts itself; set parallel.expert_placement to none, not "
             f"{p.expert_placement}.")
    _validate_profile(cfg.debug, t)
    if p.pp_partition is not None:
        chunks = p.pp * p.virtual_stages
        _require(len(p.pp_partition) == chunks and all(isinstance(n, int) and n >= 1 for n in p.pp_partition)
                 and sum(p.pp_partition) == m.num_hidden_layers,
                 f"parallel.pp_partition must list {chunks} positive layer counts (parallel.pp * "
                 f"parallel.virtual_stages, in model order) summing to {m.num_hidden_layers}, got {p.pp_partition}.")
    if m.rope_scaling is not None:
        kind = m.rope_scaling.get("rope_type", m.rope_scaling.get("type"))
        _require(kind in ("yarn", "llama3", "default"),
                 f"model.rope_scaling.rope_type must be one of yarn, llama3, default, got {kind!r}.")
        for key, value in m.rope_scaling.items():
            _require(key in ("rope_type", "type", "truncate") or value is None or is_number(value),
                     f"model.rope_scaling.{key} must be a number, got {value!r}.")


def _validate_profile(d: DebugConfig, t: TrainConfig) -> None:
    steps, ranks = d.profile_steps, d.profile_ranks
    ints = all(isinstance(n, int) and not isinstance(n, bool) for n in [*steps, *ranks])
    _require(steps == [] or (ints and len(steps) == 2 and 1 <= steps[0] <= steps[1]),
             f"debug.profile_steps must be [] (off) or [first, last], two steps with 1 <= first <= last, got {steps}.")
    _require(not steps or steps[1] <= t.max_steps,
             f"debug.profile_steps ends at step {steps[-1] if steps else 0}, after train.max_steps ({t.max_steps}).")
    _require(ints and len(ranks) > 0 and all(r >= 0 for r in ranks),
             f"debug.profile_ranks must list the ranks to profile (integers >= 0), got {ranks}.")


def _validate_deepseek(m: ModelConfig) -> None:
    moe = m.num_hidden_layers > m.first_k_dense_replace
    _require(m.first_k_dense_replace >= 0, "model.first_k_dense_replace must be >= 0.")
    if moe:
        _require(m.n_routed_experts > 0, "model.n_routed_experts must be positive when the model has MoE layers.")
        _require(1 <= m.num_experts_per_tok <= m.n_routed_experts,
                 f"model.num_experts_per_tok must be between 1 and n_routed_experts ({m.n_routed_experts}), "
                 f"got {m.num_experts_per_tok}.")
        _require(m.n_group >= 1 and m.n_routed_experts % m.n_group == 0,
                 f"model.n_group ({m.n_group}) must divide model.n_routed_experts ({m.n_routed_experts}).")
        _require(1 <= m.topk_group <= m.n_group,
                 f"model.topk_group must be between 1 and n_group ({m.n_group}), got {m.topk_group}.")
        per_group = m.n_routed_experts // m.n_group
        _require(m.n_group == 1 or per_group >= 2,
                 f"model.n_group ({m.n_group}) leaves fewer than 2 experts per group; group scores sum each "
                 f"group's top-2 experts.")
        _require(m.topk_group * per_group >= m.num_experts_per_tok,
                 f"model.topk_group ({m.topk_group}) groups of {per_group} experts cannot supply "
                 f"num_experts_per_tok ({m.num_experts_per_tok}) experts.")
        _require(m.moe_intermediate_size > 0, "model.moe_intermediate_size must be positive.")
        _require(m.n_shared_experts >= 0, "model.n_shared_experts must be >= 0.")
        _require(m.capacity_factor is None or m.capacity_factor > 0,
                 f"model.capacity_factor must be positive or null (dropless), got {m.capacity_factor}.")
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        _require(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}.")
    _require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim must be even, got {m.qk_rope_head_dim}.")
    _require(m.q_lora_rank is None or m.q_lora_rank > 0, "model.q_lora_rank must be positive or null.")


def _validate_llama(m: ModelConfig, p: ParallelConfig) -> None:
    kv = m.num_key_value_heads or m.num_attention_heads
    _require(m.num_attention_heads % kv == 0,
             f"model.num_key_value_heads ({kv}) must divide model.num_attention_heads ({m.num_attention_heads}).")
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    _require(head_dim % 2 == 0, f"the llama3 head dimension must be even for RoPE, got {head_dim}.")
    _require(m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0,
             f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_attention_heads "
             f"({m.num_attention_heads}) unless model.head_dim is set.")
    _require(m.num_attention_heads % p.tp == 0,
             f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by parallel.tp ({p.tp}).")
    _require(kv % p.tp == 0 or p.tp % kv == 0,
             f"model.num_key_value_heads ({kv}) must be divisible by parallel.tp ({p.tp}) or divide it.")
    _require(m.intermediate_size % p.tp == 0,
             f"model.intermediate_size ({m.intermediate_size}) must be divisible by parallel.tp ({p.tp}).")
    _require(m.vocab_size == "auto" or m.vocab_size % p.tp == 0,
             f"model.vocab_size ({m.vocab_size}) must be divisible by parallel.tp ({p.tp}).")


# Rank orders, innermost (fastest-varying) dimension first. MoE: Megatron-Core's tp-cp-ep-dp-pp, where
# ep borrows the (cp, dp) ranks of one stage: TP and then EP groups are neighbouring ranks, inside a
# node whenever they fit, and the pipeline (the lightest traffic) is outermost, across nodes. Dense:
# Llama 3's [tp, cp, pp, dp], data parallel outermost (its gradient reduction overlaps the backward).
MOE_ORDER = "tp-cp-dp-pp"
DENSE_ORDER = "tp-cp-pp-dp"


def rank_order(p: "ParallelConfig", arch: str) -> str:
    if p.rank_order != "auto":
        return p.rank_order
    return MOE_ORDER if arch == "deepseek_v3" else DENSE_ORDER


@dataclass(frozen=True)
class Layout:
    """Degrees of one run, derived from the world size and `parallel.*`."""

    world: int
    pp: int
    tp: int
    cp: int
    dp: int
    ep: int
    edp: int  # expert-data-parallel degree: dp * cp / ep
    grad_accum: int  # micro-batches per optimizer step on each data-parallel rank
    order: str = MOE_ORDER  # rank order, innermost first (parallel/mesh.py)
    gpus_per_node: int = 0  # ranks per node; 0 = the whole world on one node

    @property
    def node_size(self) -> int:
        return self.gpus_per_node or self.world


def validate_layout(cfg: Config, world_size: int, local_world_size: Optional[int] = None) -> Layout:
    """Checks that need the world size; raise before any process group is used. The node size is
    parallel.gpus_per_node, else the launcher's `local_world_size`, else the whole world."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    node = p.gpus_per_node or min(local_world_size or world_size, world_size)
    _require(world_size % node == 0 or node >= world_size,
             f"parallel.gpus_per_node ({node}) must divide the world size ({world_size}): every node holds the "
             f"same number of ranks.")
    model_par = p.pp * p.tp * p.cp
    _require(world_size % model_par == 0,
             f"the world size ({world_size}) must be a multiple of parallel.pp * parallel.tp * parallel.cp "
             f"({model_par}).")
    dp = world_size // model_par
    _require((dp * p.cp) % p.ep == 0,
             f"parallel.ep ({p.ep}) must divide the data-parallel size times parallel.cp ({dp * p.cp}); "
             f"expert parallelism borrows data-parallel ranks.")
    if m.arch == "deepseek_v3" and m.num_hidden_layers > m.first_k_dense_replace:
        _require(m.n_routed_experts % p.ep == 0,
                 f"model.n_routed_experts ({m.n_routed_experts}) must be divisible by parallel.ep ({p.ep}).")
    _require(max(cfg.debug.profile_ranks) < world_size,
             f"debug.profile_ranks ({cfg.debug.profile_ranks}) must name ranks below the world size ({world_size}).")
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size % per_step == 0,
             f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size * "
             f"data-parallel size ({t.micro_batch_size} * {dp} = {per_step}).")
    grad_accum = t.global_batch_size // per_step
    _require(p.micro_batches in (0, grad_accum),
             f"parallel.micro_batches ({p.micro_batches}) must be 0 or global_batch_size / (micro_batch_size * dp) "
             f"= {grad_accum}.")
    _require(p.virtual_stages == 1 or grad_accum % p.pp == 0,
             f"parallel.micro_batches ({grad_accum} = global_batch_size / (micro_batch_size * dp)) must be a "
             f"multiple of parallel.pp ({p.pp}) with parallel.virtual_stages > 1 (the interleaved order sends "
             f"micro-batches through in groups of pp).")
    return Layout(world=world_size, pp=p.pp, tp=p.tp, cp=p.cp, dp=dp, ep=p.ep,
                  edp=dp * p.cp // p.ep, grad_accum=grad_accum, order=rank_order(p, m.arch),
                  gpus_per_node=min(node, world_size))


def ceil_to(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)

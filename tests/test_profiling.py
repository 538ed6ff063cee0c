"""debug.profile_steps: the trace's summary (profiling.summarize) against hand-made traces, the config's
sentences, and a real 2-rank run whose profiled steps are held against its own logged steps and read back
by tools/plan.py --time --profile."""
import gzip
import json
import subprocess
import sys

import pytest
import torch

from moe_trainer.config import ConfigError, validate, validate_layout
from moe_trainer.profiling import STEP_RANGE, StepProfiler, kind_of, read_summaries, summarize
from moe_trainer.resolve import load_config

from conftest import ROOT, TINY, check, launch, read_metrics


def x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": tid}


def step(n: int, ts: float, dur: float) -> dict:
    return x(f"{STEP_RANGE}{n}", ts, dur, "user_annotation")


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"), ("aten::mm", "gemm"), ("aten::_grouped_mm", "gemm"),
    ("mkldnn::_linear_pointwise", "gemm"), ("ThreadedCPUExpertsBackward", "gemm"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("shm_collective::shm_all_to_all", "communication"), ("c10d::allreduce_", "communication"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false>>", "attention"),
    ("aten::_scaled_dot_product_flash_attention", "attention"), ("ExplicitCausalAttentionBackward", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    # names as CUPTI gives them (checked against public Kineto traces, e.g. Holistic Trace Analysis' samples):
    # the kernel's own name decides, not its template arguments or parameters
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x64_32x6_nt_align1>(cutlass_80_tensorop_s1688gemm_"
     "128x64_32x6_nt_align1::Params)", "gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal"
     "<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >>>>(int)", "gemm"),
    ("ampere_sgemm_128x64_nn", "gemm"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("void split_embedding_codegen_forward_unweighted_kernel<c10::Half, c10::Half, float, false, long, 256>("
     "fbgemm_gpu::TensorAccessor<c10::Half, 2ul>)", "other"),
    ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int, decltype(nullptr)>(int, int, int)", "other"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("triton_poi_fused_add_cos_sin_0", "other"),
    ("aten::copy_", "other"), ("aten::broadcast_tensors", "other"), ("c10d::broadcast_", "communication"), ("Memcpy DtoD (Device -> Device)", "other"), ("aten::mul", "other"),
])
def test_kinds_by_name(name, kind):
    assert kind_of(name) == kind


def test_gpu_trace_busy_is_the_union_of_kernels_and_idle_the_rest():
    """Kernels on two streams overlap: busy counts the time covered once, each kind its kernels' whole
    time; kernels outside a step's range are not its."""
    trace = {"traceEvents": [
        step(1, 0, 1000), step(2, 1000, 500),
        x("sm90_xmma_gemm_bf16", 100, 300, "kernel", tid=7),              # 100-400
        x("ncclDevKernel_AllToAll", 300, 200, "kernel", tid=8),           # 300-500, overlaps the GEMM
        x("flash_fwd_kernel", 600, 100, "kernel", tid=7),                 # 600-700
        x("Memcpy DtoH (Device -> Pinned)", 900, 50, "gpu_memcpy", tid=7),
        x("aten::mm", 100, 20),                                           # a host operator: not device work
        x("sm90_xmma_gemm_bf16", 1100, 200, "kernel", tid=7),             # step 2
        x("elementwise_kernel", 2000, 100, "kernel", tid=7),              # after both steps
    ]}
    s = summarize(trace)
    assert s["device"] == "gpu"
    one, two = s["steps"]
    assert (one["step"], two["step"]) == (1, 2)
    assert one["wall_s"] == pytest.approx(1000e-6)
    assert one["busy_s"] == pytest.approx((400 + 100 + 50) * 1e-6)  # 100-500, 600-700, 900-950
    assert one["idle_s"] == pytest.approx(450e-6)
    assert (one["gemm_s"], one["communication_s"], one["attention_s"], one["other_s"]) == pytest.approx(
        (300e-6, 200e-6, 100e-6, 50e-6))
    assert one["kernels"] == 4
    assert (two["busy_s"], two["idle_s"], two["kernels"]) == pytest.approx((200e-6, 300e-6, 1))
    assert s["mean"]["wall_s"] == pytest.approx(750e-6)
    # the longest kernels over the window, per step: the two GEMMs first (500 us in 2 launches over 2 steps)
    assert s["top"][0] == {"name": "sm90_xmma_gemm_bf16", "kind": "gemm", "s_per_step": pytest.approx(250e-6),
                           "per_step": 1.0}
    assert [t["name"] for t in s["top"]][1:] == ["ncclDevKernel_AllToAll", "flash_fwd_kernel",
                                                 "Memcpy DtoH (Device -> Pinned)"]


def test_cpu_trace_charges_each_operator_its_own_time_and_composites_their_insides():
    """On CPU ranks: nesting on a thread gives each operator its self time; inside attention or a collective
    everything counts as that; busy is the top-level operators' span, idle the gaps between them."""
    trace = {"traceEvents": [
        step(3, 0, 1000),
        x("aten::linear", 0, 200), x("aten::t", 10, 10), x("aten::addmm", 30, 150),
        x("ExplicitCausalAttention", 300, 200), x("aten::bmm", 320, 100), x("aten::softmax", 430, 50),
        x("_AllToAll", 600, 100), x("aten::contiguous", 605, 5),
        x("shm_collective::shm_all_to_all", 620, 70, "user_annotation"),
        x("Optimizer.step#AdamW.step", 750, 200, "user_annotation"),  # not a collective: not device work
        x("aten::_fused_adamw_", 760, 150),
        x("aten::add_", 900, 10, tid=2),  # another thread: its own top level
    ]}
    s = summarize(trace)
    assert s["device"] == "cpu"
    assert {t["name"]: t["s_per_step"] for t in s["top"][:2]} == pytest.approx(
        {"aten::addmm": 150e-6, "aten::_fused_adamw_": 150e-6})
    (r,) = s["steps"]
    assert r["gemm_s"] == pytest.approx(150e-6)
    assert r["attention_s"] == pytest.approx(200e-6)
    assert r["communication_s"] == pytest.approx(100e-6)
    # linear's own 40, t 10, the optimizer's fused kernel 150, the other thread's add 10
    assert r["other_s"] == pytest.approx(210e-6)
    assert r["busy_s"] == pytest.approx((200 + 200 + 100 + 150) * 1e-6)  # add_ lies inside adamw's span
    assert r["idle_s"] == pytest.approx(350e-6)
    assert r["kernels"] == 5


def test_a_window_the_loop_leaves_early_is_written_as_far_as_it_ran(tmp_path):
    """StepProfiler on its own: steps outside the window and ranks not named record nothing; a loop that stops
    inside the window (SIGTERM, train.stop_at_step) still writes what it recorded, named by its real steps."""
    other = StepProfiler([2, 4], [1], 0, torch.device("cpu"), tmp_path)
    mine = StepProfiler([2, 4], [0, 1], 0, torch.device("cpu"), tmp_path)
    for step in (1, 2, 3):
        for p in (other, mine):
            p.begin(step)
        torch.ones(64, 64) @ torch.ones(64, 64)
        assert other.end() is None and mine.end() is None  # the window's last step (4) never ran
    assert other.close() is None  # rank 0 is not among its ranks
    summary = mine.close()
    assert [r["step"] for r in summary["steps"]] == [2, 3] and summary["trace"] == "rank0.steps2-3.json.gz"
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0.steps2-3.json.gz",
                                                                       "rank0.steps2-3.summary.json"]
    assert summary["mean"]["gemm_s"] > 0
    assert mine.close() is None  # written once
    resumed = StepProfiler([2, 4], [0], 0, torch.device("cpu"), tmp_path)  # a resume at step 2, inside the window
    for step in (3, 4):
        resumed.begin(step)
        summary = resumed.end()
    assert summary["trace"] == "rank0.steps3-4.json.gz" and [r["step"] for r in summary["steps"]] == [3, 4]


def test_a_profiler_that_fails_costs_a_line_not_the_run(tmp_path, monkeypatch, capsys):
    """No CUPTI, a full disk: the window is lost with one line; the steps go on."""
    p = StepProfiler([1, 2], [0], 0, torch.device("cpu"), tmp_path)

    def refuse(*a, **k):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
    monkeypatch.setattr(torch.profiler, "profile", refuse)
    p.begin(1)
    assert p.end() is None and p.close() is None
    p.begin(2)
    assert "profile rank 0: torch.profiler could not start (CUPTI_ERROR_NOT_INITIALIZED); the run goes on " \
           "unprofiled" in capsys.readouterr().out
    monkeypatch.undo()
    (tmp_path / "profile").write_text("a file where the directory should be")
    q = StepProfiler([1, 1], [0], 0, torch.device("cpu"), tmp_path)
    q.begin(1)
    assert q.end() is None
    assert "torch.profiler could not write" in capsys.readouterr().out
    assert not torch.autograd._profiler_enabled()  # stopped: the next steps run unprofiled


@pytest.mark.parametrize("sets, words", [
    (["debug.profile_steps=[3]"], "debug.profile_steps must be [] (off) or [first, last]"),
    (["debug.profile_steps=[4,2]"], "1 <= first <= last"),
    (["debug.profile_steps=[0,2]"], "1 <= first <= last"),
    (["debug.profile_steps=[2,9]", "train.max_steps=5"], "after train.max_steps (5)"),
    (["debug.profile_steps=[1,2]", "debug.profile_ranks=[]"], "debug.profile_ranks must list the ranks"),
    (["debug.profile_steps=[1,2]", "debug.profile_ranks=[-1]"], "debug.profile_ranks must list the ranks"),
])
def test_bad_profile_settings_get_one_sentence(sets, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        validate(load_config(str(ROOT / "configs/moe_tiny.yaml"), sets))


def test_profile_ranks_beyond_the_world_are_refused_before_any_group():
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), ["debug.profile_steps=[1,2]", "debug.profile_ranks=[0,2]"])
    with pytest.raises(ConfigError, match=r"must name ranks below the world size \(2\)"):
        validate_layout(cfg, 2)


def test_a_profiled_run_matches_its_logged_steps_and_the_planner_reads_it(tmp_path):
    out = tmp_path / "run"
    proc = check(launch(2, out, TINY + ["parallel.ep=2", "train.max_steps=4", "debug.profile_steps=[2,3]",
                                        "debug.profile_ranks=[0,1]", "train.checkpoint_every=0"]))
    assert "profile rank 0 steps 2-3" in proc.stdout and "profile rank 1 steps 2-3" in proc.stdout
    names = sorted(p.name for p in (out / "profile").iterdir())
    assert names == ["rank0.steps2-3.json.gz", "rank0.steps2-3.summary.json",
                     "rank1.steps2-3.json.gz", "rank1.steps2-3.summary.json"]
    with gzip.open(out / "profile" / "rank0.steps2-3.json.gz", "rt") as f:
        assert summarize(json.load(f)) == {k: v for k, v in json.loads(
            (out / "profile" / "rank0.steps2-3.summary.json").read_text()).items() if k not in ("rank", "trace")}
    rows = read_metrics(out)
    logged = {r["step"]: r["step_time_last_s"] for r in rows if "step_time_last_s" in r}
    for name, summary in read_summaries(out).items():
        assert summary["device"] == "cpu"
        assert [r["step"] for r in summary["steps"]] == [2, 3], name
        for r in summary["steps"]:
            # the profiled range holds the step the trainer times (and its few host lines around it)
            assert logged[r["step"]] * 0.9 <= r["wall_s"] <= logged[r["step"]] * 1.5 + 0.05, (name, r, logged)
            assert 0 < r["busy_s"] <= r["wall_s"] + 1e-6
            assert r["idle_s"] == pytest.approx(r["wall_s"] - r["busy_s"], abs=1e-6)
            assert r["gemm_s"] > 0 and r["communication_s"] > 0 and r["attention_s"] > 0, (name, r)
            assert sum(r[f"{k}_s"] for k in ("gemm", "attention", "communication", "other")) <= r["busy_s"] * 1.05
    (event,) = [r for r in rows if r.get("event") == "profile"]
    assert event["rank"] == 0 and event["step"] == 3 and event["profile.wall_s"] > 0
    plan = subprocess.run([sys.executable, "tools/plan.py", "--config", str(out / "config.yaml"), "--gpus", "2",
                           "--time", "--gpu", "h100", "--profile", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert f"### Against the profile of {out}" in plan.stdout and "| GEMMs (dense and experts) |" in plan.stdout
    none = subprocess.run([sys.executable, "tools/plan.py", "--config", str(out / "config.yaml"), "--gpus", "2",
                           "--time", "--profile", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert none.returncode == 2 and none.stdout == ""
    assert "no profile/ directory there" in none.stderr

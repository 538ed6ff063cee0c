// Fused CPU kernels, built on first use by moe_trainer/cpu_kernels.py. The torch-op paths in
// moe/experts.py and models/layers.py are the references (and the fallback).
//
// SwiGLU, for the routed experts ([g | u] rows with a gate per row) and the dense FFNs (separate
// g and u): one pass instead of torch's three (forward) or seven (backward) elementwise passes.
//   forward:  a = silu(g) * u * gate                      for h = [g | u], a row per routed copy
//   backward: du = da * gate * silu(g)
//             dg = da * gate * u * silu'(g),  silu'(g) = s * (1 + g * (1 - s)),  s = sigmoid(g)
//             dgate = sum_j da * silu(g) * u               (fp32 accumulation)
//
// Causal softmax, for the explicit CPU attention (models/layers.py): row i of a (T, S) score
// block sees keys j <= i + offset. One pass each way instead of the masked GEMM's mask copy, the
// softmax over the whole row and the separate scaling of dQ and dK; the masked half is only written
// (zeros), never read.
//   forward:  p_j = exp(scale * (s_j - max_k s_k)) / sum_k exp(...)    over visible j, else 0
//   backward: ds_j = scale * p_j * (dp_j - sum_k p_k dp_k)              (in place over dp)
//
// Causal attention in fp32 (models/layers.py: ExplicitCausalAttention), one task per (batch, head):
// its query blocks one after the other on one thread, each block's scores, softmax and output in
// that thread's cache, through BLAS sgemm called directly (a few microseconds less per GEMM than
// a torch op, and beta = 1 accumulates dK and dV in place); the threads meet once per call. Block
// b of rows [r0, r1) keeps its probabilities against keys [0, r1), as the torch-op path does.
//   forward:  P = softmax(scale Q_b K^T) (causal),  O_b = P V
//   backward: dV += P^T dO_b,  dS = scale P * (dO_b V^T - rowsum),  dQ_b = dS K,  dK += dS^T Q_b
//
// RMSNorm, for every norm of both models (models/layers.py): one pass each way instead of torch's
// cast, square, mean, rsqrt, scale, cast and gain (forward) and their backward chain. Rounds where
// the reference rounds: the normalised row to the input dtype before the gain, as Llama and
// DeepSeek-V3 do.
//   forward:  r = 1 / sqrt(mean_j x_j^2 + eps),  y_j = w_j * round(x_j r)       (r saved, fp32)
//   backward: dn_j = round(dy_j w_j),  dx_j = r (dn_j - n_j mean_k(dn_k n_k)),  n = x r
//             dw_j = sum over rows of dy_j round(x_j r)                          (fp32 accumulation)
//
// Routed experts in fp32, one task per expert (moe/experts.py: ThreadedCPUExperts): each of an
// expert's GEMMs on one thread, the threads taking experts from a shared queue (largest first), the
// SwiGLU between them on the same thread while the block is in its cache. torch's per-GEMM
// threading splits every expert's small GEMMs (a few hundred rows) across the cores and meets at
// a barrier after each; here the only barrier is at the end. An expert holding more than a
// 1 / (2 * threads) share of the rows (a hot expert) would stall the queue, so it runs after the
// queue, on all threads, as torch would run it.
//   forward:  h_e = x_e W1_e^T,  a_e = silu(g) * u * gate,  out_e = a_e W2_e^T       (h, a saved)
//   backward: dW2_e = dy_e^T a_e,  da = dy_e W2_e,  dh = SwiGLU'(da),  dW1_e = dh^T x_e,  dx_e = dh W1_e
// With `onednn_min` >= 0, the GEMMs whose reduction runs over the hidden sizes (h_e, out_e, da,
// dx_e) and that have at least onednn_min multiply-adds go through oneDNN's matmul (torch's
// mkldnn::_linear_pointwise, the op of models/layers.py's Linear) instead of MKL's sgemm: on this
// machine its fp32 kernels ran 10-40% faster at those shapes. The weight gradients, reductions over
// an expert's rows, stay on sgemm, which was as fast or faster there.
//
// Routing bookkeeping, for the router and the dispatchers (moe/router.py, moe/dispatcher.py,
// parallel/expert.py): a row-wise top-k of the (N, E) selection scores (E is tens to hundreds, k a
// handful: one insertion pass per row instead of torch.topk's general kernel) and a stable
// counting sort of expert ids (instead of torch.argsort(stable=True) + torch.bincount).
//
// Everything is computed in fp32 and rounded on store (bf16: round to nearest even), once except
// where a reference rounds in between (RMSNorm).
//
// Shared-memory all-to-all, for expert parallelism between the CPU ranks of one host
// (parallel/shm_alltoall.py): each rank owns a file in /dev/shm holding one single-producer
// single-consumer byte ring per destination rank. A rank streams its chunk for rank j into its ring
// j and drains ring `rank` of every peer's file, alternating until its sends and receives are
// complete (both sides know every size from the split sizes, so no framing). head and tail are
// byte counts published with release stores and read with acquire loads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/BFloat16.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <cerrno>
#include <cstdio>
#include <fcntl.h>
#include <signal.h>
#include <dlfcn.h>
#include <climits>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// exp(x) = 2^n * e^f with n = round(x / ln 2) and f = x - n ln 2 (Cody-Waite: ln 2 in two parts,
// so f keeps full precision), |f| <= ln(2) / 2; e^f by its Taylor series to degree 7 (truncation
// < 1e-8 relative, below fp32 rounding). No libm call, so the loops vectorise without -ffast-math.
// x is clamped to [-87, 88]: sigmoid has saturated long before; a NaN in g still makes the
// outputs NaN through the products with g below.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_rintf(x * 1.4426950408889634f);
  const float f = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t e = static_cast<int32_t>(n);
  return p * bits_to_float(static_cast<uint32_t>(e + 127) << 23);
}

// v rounded to bf16 (nearest even; a quiet NaN stays NaN), as fp32 bits whose low 16 are don't-care
inline uint32_t bf16_rounded_bits(float v) {
  const uint32_t u = float_to_bits(v);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return nan ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);
}

template <typename T> struct IO;
template <> struct IO<float> {
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float v) { p[i] = v; }
};
template <> struct IO<c10::BFloat16> {
  static inline float load(const c10::BFloat16* p, int64_t i) {
    return bits_to_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
  }
  static inline void store(c10::BFloat16* p, int64_t i, float v) {
    reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bf16_rounded_bits(v) >> 16);
  }
};

constexpr int64_t kGrainRows = 64;

// Row r of g / u / da / out / dg / du starts at p + r * stride (elements): [g | u] rows of the
// routed experts' pre-activation (stride 2H, u = g + H) or separate (M, H) tensors (stride H).
template <typename T>
void forward_rows(const T* g0, const T* u0, int64_t in_stride, const float* gate, T* a, int64_t rows, int64_t hid) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = g0 + r * in_stride;
      const T* u = u0 + r * in_stride;
      T* out = a + r * hid;
      const float gt = gate ? gate[r] : 1.0f;
#pragma omp simd
      for (int64_t j = 0; j < hid; ++j) {
        const float x = IO<T>::load(g, j);
        const float s = 1.0f / (1.0f + exp_approx(-x));
        IO<T>::store(out, j, x * s * IO<T>::load(u, j) * gt);
      }
    }
  });
}

template <typename T>
void backward_rows(const T* da, const T* g0, const T* u0, int64_t in_stride, const float* gate, T* dg0, T* du0,
                   float* dgate, int64_t rows, int64_t hid) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = g0 + r * in_stride;
      const T* u = u0 + r * in_stride;
      const T* d = da + r * hid;
      T* dg = dg0 + r * in_stride;
      T* du = du0 + r * in_stride;
      const float gt = gate ? gate[r] : 1.0f;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < hid; ++j) {
        const float x = IO<T>::load(g, j), uj = IO<T>::load(u, j), dj = IO<T>::load(d, j);
        const float s = 1.0f / (1.0f + exp_approx(-x));
        const float silu = x * s;
        acc += dj * silu * uj;
        const float dgated = dj * gt;
        IO<T>::store(du, j, dgated * silu);
        IO<T>::store(dg, j, dgated * uj * s * (1.0f + x * (1.0f - s)));
      }
      if (dgate) dgate[r] = acc;
    }
  });
}

void check_dtype(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 2, "cpu_kernels: contiguous 2-D CPU tensors only");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16,
              "cpu_kernels: float32 or bfloat16 only");
}

const float* gate_ptr(const c10::optional<torch::Tensor>& gate, int64_t rows, torch::Tensor& keep) {
  if (!gate.has_value()) return nullptr;
  TORCH_CHECK(gate->dim() == 1 && gate->size(0) == rows, "cpu_kernels: gate must be (M,)");
  keep = gate->to(torch::kFloat).contiguous();
  return keep.data_ptr<float>();
}

template <typename F>
void on_dtype(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kBFloat16) f(c10::BFloat16{});
  else f(float{});
}

// h = [g | u] (M, 2H) -> a = silu(g) * u * gate (M, H)
torch::Tensor swiglu_forward(torch::Tensor h, c10::optional<torch::Tensor> gate) {
  check_dtype(h);
  TORCH_CHECK(h.size(1) % 2 == 0, "cpu_kernels: h must be (M, 2H)");
  const int64_t rows = h.size(0), hid = h.size(1) / 2;
  auto a = torch::empty({rows, hid}, h.options());
  torch::Tensor keep;
  const float* gp = gate_ptr(gate, rows, keep);
  on_dtype(h, [&](auto tag) {
    using T = decltype(tag);
    const T* hp = h.data_ptr<T>();
    forward_rows(hp, hp + hid, 2 * hid, gp, a.data_ptr<T>(), rows, hid);
  });
  return a;
}

// -> dh (M, 2H) and, if asked, dgate (M,) fp32
std::vector<torch::Tensor> swiglu_backward(torch::Tensor da, torch::Tensor h, c10::optional<torch::Tensor> gate,
                                           bool need_gate_grad) {
  check_dtype(h);
  check_dtype(da);
  const int64_t rows = h.size(0), hid = h.size(1) / 2;
  TORCH_CHECK(da.scalar_type() == h.scalar_type() && da.size(0) == rows && da.size(1) == hid,
              "cpu_kernels: da must be (M, H) of h's dtype");
  auto dh = torch::empty_like(h);
  torch::Tensor keep, dgate;
  const float* gp = gate_ptr(gate, rows, keep);
  float* dgp = nullptr;
  if (need_gate_grad) {
    dgate = torch::empty({rows}, h.options().dtype(torch::kFloat));
    dgp = dgate.data_ptr<float>();
  }
  on_dtype(h, [&](auto tag) {
    using T = decltype(tag);
    const T* hp = h.data_ptr<T>();
    T* dhp = dh.data_ptr<T>();
    backward_rows(da.data_ptr<T>(), hp, hp + hid, 2 * hid, gp, dhp, dhp + hid, dgp, rows, hid);
  });
  if (need_gate_grad) return {dh, dgate};
  return {dh};
}

// separate g, u (M, H) -> silu(g) * u
torch::Tensor silu_mul_forward(torch::Tensor g, torch::Tensor u) {
  check_dtype(g);
  check_dtype(u);
  TORCH_CHECK(g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type(), "cpu_kernels: g and u must match");
  auto a = torch::empty_like(g);
  on_dtype(g, [&](auto tag) {
    using T = decltype(tag);
    forward_rows(g.data_ptr<T>(), u.data_ptr<T>(), g.size(1), nullptr, a.data_ptr<T>(), g.size(0), g.size(1));
  });
  return a;
}

// -> (dg, du)
std::vector<torch::Tensor> silu_mul_backward(torch::Tensor da, torch::Tensor g, torch::Tensor u) {
  check_dtype(g);
  check_dtype(u);
  check_dtype(da);
  TORCH_CHECK(g.sizes() == u.sizes() && da.sizes() == g.sizes() && g.scalar_type() == u.scalar_type() &&
                  da.scalar_type() == g.scalar_type(),
              "cpu_kernels: da, g and u must match");
  auto dg = torch::empty_like(g);
  auto du = torch::empty_like(u);
  on_dtype(g, [&](auto tag) {
    using T = decltype(tag);
    backward_rows(da.data_ptr<T>(), g.data_ptr<T>(), u.data_ptr<T>(), g.size(1), nullptr, dg.data_ptr<T>(),
                  du.data_ptr<T>(), nullptr, g.size(0), g.size(1));
  });
  return {dg, du};
}

// ------------------------------------------------------------------------------ routed experts (fp32)

// Runs task(i, thread slot) for i in [0, n) on the pool's threads, each task on one thread, taken
// from a shared counter in order: the GEMMs and at::parallel_for inside a task see a parallel region
// and stay on its thread. Autograd is below us (the callers are autograd Functions, and the workers
// do not inherit the caller's grad mode). The first exception is rethrown after the region.
template <typename F>
void run_tasks(int64_t n, F&& task) {
  std::atomic<int64_t> next{0};
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
#pragma omp parallel
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const int slot = omp_get_thread_num();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      try {
        task(i, slot);
      } catch (...) {
        if (!failed.test_and_set()) error = std::current_exception();
        next.store(n);
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// oneDNN's fp32 matmul as torch registers it: y = x w^T for x (n, k) and w (m, k) of any strides.
using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                   std::optional<c10::string_view>);

const c10::TypedOperatorHandle<LinearPointwise>* onednn_linear_op() {
  static const std::optional<c10::TypedOperatorHandle<LinearPointwise>> op =
      []() -> std::optional<c10::TypedOperatorHandle<LinearPointwise>> {
    auto handle = c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
    if (!handle.has_value() || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return std::nullopt;
    return handle->typed<LinearPointwise>();
  }();
  return op.has_value() ? &*op : nullptr;
}

// oneDNN builds (JIT-compiles) a kernel per GEMM shape, and an expert's row count changes every
// step: on exact row counts the compiles cost more than oneDNN's faster kernels save (routed
// experts at moe_bench shapes: 113 ms forward with fresh counts per call against 75 ms on MKL).
// So its GEMMs run on the rows rounded up to a multiple of kOneDNNRows, a few hundred shapes that
// are each compiled once (oneDNN's primitive cache keeps 1024), and the extra rows' results are
// dropped.
constexpr int64_t kOneDNNRows = 16;

inline int64_t onednn_rows(int64_t n) { return (n + kOneDNNRows - 1) / kOneDNNRows * kOneDNNRows; }

// Whether a GEMM of n rows by a (nout, k) weight goes to oneDNN: `onednn_min` >= 0 (off below 0),
// torch has the op, and the padded GEMM has at least onednn_min multiply-adds. oneDNN's call costs
// ~10-20 us more than sgemm's (it builds an operation descriptor every call), more than it saves on
// a GEMM of a few M multiply-adds (cpu_kernels.ONEDNN_MIN_MACS).
inline bool onednn_for(int64_t n, int64_t k, int64_t nout, int64_t onednn_min) {
  return onednn_min >= 0 && onednn_linear_op() != nullptr && onednn_rows(n) * k * nout >= onednn_min;
}

// out (n rows) = x[r0 : r0 + n] w^T, by oneDNN (onednn_for) on onednn_rows(n) rows of x, or by
// sgemm (at::mm_out). The padding rows are x's next rows, which must not be written meanwhile, or
// zeros past x's end.
void linear_rows(torch::Tensor out, const torch::Tensor& x, int64_t r0, int64_t n, const torch::Tensor& w,
                 int64_t onednn_min) {
  if (!onednn_for(n, w.size(1), w.size(0), onednn_min)) {
    at::mm_out(out, x.narrow(0, r0, n), w.t());
    return;
  }
  const int64_t np = onednn_rows(n);
  torch::Tensor in;
  if (r0 + np <= x.size(0)) {
    in = x.narrow(0, r0, np);
  } else {
    in = torch::zeros({np, x.size(1)}, x.options());
    in.narrow(0, 0, n).copy_(x.narrow(0, r0, n));
  }
  out.copy_(onednn_linear_op()
                ->call(in, w, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt)
                .narrow(0, 0, n));
}

// Experts in the order the threads take them: the queue (largest first) and the hot ones.
struct ExpertTasks {
  std::vector<int64_t> start;  // (E + 1,) first row of each expert
  std::vector<int64_t> queue, hot;
  int64_t max_queue_rows = 0, max_hot_rows = 0;
};

ExpertTasks expert_tasks(const std::vector<int64_t>& counts, int64_t threads) {
  ExpertTasks t;
  const int64_t n = static_cast<int64_t>(counts.size());
  t.start.assign(n + 1, 0);
  for (int64_t e = 0; e < n; ++e) {
    TORCH_CHECK(counts[e] >= 0, "cpu_kernels: negative expert row count");
    t.start[e + 1] = t.start[e] + counts[e];
  }
  const int64_t hot = threads > 1 ? t.start[n] / (2 * threads) : t.start[n];
  for (int64_t e = 0; e < n; ++e) {
    if (counts[e] == 0) continue;
    if (counts[e] > hot) {
      t.hot.push_back(e);
      t.max_hot_rows = std::max(t.max_hot_rows, counts[e]);
    } else {
      t.queue.push_back(e);
      t.max_queue_rows = std::max(t.max_queue_rows, counts[e]);
    }
  }
  std::stable_sort(t.queue.begin(), t.queue.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  return t;
}

// Runs task(e, scratch index) for every queued expert on the pool's threads (run_tasks), then every
// hot expert on all threads (scratch index 0).
template <typename F>
void run_expert_tasks(const ExpertTasks& t, F&& task) {
  if (!t.queue.empty()) run_tasks(static_cast<int64_t>(t.queue.size()), [&](int64_t i, int slot) { task(t.queue[i], slot); });
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (int64_t e : t.hot) task(e, 0);
}

void check_experts(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& w2,
                   const c10::optional<torch::Tensor>& gate, const std::vector<int64_t>& counts) {
  for (const torch::Tensor* t : {&x, &w1, &w2})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == torch::kFloat,
                "cpu_kernels: the expert kernels take contiguous float32 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && w2.dim() == 3 && w1.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w1.size(1) == 2 * w2.size(2) && w1.size(0) == w2.size(0) &&
                  static_cast<int64_t>(counts.size()) == w1.size(0),
              "cpu_kernels: experts need x (M, d), w1 (E, 2H, d), w2 (E, d, H) and E counts");
  int64_t rows = 0;
  for (int64_t c : counts) rows += c;
  TORCH_CHECK(rows == x.size(0), "cpu_kernels: expert row counts must add up to x's rows");
  if (gate.has_value())
    TORCH_CHECK(gate->device().is_cpu() && gate->is_contiguous() && gate->scalar_type() == torch::kFloat &&
                    gate->dim() == 1 && gate->size(0) == x.size(0),
                "cpu_kernels: the expert gate must be a contiguous (M,) float32 CPU tensor");
}

// -> (out (M, d), h (M, 2H), a (M, H))
std::vector<torch::Tensor> experts_forward(torch::Tensor x, torch::Tensor w1, torch::Tensor w2,
                                           c10::optional<torch::Tensor> gate, std::vector<int64_t> counts,
                                           int64_t onednn_min) {
  check_experts(x, w1, w2, gate, counts);
  const int64_t m = x.size(0), d = x.size(1), hid = w2.size(2);
  auto out = torch::empty({m, d}, x.options());
  auto h = torch::empty({m, 2 * hid}, x.options());
  auto a = torch::empty({m, hid}, x.options());
  const float* gp = gate.has_value() ? gate->data_ptr<float>() : nullptr;
  const int64_t threads = at::get_num_threads();
  const ExpertTasks t = expert_tasks(counts, threads);
  // per-thread SwiGLU output of one expert, padded for oneDNN (other threads write a's next rows)
  std::vector<torch::Tensor> a_s(onednn_min >= 0 ? threads : 0);
  for (size_t i = 0; i < a_s.size(); ++i)
    a_s[i] = torch::empty({onednn_rows(i == 0 ? std::max(t.max_queue_rows, t.max_hot_rows) : t.max_queue_rows), hid},
                          x.options());
  run_expert_tasks(t, [&](int64_t e, int slot) {
    const int64_t r0 = t.start[e], n = counts[e];
    auto he = h.narrow(0, r0, n), ae = a.narrow(0, r0, n), oe = out.narrow(0, r0, n);
    linear_rows(he, x, r0, n, w1[e], onednn_min);
    const float* hp = he.data_ptr<float>();
    // the down GEMM on oneDNN reads padding rows past the expert's: from this thread's scratch, not
    // from a, whose next rows another thread may be writing
    const bool scratch = onednn_for(n, hid, d, onednn_min);
    const torch::Tensor& src = scratch ? a_s[slot] : a;
    const int64_t s0 = scratch ? 0 : r0;
    forward_rows(hp, hp + hid, 2 * hid, gp ? gp + r0 : nullptr, src.data_ptr<float>() + s0 * hid, n, hid);
    if (scratch) ae.copy_(src.narrow(0, 0, n));
    linear_rows(oe, src, s0, n, w2[e], onednn_min);
  });
  return {out, h, a};
}

// -> (dx or undefined, dw1, dw2 (or undefined), dgate (M,) or undefined, dh (M, 2H) or undefined); an
// expert without rows gets zero weight gradients. keep_dh: also return the pre-activation gradient dh,
// so that experts_weight_grads can make the weight gradients later (the overlapped executor's held-back
// weight gradients, kernels/wgrad.py), from the same rows as here
std::vector<torch::Tensor> experts_backward(torch::Tensor dy, torch::Tensor x, torch::Tensor w1, torch::Tensor w2,
                                            c10::optional<torch::Tensor> gate, torch::Tensor h, torch::Tensor a,
                                            std::vector<int64_t> counts, bool need_x, bool need_w,
                                            bool need_gate, int64_t onednn_min, bool keep_dh) {
  check_experts(x, w1, w2, gate, counts);
  const int64_t m = x.size(0), hid = w2.size(2);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == torch::kFloat &&
                  h.is_contiguous() && h.size(0) == m && h.size(1) == 2 * hid && a.is_contiguous() &&
                  a.size(0) == m && a.size(1) == hid,
              "cpu_kernels: experts_backward needs dy like x and the forward's h and a");
  TORCH_CHECK(!need_gate || gate.has_value(), "cpu_kernels: a gate gradient needs a gate");
  torch::Tensor dx, dw1, dw2, dgate, dh_all;
  if (need_x) dx = torch::empty_like(x);
  if (keep_dh) dh_all = torch::empty({m, 2 * hid}, x.options());
  if (need_w) {
    dw1 = torch::empty_like(w1);
    dw2 = torch::empty_like(w2);
    for (size_t e = 0; e < counts.size(); ++e)
      if (counts[e] == 0) {
        dw1[e].zero_();
        dw2[e].zero_();
      }
  }
  if (need_gate) dgate = torch::empty({m}, x.options());
  const float* gp = gate.has_value() ? gate->data_ptr<float>() : nullptr;
  const int64_t threads = at::get_num_threads();
  const ExpertTasks t = expert_tasks(counts, threads);
  // per-thread da (rows, H) and dh (rows, 2H) of one expert; slot 0 also serves the hot experts
  std::vector<torch::Tensor> da_s(threads), dh_s(threads);
  for (int64_t i = 0; i < threads; ++i) {
    const int64_t rows = onednn_rows(i == 0 ? std::max(t.max_queue_rows, t.max_hot_rows) : t.max_queue_rows);
    da_s[i] = torch::empty({rows, hid}, x.options());
    dh_s[i] = torch::empty({rows, 2 * hid}, x.options());
  }
  run_expert_tasks(t, [&](int64_t e, int slot) {
    const int64_t r0 = t.start[e], n = counts[e];
    auto dye = dy.narrow(0, r0, n), he = h.narrow(0, r0, n);
    auto da = da_s[slot].narrow(0, 0, n), dh = dh_s[slot].narrow(0, 0, n);
    if (need_w) {
      auto g2 = dw2[e];
      at::mm_out(g2, dye.t(), a.narrow(0, r0, n));
    }
    linear_rows(da, dy, r0, n, w2[e].t(), onednn_min);
    float* dhp = dh.data_ptr<float>();
    const float* hp = he.data_ptr<float>();
    backward_rows(da.data_ptr<float>(), hp, hp + hid, 2 * hid, gp ? gp + r0 : nullptr, dhp, dhp + hid,
                  need_gate ? dgate.data_ptr<float>() + r0 : nullptr, n, hid);
    if (need_w) {
      auto g1 = dw1[e];
      at::mm_out(g1, dh.t(), x.narrow(0, r0, n));
    }
    if (keep_dh) dh_all.narrow(0, r0, n).copy_(dh);
    if (need_x) {
      auto dxe = dx.narrow(0, r0, n);
      linear_rows(dxe, dh_s[slot], 0, n, w1[e].t(), onednn_min);
    }
  });
  return {dx, dw1, dw2, dgate, dh_all};
}

// -> (dw1 (E, 2H, d), dw2 (E, d, H)): the weight gradients experts_backward makes with need_w, from its
// dh (keep_dh) instead, per expert on the same tasks and with the same GEMMs, so bit for bit the same
std::vector<torch::Tensor> experts_weight_grads(torch::Tensor dy, torch::Tensor x, torch::Tensor a, torch::Tensor dh,
                                                torch::Tensor w1, torch::Tensor w2, std::vector<int64_t> counts) {
  check_experts(x, w1, w2, c10::nullopt, counts);
  const int64_t m = x.size(0), hid = w2.size(2);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && a.is_contiguous() && a.size(0) == m &&
                  a.size(1) == hid && dh.is_contiguous() && dh.size(0) == m && dh.size(1) == 2 * hid,
              "cpu_kernels: experts_weight_grads needs dy like x, the forward's a and experts_backward's dh");
  auto dw1 = torch::empty_like(w1), dw2 = torch::empty_like(w2);
  for (size_t e = 0; e < counts.size(); ++e)
    if (counts[e] == 0) {
      dw1[e].zero_();
      dw2[e].zero_();
    }
  const ExpertTasks t = expert_tasks(counts, at::get_num_threads());
  run_expert_tasks(t, [&](int64_t e, int) {
    const int64_t r0 = t.start[e], n = counts[e];
    auto g2 = dw2[e], g1 = dw1[e];
    at::mm_out(g2, dy.narrow(0, r0, n).t(), a.narrow(0, r0, n));
    at::mm_out(g1, dh.narrow(0, r0, n).t(), x.narrow(0, r0, n));
  });
  return {dw1, dw2};
}

// ------------------------------------------------------------------------------ causal softmax

constexpr int64_t kGrainSoftmaxRows = 16;

// A (B, R, W) block of a larger score matrix: rows may be strided (a query block of a full
// (B, T, S) buffer, its first W keys), elements within a row are contiguous.
void check_block(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1,
              "cpu_kernels: ", what, " must be a (B, R, W) CPU tensor with contiguous rows");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16,
              "cpu_kernels: float32 or bfloat16 only");
}

// Row i of the block sees keys [0, min(i + offset + 1, W)): at least key 0.
inline int64_t visible(int64_t i, int64_t offset, int64_t w) { return std::min(i + offset + 1, w); }

template <typename T>
void softmax_rows(T* x, int64_t batch, int64_t rows, int64_t w, int64_t sb, int64_t sr, int64_t offset, float scale) {
  at::parallel_for(0, batch * rows, kGrainSoftmaxRows, [&](int64_t q0, int64_t q1) {
    // a local copy: through the capture, every float store may alias `scale` and GCC re-read it
    // each iteration (a gather per vector)
    const float sc = scale;
    std::vector<float> e(w);
    float* ep = e.data();
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t i = q % rows;
      T* row = x + (q / rows) * sb + i * sr;
      const int64_t n = visible(i, offset, w);
      float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < n; ++j) m = std::max(m, IO<T>::load(row, j));
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        ep[j] = exp_approx(sc * (IO<T>::load(row, j) - m));
        sum += ep[j];
      }
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) IO<T>::store(row, j, ep[j] * inv);
      std::memset(static_cast<void*>(row + n), 0, sizeof(T) * (w - n));
    }
  });
}

template <typename T>
void softmax_backward_rows(T* dp, const T* p, int64_t batch, int64_t rows, int64_t w, int64_t sb, int64_t sr,
                           int64_t psb, int64_t psr, int64_t offset, float scale) {
  at::parallel_for(0, batch * rows, kGrainSoftmaxRows, [&](int64_t q0, int64_t q1) {
    const float sc = scale;  // local, as in softmax_rows
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b = q / rows, i = q % rows;
      T* d = dp + b * sb + i * sr;
      const T* pr = p + b * psb + i * psr;
      const int64_t n = visible(i, offset, w);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < n; ++j) dot += IO<T>::load(pr, j) * IO<T>::load(d, j);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) IO<T>::store(d, j, sc * IO<T>::load(pr, j) * (IO<T>::load(d, j) - dot));
      std::memset(static_cast<void*>(d + n), 0, sizeof(T) * (w - n));
    }
  });
}

// scores (B, R, W), overwritten with the probabilities; returns it.
torch::Tensor causal_softmax_forward_(torch::Tensor scores, double scale, int64_t offset) {
  check_block(scores, "scores");
  TORCH_CHECK(offset >= 0 && scores.size(2) > 0, "cpu_kernels: causal_softmax needs offset >= 0 and a key");
  on_dtype(scores, [&](auto tag) {
    using T = decltype(tag);
    softmax_rows(scores.data_ptr<T>(), scores.size(0), scores.size(1), scores.size(2), scores.stride(0),
                 scores.stride(1), offset, static_cast<float>(scale));
  });
  return scores;
}

// dp (B, R, W) = dL/dp, overwritten with dL/dscores; p the forward's probabilities; returns dp.
torch::Tensor causal_softmax_backward_(torch::Tensor dp, torch::Tensor p, double scale, int64_t offset) {
  check_block(dp, "dp");
  check_block(p, "p");
  TORCH_CHECK(dp.sizes() == p.sizes() && dp.scalar_type() == p.scalar_type(), "cpu_kernels: dp and p must match");
  TORCH_CHECK(offset >= 0 && p.size(2) > 0, "cpu_kernels: causal_softmax needs offset >= 0 and a key");
  on_dtype(p, [&](auto tag) {
    using T = decltype(tag);
    softmax_backward_rows(dp.data_ptr<T>(), p.data_ptr<T>(), p.size(0), p.size(1), p.size(2), dp.stride(0),
                          dp.stride(1), p.stride(0), p.stride(1), offset, static_cast<float>(scale));
  });
  return dp;
}

// ------------------------------------------------------------------------------ causal attention (fp32)

// Fortran BLAS sgemm (column-major), resolved at load time from torch's own BLAS (MKL's, exported
// by libtorch_cpu, or the library torch links). Weak: where there is none the symbol is null, the
// attention kernels say so (has_blas) and the torch-op path runs.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

bool has_blas() { return sgemm_ != nullptr; }

// Row-major C (m x n, ldc) = alpha op(A) op(B) + beta C; op(A) is (m x k): A itself (lda) or, if
// ta, the transpose of a (k x m) A. Column-major BLAS computes C^T = op(B)^T op(A)^T.
inline void gemm_rows(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const int LDA = static_cast<int>(lda), LDB = static_cast<int>(ldb), LDC = static_cast<int>(ldc);
  sgemm_(&opb, &opa, &N, &M, &K, &alpha, b, &LDB, a, &LDA, &beta, c, &LDC);
}

struct QueryBlock {
  int64_t r0, r1, offset;  // rows [r0, r1) against keys [0, r1); probabilities at `offset`
};

// ceil(t / block) near-equal blocks (as layers.causal_blocks) and where each one's probabilities go
std::vector<QueryBlock> query_blocks(int64_t t, int64_t block, int64_t* total) {
  const int64_t nb = std::max<int64_t>(1, (t + block - 1) / block);
  std::vector<QueryBlock> out;
  int64_t off = 0;
  for (int64_t i = 0; i < nb; ++i) {
    const int64_t r0 = t * i / nb, r1 = t * (i + 1) / nb;
    out.push_back({r0, r1, off});
    off += (r1 - r0) * r1;
  }
  *total = off;
  return out;
}

void check_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  for (const torch::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->device().is_cpu() && x->is_contiguous() && x->scalar_type() == torch::kFloat && x->dim() == 3,
                "cpu_kernels: attention takes contiguous (BH, T, D) float32 CPU tensors");
  TORCH_CHECK(q.sizes() == k.sizes() && v.size(0) == q.size(0) && v.size(1) == q.size(1),
              "cpu_kernels: attention needs q, k (BH, T, Dqk) and v (BH, T, Dv)");
  TORCH_CHECK(has_blas(), "cpu_kernels: no BLAS sgemm in this process");
}

// -> (out (BH, T, Dv), probabilities (BH, P): each query block's (rows x r1) in turn)
std::vector<torch::Tensor> causal_attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                                    int64_t block) {
  check_attention(q, k, v);
  TORCH_CHECK(block > 0 && scale > 0, "cpu_kernels: attention needs block > 0 and scale > 0");
  const int64_t bh = q.size(0), t = q.size(1), dq = q.size(2), dv = v.size(2);
  int64_t psize = 0;
  const std::vector<QueryBlock> blocks = query_blocks(t, block, &psize);
  auto out = torch::empty({bh, t, dv}, q.options());
  auto probs = torch::empty({bh, psize}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *op = out.data_ptr<float>(), *pp = probs.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  run_tasks(bh, [&](int64_t b, int) {
    const float *Q = qp + b * t * dq, *K = kp + b * t * dq, *V = vp + b * t * dv;
    for (const QueryBlock& qb : blocks) {
      const int64_t rows = qb.r1 - qb.r0;
      float* P = pp + b * psize + qb.offset;  // (rows, r1)
      gemm_rows(false, true, rows, qb.r1, dq, 1.0f, Q + qb.r0 * dq, dq, K, dq, 0.0f, P, qb.r1);
      softmax_rows<float>(P, 1, rows, qb.r1, 0, qb.r1, qb.r0, sc);
      gemm_rows(false, false, rows, dv, qb.r1, 1.0f, P, qb.r1, V, dv, 0.0f, op + (b * t + qb.r0) * dv, dv);
    }
  });
  return {out, probs};
}

// -> (dq, dk, dv)
std::vector<torch::Tensor> causal_attention_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor k,
                                                     torch::Tensor v, torch::Tensor probs, double scale,
                                                     int64_t block) {
  check_attention(q, k, v);
  const int64_t bh = q.size(0), t = q.size(1), dq = q.size(2), dv = v.size(2);
  int64_t psize = 0;
  const std::vector<QueryBlock> blocks = query_blocks(t, block, &psize);
  TORCH_CHECK(dout.is_contiguous() && dout.scalar_type() == torch::kFloat && dout.sizes() == v.sizes() &&
                  probs.is_contiguous() && probs.dim() == 2 && probs.size(0) == bh && probs.size(1) == psize,
              "cpu_kernels: attention backward needs dout like v and the forward's probabilities");
  auto gq = torch::empty_like(q), gk = torch::empty_like(k), gv = torch::empty_like(v);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dop = dout.data_ptr<float>(), *pp = probs.data_ptr<float>();
  float *gqp = gq.data_ptr<float>(), *gkp = gk.data_ptr<float>(), *gvp = gv.data_ptr<float>();
  int64_t widest = 0;
  for (const QueryBlock& qb : blocks) widest = std::max(widest, (qb.r1 - qb.r0) * qb.r1);
  std::vector<std::vector<float>> scratch(at::get_num_threads());  // dP / dS of one block, per thread
  const float sc = static_cast<float>(scale);
  run_tasks(bh, [&](int64_t b, int slot) {
    const float *Q = qp + b * t * dq, *K = kp + b * t * dq, *V = vp + b * t * dv, *dO = dop + b * t * dv;
    float *dQ = gqp + b * t * dq, *dK = gkp + b * t * dq, *dV = gvp + b * t * dv;
    std::vector<float>& ds = scratch[slot];
    ds.resize(widest);
    std::memset(dK, 0, sizeof(float) * t * dq);
    std::memset(dV, 0, sizeof(float) * t * dv);
    for (const QueryBlock& qb : blocks) {
      const int64_t rows = qb.r1 - qb.r0;
      const float* P = pp + b * psize + qb.offset;
      const float* G = dO + qb.r0 * dv;
      gemm_rows(true, false, qb.r1, dv, rows, 1.0f, P, qb.r1, G, dv, 1.0f, dV, dv);             // dV += P^T dO
      gemm_rows(false, true, rows, qb.r1, dv, 1.0f, G, dv, V, dv, 0.0f, ds.data(), qb.r1);     // dP = dO V^T
      softmax_backward_rows<float>(ds.data(), P, 1, rows, qb.r1, 0, qb.r1, 0, qb.r1, qb.r0, sc);  // -> dS
      gemm_rows(false, false, rows, dq, qb.r1, 1.0f, ds.data(), qb.r1, K, dq, 0.0f, dQ + qb.r0 * dq, dq);  // dQ
      gemm_rows(true, false, qb.r1, dq, rows, 1.0f, ds.data(), qb.r1, Q + qb.r0 * dq, dq, 1.0f, dK, dq);   // dK +=
    }
  });
  return {gq, gk, gv};
}

// ------------------------------------------------------------------------------ RMSNorm

constexpr int64_t kGrainNormRows = 16;

template <typename T> inline float round_to(float v) { return v; }
template <> inline float round_to<c10::BFloat16>(float v) {  // as IO<bf16>::store rounds
  return bits_to_float(bf16_rounded_bits(v) & 0xffff0000u);
}

void check_norm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && w.device().is_cpu() && w.is_contiguous() && w.dim() == 1 &&
                  x.size(-1) == w.size(0),
              "cpu_kernels: rms_norm needs contiguous CPU x (..., N) and weight (N,)");
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                  w.scalar_type() == x.scalar_type(),
              "cpu_kernels: rms_norm needs float32 or bfloat16 x and a weight of the same dtype");
}

// -> (y like x, rstd (rows,) fp32)
std::vector<torch::Tensor> rms_norm_forward(torch::Tensor x, torch::Tensor w, double eps) {
  check_norm(x, w);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
  on_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, kGrainNormRows, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = xp + r * n;
        T* yr = yp + r * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; ++j) ss += IO<T>::load(xr, j) * IO<T>::load(xr, j);
        const float rs = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
        rp[r] = rs;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) IO<T>::store(yr, j, IO<T>::load(wp, j) * round_to<T>(IO<T>::load(xr, j) * rs));
      }
    });
  });
  return {y, rstd};
}

// -> (dx like x, dw (N,) fp32)
std::vector<torch::Tensor> rms_norm_backward(torch::Tensor dy, torch::Tensor x, torch::Tensor w, torch::Tensor rstd) {
  check_norm(x, w);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.is_contiguous(),
              "cpu_kernels: rms_norm_backward needs dy like x");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(rstd.scalar_type() == torch::kFloat && rstd.numel() == rows, "cpu_kernels: rstd must be (rows,) fp32");
  auto dx = torch::empty_like(x);
  const int64_t threads = at::get_num_threads();
  auto partial = torch::zeros({threads, n}, x.options().dtype(torch::kFloat));  // per-thread dw sums
  on_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>(), *dyp = dy.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    const float* rp = rstd.data_ptr<float>();
    float* pp = partial.data_ptr<float>();
    at::parallel_for(0, rows, kGrainNormRows, [&](int64_t r0, int64_t r1) {
      // local copies: through the lambda's references GCC re-read the pointers in every
      // iteration and vectorised the loops with gathers (6x the forward's time)
      const T* __restrict__ w_ = wp;
      float* __restrict__ dw = pp + at::get_thread_num() * n;
      std::vector<float> dn(n);
      float* __restrict__ dnp = dn.data();
      for (int64_t r = r0; r < r1; ++r) {
        const T* __restrict__ xr = xp + r * n;
        const T* __restrict__ dyr = dyp + r * n;
        T* __restrict__ dxr = dxp + r * n;
        const float rs = rp[r];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < n; ++j) {
          const float d = round_to<T>(IO<T>::load(dyr, j) * IO<T>::load(w_, j));
          dnp[j] = d;
          dot += d * IO<T>::load(xr, j);
        }
        const float mean = dot * rs / static_cast<float>(n);  // mean_k(dn_k n_k), n = x r
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const float xn = IO<T>::load(xr, j) * rs;
          dw[j] += IO<T>::load(dyr, j) * round_to<T>(xn);
          IO<T>::store(dxr, j, rs * (dnp[j] - xn * mean));
        }
      }
    });
  });
  return {dx, partial.sum(0)};
}

// ------------------------------------------------------------------------------ routing

// a ranks above b: larger, with NaN above every number (as torch.topk); ties keep the lower index
inline bool above(float a, float b) { return (a != a && b == b) || a > b; }

// scores (N, E) fp32 -> (N, k) int64: each row's k largest, largest first, ties to the lower index
torch::Tensor topk_rows(torch::Tensor scores, int64_t k) {
  TORCH_CHECK(scores.device().is_cpu() && scores.is_contiguous() && scores.dim() == 2 &&
                  scores.scalar_type() == torch::kFloat,
              "cpu_kernels: topk_rows needs a contiguous (N, E) float32 CPU tensor");
  const int64_t n = scores.size(0), e = scores.size(1);
  TORCH_CHECK(k >= 1 && k <= e, "cpu_kernels: topk_rows needs 1 <= k <= E");
  auto idx = torch::empty({n, k}, scores.options().dtype(torch::kLong));
  const float* sp = scores.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, n, 256, [&](int64_t r0, int64_t r1) {
    std::vector<float> bv(k);
    std::vector<int64_t> bi(k);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = sp + r * e;
      int64_t filled = 0;
      float floor = -__builtin_inff();  // k-th best so far, once k are held (NaN never passes below)
      for (int64_t j = 0; j < e; ++j) {
        const float v = row[j];
        if (filled == k && !(v > floor) && !(v != v && bv[k - 1] == bv[k - 1])) continue;
        int64_t p = filled < k ? filled++ : k - 1;
        for (; p > 0 && above(v, bv[p - 1]); --p) {
          bv[p] = bv[p - 1];
          bi[p] = bi[p - 1];
        }
        bv[p] = v;
        bi[p] = j;
        floor = bv[k - 1];
      }
      std::memcpy(ip + r * k, bi.data(), sizeof(int64_t) * k);
    }
  });
  return idx;
}

// keys (M,) int64 in [0, n_keys) -> (order (M,): a stable argsort, counts (n_keys,))
std::vector<torch::Tensor> counting_sort(torch::Tensor keys, int64_t n_keys) {
  TORCH_CHECK(keys.device().is_cpu() && keys.is_contiguous() && keys.dim() == 1 && keys.scalar_type() == torch::kLong,
              "cpu_kernels: counting_sort needs a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(n_keys >= 0, "cpu_kernels: counting_sort needs n_keys >= 0");
  const int64_t m = keys.numel();
  const int64_t* kp = keys.data_ptr<int64_t>();
  auto counts = torch::zeros({n_keys}, keys.options());
  auto order = torch::empty({m}, keys.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(kp[i] >= 0 && kp[i] < n_keys, "cpu_kernels: counting_sort key ", kp[i], " outside [0, ", n_keys, ")");
    ++cp[kp[i]];
  }
  std::vector<int64_t> next(n_keys);
  for (int64_t j = 0, s = 0; j < n_keys; ++j) {
    next[j] = s;
    s += cp[j];
  }
  int64_t* op = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) op[next[kp[i]]++] = i;
  return {order, counts};
}


// ----------------------------------------------------------------------------- shared-memory all-to-all

struct alignas(64) RingCounter {
  std::atomic<int64_t> value;
  char pad[64 - sizeof(std::atomic<int64_t>)];
};

struct RingHeader {
  RingCounter head;  // bytes written by the producer
  RingCounter tail;  // bytes consumed by the consumer
};

// At the start of each rank's file: rung by a peer after it wrote to this rank's ring or drained
// one of this rank's rings, so a waiting rank can sleep in the kernel (futex) instead of spinning
// on a core that a descheduled peer needs.
struct alignas(64) Doorbell {
  std::atomic<uint32_t> seq;       // bumped on every ring
  std::atomic<uint32_t> sleepers;  // > 0 while the owner sleeps (or is about to) on seq
  char pad[64 - 2 * sizeof(std::atomic<uint32_t>)];
};
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words are plain 32-bit integers");

struct ShmChannel {
  int64_t rank = 0, world = 0, capacity = 0;
  std::string prefix;
  std::vector<char*> maps;  // maps[i]: rank i's file (its rings to every rank)
  std::vector<int64_t> pids;  // each rank's process id, to notice a peer that died (empty: unchecked)
  size_t file_bytes = 0;
  bool unlinked = false;

  size_t ring_bytes() const { return sizeof(RingHeader) + static_cast<size_t>(capacity); }
  Doorbell* bell(int64_t r) { return reinterpret_cast<Doorbell*>(maps[r]); }
  RingHeader* ring(int64_t producer, int64_t consumer) {
    return reinterpret_cast<RingHeader*>(maps[producer] + sizeof(Doorbell) + consumer * ring_bytes());
  }
  char* data(int64_t producer, int64_t consumer) {
    return reinterpret_cast<char*>(ring(producer, consumer)) + sizeof(RingHeader);
  }
  std::string path(int64_t r) const { return prefix + "_" + std::to_string(r); }
};

std::vector<std::unique_ptr<ShmChannel>>& shm_channels() {
  static std::vector<std::unique_ptr<ShmChannel>> channels;
  return channels;
}

ShmChannel& shm_channel(int64_t handle) {
  auto& all = shm_channels();
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(all.size()) && all[handle],
              "shm all-to-all: no open channel ", handle);
  return *all[handle];
}

char* map_file(const std::string& path, size_t bytes, bool create) {
  int fd = create ? open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : open(path.c_str(), O_RDWR);
  if (fd < 0) return nullptr;
  // reserve the pages now: a tmpfs that is too small fails here instead of with SIGBUS later
  if (create && (ftruncate(fd, static_cast<off_t>(bytes)) != 0 || posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0)) {
    close(fd);
    unlink(path.c_str());
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (create) unlink(path.c_str());
    return nullptr;
  }
  return static_cast<char*>(p);
}

// Creates this rank's file `prefix_rank` with `world` rings of `capacity` bytes (rounded up to 64):
// a handle, or -1 if /dev/shm cannot hold it.
int64_t shm_channel_create(const std::string& prefix, int64_t rank, int64_t world, int64_t capacity) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && capacity > 0, "shm all-to-all: bad channel shape");
  auto ch = std::make_unique<ShmChannel>();
  ch->rank = rank;
  ch->world = world;
  ch->capacity = (capacity + 63) / 64 * 64;
  ch->prefix = prefix;
  ch->file_bytes = sizeof(Doorbell) + ch->ring_bytes() * static_cast<size_t>(world);
  ch->maps.assign(world, nullptr);
  ch->maps[rank] = map_file(ch->path(rank), ch->file_bytes, true);  // zero-filled: every count starts at 0
  if (!ch->maps[rank]) return -1;
  auto& all = shm_channels();
  all.push_back(std::move(ch));
  return static_cast<int64_t>(all.size()) - 1;
}

// Maps every peer's file (after all ranks created theirs); false if one is missing.
bool shm_channel_attach(int64_t handle) {
  ShmChannel& ch = shm_channel(handle);
  for (int64_t r = 0; r < ch.world; ++r) {
    if (!ch.maps[r]) ch.maps[r] = map_file(ch.path(r), ch.file_bytes, false);
    if (!ch.maps[r]) return false;
  }
  return true;
}

void shm_channel_set_pids(int64_t handle, std::vector<int64_t> pids) {
  ShmChannel& ch = shm_channel(handle);
  TORCH_CHECK(static_cast<int64_t>(pids.size()) == ch.world, "shm all-to-all: one pid per rank");
  ch.pids = std::move(pids);
}

// Removes this rank's file name (after every peer mapped it): nothing is left in /dev/shm
// however the job ends; the mappings live until close or exit.
void shm_channel_unlink(int64_t handle) {
  ShmChannel& ch = shm_channel(handle);
  if (!ch.unlinked) unlink(ch.path(ch.rank).c_str());
  ch.unlinked = true;
}

void shm_channel_close(int64_t handle) {
  ShmChannel& ch = shm_channel(handle);
  shm_channel_unlink(handle);
  for (char* p : ch.maps)
    if (p) munmap(p, ch.file_bytes);
  shm_channels()[handle].reset();
}

// Whether a process has exited: no such pid, or a zombie its parent has not reaped yet.
bool process_gone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close_paren = std::strrchr(buf, ')');  // "pid (comm) state ..."
  return close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// futex on a word of a MAP_SHARED file: shared between processes, so not FUTEX_PRIVATE
void futex_sleep(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000), static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void ring_bell(Doorbell* d) {
  d->seq.fetch_add(1, std::memory_order_seq_cst);
  if (d->sleepers.load(std::memory_order_seq_cst) > 0)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&d->seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// One direction of traffic with one peer in one call: the bytes for (or from) `peer`, in the
// buffers `parts` back to back. A stream streams through the ring between this rank and the peer,
// so messages on one ring arrive in the order they were written and are read in the order the
// receiver lists them (as NCCL matches point-to-point operations between two ranks).
struct Stream {
  int64_t peer = 0;
  bool send = false;
  std::vector<std::pair<char*, int64_t>> parts;
  int64_t total = 0, moved = 0;  // bytes in all parts, bytes copied so far
  size_t part = 0;               // the part being copied, and the offset in it
  int64_t offset = 0;
  int64_t until = -1;            // rendezvous send: the ring position the peer must consume past
};

// Copies n bytes between the stream's next bytes and the ring `data` (capacity cap) at ring
// position pos, wrapping around the ring and stepping over the stream's parts.
void pump(Stream& s, char* data, int64_t cap, int64_t pos, int64_t n) {
  while (n > 0) {
    while (s.offset == s.parts[s.part].second) {  // this part is done (or empty): the next one
      ++s.part;
      s.offset = 0;
    }
    auto& [buf, len] = s.parts[s.part];
    const int64_t at = pos % cap;
    const int64_t k = std::min({n, len - s.offset, cap - at});
    if (s.send) std::memcpy(data + at, buf + s.offset, k);
    else std::memcpy(buf + s.offset, data + at, k);
    pos += k;
    n -= k;
    s.moved += k;
    s.offset += k;
  }
}

// Runs `streams` (at most one per peer and direction) to completion: writes what fits into each
// send ring, takes what arrived from each receive ring, until every stream has moved its bytes.
// With `rendezvous` a send completes only once the peer has consumed it, i.e. posted the matching
// receive: NCCL's rule for point-to-point, so an order that would deadlock on GPUs waits here too
// (and fails after timeout_s) instead of passing on buffered rings.
// A rank with nothing to do spins for spin_s, then sleeps on its doorbell until a peer rings it:
// where ranks outnumber cores, a spinning rank takes the core that the peer it waits for needs.
void run_streams(ShmChannel& ch, std::vector<Stream>& streams, bool rendezvous, double timeout_s, double spin_s,
                 const char* what) {
  const int64_t W = ch.world, me = ch.rank, cap = ch.capacity;
  for (const Stream& s : streams)
    for (const auto& [buf, len] : s.parts) TORCH_CHECK(len >= 0, what, ": negative size");
  std::vector<char> woke(W, 0);  // peers whose rings changed in this pass: ring their bells after it
  auto complete = [&](const Stream& s) {
    if (s.moved < s.total) return false;
    if (!s.send || !rendezvous || s.total == 0) return true;
    return ch.ring(me, s.peer)->tail.value.load(std::memory_order_acquire) >= s.until;
  };
  std::vector<char> done(streams.size());
  int64_t pending = 0;
  for (size_t i = 0; i < streams.size(); ++i) pending += !(done[i] = complete(streams[i]));
  Doorbell* mine = ch.bell(me);
  auto last_progress = std::chrono::steady_clock::now();
  int64_t idle = 0;
  while (pending > 0) {
    // read before the pass: a peer that changes a ring after this load also bumps seq, so the sleep
    // below returns at once instead of missing it
    const uint32_t seq = mine->seq.load(std::memory_order_seq_cst);
    bool progress = false;
    for (size_t i = 0; i < streams.size(); ++i) {
      if (done[i]) continue;
      Stream& s = streams[i];
      const int64_t j = s.peer;
      if (s.send && s.moved < s.total) {  // my ring to j: write what fits
        RingHeader* r = ch.ring(me, j);
        const int64_t head = r->head.value.load(std::memory_order_relaxed);
        const int64_t room = cap - (head - r->tail.value.load(std::memory_order_acquire));
        const int64_t n = std::min(room, s.total - s.moved);
        if (n > 0) {
          pump(s, ch.data(me, j), cap, head, n);
          r->head.value.store(head + n, std::memory_order_release);
          if (s.moved == s.total) s.until = head + n;
          progress = true;
          woke[j] = 1;
        }
      } else if (!s.send) {  // j's ring to me: take what arrived
        RingHeader* r = ch.ring(j, me);
        const int64_t tail = r->tail.value.load(std::memory_order_relaxed);
        const int64_t n = std::min(r->head.value.load(std::memory_order_acquire) - tail, s.total - s.moved);
        if (n > 0) {
          pump(s, ch.data(j, me), cap, tail, n);
          r->tail.value.store(tail + n, std::memory_order_release);
          progress = true;
          woke[j] = 1;  // j may be waiting for room, or for its rendezvous
        }
      }
      if (complete(s)) {
        done[i] = 1;
        --pending;
        progress = true;
      }
    }
    if (progress) {
      for (int64_t j = 0; j < W; ++j)
        if (woke[j]) {
          ring_bell(ch.bell(j));
          woke[j] = 0;
        }
      idle = 0;
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    // waiting for a peer: spin for spin_s (a peer running on another core is about to arrive),
    // then sleep until a peer rings or 2 ms pass (to check the timeout and for dead peers)
    if (++idle < 64) {
      cpu_relax();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    const double waited = std::chrono::duration<double>(now - last_progress).count();
    if (waited < spin_s) {
      if ((idle & 255) == 0) std::this_thread::yield();
      else cpu_relax();
      continue;
    }
    if (waited > timeout_s) {
      std::string peers;
      for (size_t i = 0; i < streams.size(); ++i)
        if (!done[i])
          peers += (peers.empty() ? "" : ", ") + std::string(streams[i].send ? "send to " : "receive from ") +
                   "rank " + std::to_string(streams[i].peer);
      throw std::runtime_error(std::string(what) + ": rank " + std::to_string(me) + " waited " +
                               std::to_string(static_cast<int64_t>(waited)) + " s (" + peers +
                               ") for a peer that neither sent nor received (did a rank fail or skip a " +
                               (rendezvous ? "matching transfer? under NCCL this order deadlocks)" : "collective?)"));
    }
    if (waited > 0.01)
      for (size_t i = 0; i < streams.size(); ++i) {  // a dead peer ends the wait now
        const int64_t j = streams[i].peer;
        if (!done[i] && j < static_cast<int64_t>(ch.pids.size()) && process_gone(ch.pids[j]))
          throw std::runtime_error(std::string(what) + ": rank " + std::to_string(j) + " (pid " +
                                   std::to_string(ch.pids[j]) + ") has exited");
      }
    mine->sleepers.fetch_add(1, std::memory_order_seq_cst);
    futex_sleep(&mine->seq, seq, waited > 0.01 ? 10000000 : 2000000);
    mine->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

char* byte_buffer(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == torch::kUInt8, what,
              ": contiguous uint8 CPU buffers");
  return reinterpret_cast<char*>(t.data_ptr());
}

// all_to_all_single over bytes: send holds the chunks for ranks 0..world-1 back to back
// (send_bytes[j] each), recv receives recv_bytes[j] from each rank j in rank order.
void shm_all_to_all(int64_t handle, torch::Tensor send, std::vector<int64_t> send_bytes, torch::Tensor recv,
                    std::vector<int64_t> recv_bytes, double timeout_s, double spin_s) {
  const char* what = "shm all-to-all";
  ShmChannel& ch = shm_channel(handle);
  const int64_t W = ch.world, me = ch.rank;
  TORCH_CHECK(static_cast<int64_t>(send_bytes.size()) == W && static_cast<int64_t>(recv_bytes.size()) == W,
              what, ": one split per rank");
  char* src = byte_buffer(send, what);
  char* dst = byte_buffer(recv, what);
  std::vector<int64_t> send_off(W + 1, 0), recv_off(W + 1, 0);
  for (int64_t j = 0; j < W; ++j) {
    TORCH_CHECK(send_bytes[j] >= 0 && recv_bytes[j] >= 0, what, ": negative split");
    send_off[j + 1] = send_off[j] + send_bytes[j];
    recv_off[j + 1] = recv_off[j] + recv_bytes[j];
  }
  TORCH_CHECK(send_off[W] == send.numel() && recv_off[W] == recv.numel(), what, ": splits != buffer sizes");
  TORCH_CHECK(send_bytes[me] == recv_bytes[me], what, ": the chunk to self must match what self receives");
  std::vector<Stream> streams;
  for (int64_t j = 0; j < W; ++j) {
    if (j == me) continue;
    for (bool out : {true, false}) {
      const int64_t n = out ? send_bytes[j] : recv_bytes[j];
      if (n == 0) continue;
      Stream s;
      s.peer = j;
      s.send = out;
      s.parts.emplace_back(out ? src + send_off[j] : dst + recv_off[j], n);
      s.total = n;
      streams.push_back(std::move(s));
    }
  }
  pybind11::gil_scoped_release no_gil;
  if (send_bytes[me]) std::memcpy(dst + recv_off[me], src + send_off[me], send_bytes[me]);
  run_streams(ch, streams, false, timeout_s, spin_s, what);
}

// Point-to-point, as one NCCL group call: sends[i] goes to rank send_peers[i], recvs[i] is filled
// from rank recv_peers[i]; transfers between two ranks match in list order (across calls too).
// A send completes once its bytes are in the ring (as NCCL's do while they fit its buffers), or with
// `rendezvous` only once its receiver has taken them (NCCL's rule for large messages).
void shm_exchange(int64_t handle, std::vector<torch::Tensor> sends, std::vector<int64_t> send_peers,
                  std::vector<torch::Tensor> recvs, std::vector<int64_t> recv_peers, bool rendezvous,
                  double timeout_s, double spin_s) {
  const char* what = "shm point-to-point";
  ShmChannel& ch = shm_channel(handle);
  TORCH_CHECK(sends.size() == send_peers.size() && recvs.size() == recv_peers.size(), what, ": one peer per buffer");
  std::vector<Stream> streams;
  std::vector<int64_t> index(2 * ch.world, -1);  // (peer, direction) -> its stream
  auto add = [&](const torch::Tensor& t, int64_t peer, bool out) {
    TORCH_CHECK(peer >= 0 && peer < ch.world && peer != ch.rank, what, ": rank ", ch.rank,
                " cannot exchange with rank ", peer, " (a group of ", ch.world, ")");
    const int64_t key = 2 * peer + (out ? 1 : 0);
    if (index[key] < 0) {
      index[key] = static_cast<int64_t>(streams.size());
      Stream s;
      s.peer = peer;
      s.send = out;
      streams.push_back(std::move(s));
    }
    Stream& s = streams[index[key]];
    s.parts.emplace_back(byte_buffer(t, what), t.numel());
    s.total += t.numel();
  };
  for (size_t i = 0; i < sends.size(); ++i) add(sends[i], send_peers[i], true);
  for (size_t i = 0; i < recvs.size(); ++i) add(recvs[i], recv_peers[i], false);
  pybind11::gil_scoped_release no_gil;
  run_streams(ch, streams, rendezvous, timeout_s, spin_s, what);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu_forward", &swiglu_forward, "a = silu(g) * u * gate for h = [g | u]");
  m.def("swiglu_backward", &swiglu_backward, "(dh, [dgate]) of swiglu_forward");
  m.def("silu_mul_forward", &silu_mul_forward, "silu(g) * u for separate (M, H) g and u");
  m.def("silu_mul_backward", &silu_mul_backward, "(dg, du) of silu_mul_forward");
  m.def("experts_forward", &experts_forward, "fp32 routed experts, one task per expert: (out, h, a)");
  m.def("experts_backward", &experts_backward, "(dx, dw1, dw2, dgate, dh) of experts_forward");
  m.def("experts_weight_grads", &experts_weight_grads, "(dw1, dw2) from experts_backward's dh");
  m.def("has_blas", &has_blas, "whether the attention kernels found a BLAS sgemm");
  m.def("causal_attention_forward", &causal_attention_forward, "fp32 causal attention: (out, probabilities)");
  m.def("causal_attention_backward", &causal_attention_backward, "(dq, dk, dv) of causal_attention_forward");
  m.def("rms_norm_forward", &rms_norm_forward, "(y, rstd) of RMSNorm, rounding as the reference");
  m.def("rms_norm_backward", &rms_norm_backward, "(dx, dw fp32) of rms_norm_forward");
  m.def("topk_rows", &topk_rows, "each row's k largest (indices), largest first, ties to the lower index");
  m.def("counting_sort", &counting_sort, "(stable argsort, counts) of small non-negative int64 keys");
  m.def("causal_softmax_forward_", &causal_softmax_forward_, "causal softmax of scale * scores, in place");
  m.def("causal_softmax_backward_", &causal_softmax_backward_, "scale * (gradient of the causal softmax), in place over dp");
  m.def("shm_channel_create", &shm_channel_create, "this rank's rings in /dev/shm: a handle, or -1");
  m.def("shm_channel_attach", &shm_channel_attach, "map every peer's rings");
  m.def("shm_channel_set_pids", &shm_channel_set_pids, "each rank's pid, checked while waiting");
  m.def("shm_channel_unlink", &shm_channel_unlink, "remove this rank's file name");
  m.def("shm_channel_close", &shm_channel_close, "unmap and forget a channel");
  m.def("shm_all_to_all", &shm_all_to_all, "all_to_all_single over bytes through the rings (spin, then sleep)");
  m.def("shm_exchange", &shm_exchange, "point-to-point sends and receives as one group call (eager, or NCCL's rendezvous rule)");
}

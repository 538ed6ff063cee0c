// Fused SwiGLU for the routed experts on CPU: one pass over the pre-activation instead of
// torch's three (forward) or seven (backward) elementwise passes. Built on first use by
// moe_trainer/moe/cpu_kernels.py; the torch-op path in experts.py is the reference.
//
//   forward:  a = silu(g) * u * gate                      for h = [g | u], a row per routed copy
//   backward: du = da * gate * silu(g)
//             dg = da * gate * u * silu'(g),  silu'(g) = s * (1 + g * (1 - s)),  s = sigmoid(g)
//             dgate = sum_j da * silu(g) * u               (fp32 accumulation)
//
// Everything is computed in fp32 and rounded once on store (bf16: round to nearest even).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

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
    uint32_t u = float_to_bits(v);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    u = nan ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);  // quiet NaN stays NaN
    reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(u >> 16);
  }
};

constexpr int64_t kGrainRows = 64;

template <typename T>
void forward_rows(const T* h, const float* gate, T* a, int64_t rows, int64_t hid) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = h + r * 2 * hid;
      const T* u = g + hid;
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
void backward_rows(const T* da, const T* h, const float* gate, T* dh, float* dgate, int64_t rows, int64_t hid) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = h + r * 2 * hid;
      const T* u = g + hid;
      const T* d = da + r * hid;
      T* dg = dh + r * 2 * hid;
      T* du = dg + hid;
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

void check(const torch::Tensor& h, const c10::optional<torch::Tensor>& gate) {
  TORCH_CHECK(h.device().is_cpu() && h.dim() == 2 && h.is_contiguous() && h.size(1) % 2 == 0,
              "swiglu_cpu: h must be a contiguous (M, 2H) CPU tensor");
  TORCH_CHECK(h.scalar_type() == torch::kFloat || h.scalar_type() == torch::kBFloat16,
              "swiglu_cpu: float32 or bfloat16 only");
  TORCH_CHECK(!gate.has_value() || (gate->dim() == 1 && gate->size(0) == h.size(0)),
              "swiglu_cpu: gate must be (M,)");
}

torch::Tensor swiglu_forward(torch::Tensor h, c10::optional<torch::Tensor> gate) {
  check(h, gate);
  const int64_t rows = h.size(0), hid = h.size(1) / 2;
  auto a = torch::empty({rows, hid}, h.options());
  torch::Tensor g32;
  const float* gp = nullptr;
  if (gate.has_value()) {
    g32 = gate->to(torch::kFloat).contiguous();
    gp = g32.data_ptr<float>();
  }
  if (h.scalar_type() == torch::kBFloat16)
    forward_rows(h.data_ptr<c10::BFloat16>(), gp, a.data_ptr<c10::BFloat16>(), rows, hid);
  else
    forward_rows(h.data_ptr<float>(), gp, a.data_ptr<float>(), rows, hid);
  return a;
}

std::vector<torch::Tensor> swiglu_backward(torch::Tensor da, torch::Tensor h, c10::optional<torch::Tensor> gate,
                                           bool need_gate_grad) {
  check(h, gate);
  const int64_t rows = h.size(0), hid = h.size(1) / 2;
  TORCH_CHECK(da.scalar_type() == h.scalar_type() && da.is_contiguous() && da.dim() == 2 && da.size(0) == rows &&
                  da.size(1) == hid,
              "swiglu_cpu: da must be a contiguous (M, H) tensor of h's dtype");
  auto dh = torch::empty_like(h);
  torch::Tensor g32, dgate;
  const float* gp = nullptr;
  float* dgp = nullptr;
  if (gate.has_value()) {
    g32 = gate->to(torch::kFloat).contiguous();
    gp = g32.data_ptr<float>();
  }
  if (need_gate_grad) {
    dgate = torch::empty({rows}, h.options().dtype(torch::kFloat));
    dgp = dgate.data_ptr<float>();
  }
  if (h.scalar_type() == torch::kBFloat16)
    backward_rows(da.data_ptr<c10::BFloat16>(), h.data_ptr<c10::BFloat16>(), gp, dh.data_ptr<c10::BFloat16>(), dgp,
                  rows, hid);
  else
    backward_rows(da.data_ptr<float>(), h.data_ptr<float>(), gp, dh.data_ptr<float>(), dgp, rows, hid);
  if (need_gate_grad) return {dh, dgate};
  return {dh};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu_forward", &swiglu_forward, "a = silu(g) * u * gate for h = [g | u]");
  m.def("swiglu_backward", &swiglu_backward, "(dh, [dgate]) of swiglu_forward");
}

// The Llama family's small per-token ops on CPU, each one pass over its rows instead of several
// eager ops (and their temporaries): RMSNorm, residual add + RMSNorm, SiLU(gate) * up, and
// rotate-half RoPE. float32; rows spread over torch's threads when there are enough of them.
// Rounding: float32 throughout, as the eager float32 model; only the order of the RMSNorm's sum
// differs (a few ulp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <cstdint>

namespace {

// Rows per parallel chunk: an op over fewer elements than ~16k stays on the calling thread
// (waking torch's pool costs more than the work).
int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              name, ": expected a float32 [rows, features] tensor with unit feature stride");
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t c = 0; c < n; ++c) sq += x[c] * x[c];
  const float rstd = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) out[c] = w[c] * (x[c] * rstd);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1), "rms_norm: weight must be float32 [features]");
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * sx, wp, op + r * n, n, eps);
  });
  return out;
}

// (rms_norm(x + residual), x + residual)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1), "add_rms_norm: weight must be float32 [features]");
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t sx = x.stride(0), sr = residual.stride(0);
  auto total = at::empty({rows, n}, x.options());
  auto out = at::empty({rows, n}, x.options());
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float *tp = total.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* t = tp + r * n;
      const float *a = xp + r * sx, *b = rp + r * sr;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) t[c] = a[c] + b[c];
      norm_row(t, wp, op + r * n, n, eps);
    }
  });
  return {out, total};
}

// silu(g) * u = g * sigmoid(g) * u, the sigmoid from e = exp(-|g|) (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) below; e is 0 past -87, where exp_nonpositive floors. std::exp would stay a scalar libm call, 2.6 ns an
// element: SmolLM2's 1,024-token prefill chunk spent 4.1 ms a layer here.
inline float silu_mul_one(float g, float u) {
  const float e = std::fabs(g) > 87.f ? 0.f : radixserve_cpu::exp_nonpositive(-std::fabs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * u;
}

void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t c = 0;
#ifdef RADIXSERVE_VEC_MATH_AVX2
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; c + 8 <= n; c += 8) {
    const __m256 gv = _mm256_loadu_ps(g + c);
    const __m256 neg = _mm256_or_ps(gv, sign);  // -|g|
    const __m256 e = _mm256_and_ps(radixserve_cpu::exp_nonpositive8(neg),
                                   _mm256_cmp_ps(neg, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + c)));
  }
#endif
  for (; c < n; ++c) o[c] = silu_mul_one(g[c], u[c]);
}

// x [rows, 2 * n] = [gate | up] -> silu(gate) * up [rows, n]
at::Tensor silu_mul(const at::Tensor& x) {
  check_rows(x, "silu_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_mul: expected [rows, 2 * n]");
  const int64_t rows = x.size(0), n = x.size(1) / 2, sx = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(xp + r * sx, xp + r * sx + n, op + r * n, n);
  });
  return out;
}

// Rotate-half RoPE of x [tokens, heads, dim] (unit stride in dim) into a new contiguous tensor;
// cos, sin [max_positions, dim / 2].
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "rope: expected float32 [tokens, heads, dim] with unit dim stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == x.size(0), "rope: positions must be int64 [tokens]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rope: cos and sin must be float32 [positions, dim / 2]");
  auto out = at::empty({tokens, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1), max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(0 <= pp[t] && pp[t] < max_pos, "rope: position ", pp[t], " outside the table");
  }
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + pp[t] * half, *s = sp + pp[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* a = xp + t * st + h * sh;
        float* o = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = a[i] * c[i] - a[i + half] * s[i];
          o[i + half] = a[i + half] * c[i] + a[i] * s[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("rope(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.impl("rope", c10::DispatchKey::CPU, &rope);
}

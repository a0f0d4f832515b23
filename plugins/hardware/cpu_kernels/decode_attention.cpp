// Paged decode attention on CPU: each decode's query against its KV, read in place from the
// pool through its row of slots (no gathered copy, no padding to the longest sequence).
//
// Work items are requests (or, with fewer requests than twice the threads, (request, KV head)
// pairs) spread over torch's intra-op pool. An item streams its keys in blocks: the block's
// scores for its query heads, an online softmax across blocks (running max and sum), then the
// block's values. Rows of the next keys are prefetched, since a sequence's slots are runs the
// allocator handed out, not one contiguous range.
// float32 only; the Python side keeps other dtypes on torch_native's path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // keys scored before their values are accumulated
constexpr int64_t kAhead = 4;   // keys prefetched ahead of the one being read

struct Shape {
  int64_t group, dim, row;  // query heads per KV head, head dim, floats between slots
  float scale, softcap;     // softcap > 0: scores become softcap * tanh(score / softcap)
};

// exp(x) for x <= 0 (a score minus the running max) in branch-free float arithmetic that the
// compiler vectorizes (std::exp stays a scalar call): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by
// Cephes' expf polynomial (about 1 ulp), 2^n from the exponent bits. Below -87 it returns
// ~1e-38 rather than 0, which no softmax weight notices.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline void prefetch(const float* row, int64_t floats) {
  for (int64_t c = 0; c < floats; c += 16) __builtin_prefetch(row + c);  // 64-byte lines
}

// Heads h0 .. h0 + nh - 1 of one request: queries q [nh * group, dim] -> out [nh * group, dim].
// D > 0: the head dim known at compile time (the dot products and value rows unroll into whole
// vector registers); D == 0: s.dim at run time.
template <int D>
void attend(const Shape& s, int64_t nh, const float* q, const float* k_base,
            const float* v_base, const int64_t* slots, int64_t start, int64_t end, float* out,
            float* scores, float* acc, float* run_max, float* run_sum) {
  const int64_t d = D > 0 ? D : s.dim;
  const int64_t rows = nh * s.group;  // query rows handled here
  std::fill(acc, acc + rows * d, 0.f);
  std::fill(run_max, run_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(run_sum, run_sum + rows, 0.f);
  for (int64_t t0 = start; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch(k_base + slots[t0 + i + kAhead] * s.row, nh * d);
      const float* key_row = k_base + slots[t0 + i] * s.row;
      for (int64_t h = 0, r = 0; h < nh; ++h) {
        const float* key = key_row + h * d;
        for (int64_t j = 0; j < s.group; ++j, ++r) {
          const float* qr = q + r * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < d; ++c) dot += qr[c] * key[c];
          scores[r * kBlock + i] = dot * s.scale;
        }
      }
    }
    if (s.softcap > 0.f) {
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores + r * kBlock;
        for (int64_t i = 0; i < n; ++i) sr[i] = s.softcap * std::tanh(sr[i] / s.softcap);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores + r * kBlock;
      float block_max = run_max[r];
      for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, sr[i]);
      const float rescale = std::exp(run_max[r] - block_max);
      run_max[r] = block_max;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sr[i] = exp_nonpositive(sr[i] - block_max);
        sum += sr[i];
      }
      run_sum[r] = run_sum[r] * rescale + sum;
      if (rescale != 1.f) {
        float* ar = acc + r * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) ar[c] *= rescale;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch(v_base + slots[t0 + i + kAhead] * s.row, nh * d);
      const float* value_row = v_base + slots[t0 + i] * s.row;
      for (int64_t h = 0, r = 0; h < nh; ++h) {
        const float* value = value_row + h * d;
        for (int64_t j = 0; j < s.group; ++j, ++r) {
          const float p = scores[r * kBlock + i];
          float* ar = acc + r * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) ar[c] += p * value[c];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = run_sum[r] > 0.f ? 1.f / run_sum[r] : 0.f;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[r * d + c] = acc[r * d + c] * inv;
  }
}

using AttendFn = decltype(&attend<0>);

AttendFn attend_for(int64_t dim) {
  switch (dim) {
    case 64: return &attend<64>;
    case 128: return &attend<128>;
    default: return &attend<0>;
  }
}

// q [nd, H, d]; k_buf, v_buf [slots, kvh, d]; slots [nd, L] (row b's first lens[b] used);
// keys starts[b] .. lens[b] - 1 attended (a sliding window starts past 0); softcap 0: none.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, const at::Tensor& starts,
                            const at::Tensor& lens, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "decode_attention: q must be a contiguous float32 [decodes, heads, dim] tensor");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.scalar_type() == at::kFloat && k_buf.stride(2) == 1 &&
                  k_buf.stride(1) == k_buf.size(2) && k_buf.size(2) == q.size(2),
              "decode_attention: k_buf must be float32 [slots, kv_heads, dim] with dense rows");
  TORCH_CHECK(v_buf.sizes() == k_buf.sizes() && v_buf.strides() == k_buf.strides() &&
                  v_buf.scalar_type() == at::kFloat,
              "decode_attention: v_buf must match k_buf");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "decode_attention: heads not a multiple of kv_heads");
  const int64_t nd = q.size(0), heads = q.size(1), kvh = k_buf.size(1);
  for (const at::Tensor* t : {&slots, &starts, &lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == nd,
                "decode_attention: slots, starts and lens must be contiguous int64, a row each");
  }
  TORCH_CHECK(slots.dim() == 2, "decode_attention: slots must be [decodes, max_len]");
  const Shape s{heads / kvh, q.size(2), k_buf.stride(0), static_cast<float>(scale),
                static_cast<float>(softcap)};
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_buf.data_ptr<float>();
  const float* vp = v_buf.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t max_len = slots.size(1);
  for (int64_t b = 0; b < nd; ++b) {
    TORCH_CHECK(0 <= st[b] && st[b] <= ln[b] && ln[b] <= max_len,
                "decode_attention: need 0 <= starts <= lens <= slots.size(1)");
  }
  float* op = out.data_ptr<float>();
  // A work item is one request's heads when there are enough requests to go round the threads
  // (its rows are then read once, whole), else one KV head of a request.
  const int64_t heads_per_item = nd >= 2 * at::get_num_threads() ? kvh : 1;
  const int64_t items_per_request = kvh / heads_per_item;
  const AttendFn fn = attend_for(s.dim);
  at::parallel_for(0, nd * items_per_request, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = heads_per_item * s.group;
    std::vector<float> scores(kBlock * rows), acc(rows * s.dim), run(2 * rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_request;
      const int64_t h0 = (item % items_per_request) * heads_per_item;
      const int64_t q_off = (b * heads + h0 * s.group) * s.dim;
      fn(s, heads_per_item, qp + q_off, kp + h0 * s.dim, vp + h0 * s.dim, sp + b * max_len,
         st[b], ln[b], op + q_off, scores.data(), acc.data(), run.data(), run.data() + rows);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor starts, "
      "Tensor lens, float scale, float softcap) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}

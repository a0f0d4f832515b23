// Paged decode attention on CPU: each decode's query against its KV, read in place from the
// pool through its row of slots (no gathered copy, no padding to the longest sequence).
//
// Work items are (request, KV head) pairs spread over torch's intra-op pool. An item streams its
// keys in blocks: the block's scores for the head's query group, an online softmax across
// blocks (running max and sum), then the block's values. Rows of the next keys are prefetched,
// since a sequence's slots are runs the allocator handed out, not one contiguous range.
// float32 only; the Python side keeps other dtypes on torch_native's path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // keys scored before their values are accumulated
constexpr int64_t kAhead = 4;   // keys prefetched ahead of the one being read

struct Shape {
  int64_t group, dim, row;  // query heads per KV head, head dim, floats between slots
  float scale, softcap;     // softcap > 0: scores become softcap * tanh(score / softcap)
};

inline void prefetch(const float* row, int64_t d) {
  for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(row + c);  // 64-byte lines
}

// One KV head of one request: queries q [group, dim] -> out [group, dim].
void attend(const Shape& s, const float* q, const float* k_head, const float* v_head,
            const int64_t* slots, int64_t start, int64_t end, float* out, float* scores,
            float* acc, float* run_max, float* run_sum) {
  const int64_t g = s.group, d = s.dim;
  std::fill(acc, acc + g * d, 0.f);
  std::fill(run_max, run_max + g, -std::numeric_limits<float>::infinity());
  std::fill(run_sum, run_sum + g, 0.f);
  for (int64_t t0 = start; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch(k_head + slots[t0 + i + kAhead] * s.row, d);
      const float* key = k_head + slots[t0 + i] * s.row;
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + j * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += qj[c] * key[c];
        const float score = dot * s.scale;
        scores[j * kBlock + i] = s.softcap > 0.f ? s.softcap * std::tanh(score / s.softcap) : score;
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      float* sj = scores + j * kBlock;
      float block_max = run_max[j];
      for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, sj[i]);
      const float rescale = std::exp(run_max[j] - block_max);
      run_max[j] = block_max;
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        sj[i] = std::exp(sj[i] - block_max);
        sum += sj[i];
      }
      run_sum[j] = run_sum[j] * rescale + sum;
      if (rescale != 1.f) {
        float* aj = acc + j * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) aj[c] *= rescale;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch(v_head + slots[t0 + i + kAhead] * s.row, d);
      const float* value = v_head + slots[t0 + i] * s.row;
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * kBlock + i];
        float* aj = acc + j * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) aj[c] += p * value[c];
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float inv = run_sum[j] > 0.f ? 1.f / run_sum[j] : 0.f;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[j * d + c] = acc[j * d + c] * inv;
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
  at::parallel_for(0, nd * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kBlock * s.group), acc(s.group * s.dim), run(2 * s.group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kvh, h = item % kvh;
      const int64_t q_off = (b * heads + h * s.group) * s.dim;
      attend(s, qp + q_off, kp + h * s.dim, vp + h * s.dim, sp + b * max_len, st[b], ln[b],
             op + q_off, scores.data(), acc.data(), run.data(), run.data() + s.group);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu_paged, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor starts, "
      "Tensor lens, float scale, float softcap) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}

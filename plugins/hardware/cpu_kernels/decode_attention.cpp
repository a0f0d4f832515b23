// Paged decode attention on CPU: each decode's query against its KV, read in place from the
// pool through its row of slots (no gathered copy, no padding to the longest sequence).
//
// Work items are requests (or, with fewer requests than twice the threads, (request, KV head)
// pairs) spread over torch's intra-op pool. An item streams its keys in blocks: the block's
// scores for its query heads, an online softmax across blocks (running max and sum), then the
// block's values. Rows of the next keys are prefetched, since a sequence's slots are runs the
// allocator handed out, not one contiguous range.
// Queries float32; the cache float32, or float16 / bfloat16 (--kv-cache-dtype), widened on load.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXSERVE_ATTN_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 64;  // keys scored before their values are accumulated
constexpr int64_t kAhead = 4;   // keys prefetched ahead of the one being read
constexpr int64_t kMinPartKeys = 64;  // the fewest keys worth a part of their own

struct Shape {
  int64_t group, dim, row;  // query heads per KV head, head dim, floats between slots
  float scale, softcap;     // softcap > 0: scores become softcap * tanh(score / softcap)
};

using radixserve_cpu::exp_nonpositive;
#ifdef RADIXSERVE_ATTN_AVX2
using radixserve_cpu::exp_nonpositive8;

// 8 cached K/V elements as floats (float16 through F16C; bfloat16 is float32's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The sums of 8 vectors' lanes, as one vector: lane j = sum of p[j]'s 8 lanes.
inline __m256 sum_lanes8(const __m256* p) {
  const __m256 t0 = _mm256_hadd_ps(p[0], p[1]), t1 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 t2 = _mm256_hadd_ps(p[4], p[5]), t3 = _mm256_hadd_ps(p[6], p[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One query row's block of n scores (a row of kBlock floats) -> exp(score - new max), in place;
// returns the new running max and adds the block's sum of weights to *sum.
inline float softmax_block8(float* sr, int64_t n, float run_max, float* sum) {
  const int64_t padded = (n + 7) / 8 * 8;  // kBlock is a multiple of 8
  for (int64_t i = n; i < padded; ++i) sr[i] = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(run_max);
  for (int64_t i = 0; i < padded; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float block_max = _mm_cvtss_f32(m4);
  const __m256 top = _mm256_set1_ps(block_max);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sr + i), top));
    if (i + 8 > n) {  // lanes past n: weight 0 (exp_nonpositive floors at ~1e-38, not 0)
      const __m256 lane = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(i)),
                                        _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
      e = _mm256_and_ps(e, _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ));
    }
    _mm256_storeu_ps(sr + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  *sum = _mm_cvtss_f32(s4);
  return block_max;
}
#endif

// The 64-byte lines of `count` elements from `row`.
template <typename T>
inline void prefetch(const T* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t size = count * static_cast<int64_t>(sizeof(T));
  for (int64_t c = 0; c < size; c += 64) __builtin_prefetch(bytes + c);
}

// A cached K/V element as float: the cache is float32, or float16 / bfloat16 beside float32
// queries (--kv-cache-dtype).
inline float widen(float x) { return x; }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// Scores of the n keys at slots[0 .. n - 1] for every query row r: scores[r * kBlock + i].
template <typename KV, int D>
void score_block(const Shape& s, int64_t nh, const float* q, const KV* k_base,
                 const int64_t* slots, int64_t n, float* scores) {
  const int64_t d = D > 0 ? D : s.dim;
#ifdef RADIXSERVE_ATTN_AVX2
  if constexpr (D > 0 && D % 8 == 0) {
    // Per query row (held in registers), 8 keys at a time: each key's products summed lane-wise
    // with FMAs, then the 8 keys' lanes reduced together (a handful of adds for 8 dot
    // products, where reducing each dot on its own cost as much as computing it).
    constexpr int kVecs = D / 8;
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      const int64_t m = std::min<int64_t>(8, n - i0);
      for (int64_t j = i0 + 8; j < std::min(i0 + 16, n); ++j)  // the next 8 keys
        prefetch(k_base + slots[j] * s.row, nh * d);
      for (int64_t h = 0, r = 0; h < nh; ++h) {
        for (int64_t g = 0; g < s.group; ++g, ++r) {
          __m256 qv[kVecs];
          for (int c = 0; c < kVecs; ++c) qv[c] = _mm256_loadu_ps(q + r * D + 8 * c);
          __m256 part[8];
          for (int64_t j = 0; j < 8; ++j) {
            if (j >= m) {
              part[j] = _mm256_setzero_ps();
              continue;
            }
            const KV* key = k_base + slots[i0 + j] * s.row + h * D;
            __m256 a = _mm256_mul_ps(qv[0], load8(key));
            __m256 b = kVecs > 1 ? _mm256_mul_ps(qv[1], load8(key + 8)) : _mm256_setzero_ps();
            for (int c = 2; c + 1 < kVecs; c += 2) {
              a = _mm256_fmadd_ps(qv[c], load8(key + 8 * c), a);
              b = _mm256_fmadd_ps(qv[c + 1], load8(key + 8 * c + 8), b);
            }
            part[j] = _mm256_add_ps(a, b);
          }
          // kBlock is a multiple of 8: all 8 lanes fit in the row, the ones past n unused
          _mm256_storeu_ps(scores + r * kBlock + i0,
                           _mm256_mul_ps(sum_lanes8(part), _mm256_set1_ps(s.scale)));
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch(k_base + slots[i + kAhead] * s.row, nh * d);
    const KV* key_row = k_base + slots[i] * s.row;
    for (int64_t h = 0, r = 0; h < nh; ++h) {
      const KV* key = key_row + h * d;
      for (int64_t j = 0; j < s.group; ++j, ++r) {
        const float* qr = q + r * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += qr[c] * widen(key[c]);
        scores[r * kBlock + i] = dot * s.scale;
      }
    }
  }
}

// acc[r] += sum over the n keys at slots[0 .. n - 1] of scores[r * kBlock + i] * value_i.
template <typename KV, int D>
void accumulate_block(const Shape& s, int64_t nh, const KV* v_base, const int64_t* slots,
                      int64_t n, const float* scores, float* acc) {
  const int64_t d = D > 0 ? D : s.dim;
#ifdef RADIXSERVE_ATTN_AVX2
  if constexpr (D > 0 && D % 8 == 0) {
    // One query row's D floats stay in registers over the block's keys (each a chain of FMAs),
    // rather than a load and store of the row for every key.
    constexpr int kVecs = D / 8;
    for (int64_t h = 0, r = 0; h < nh; ++h) {
      for (int64_t g = 0; g < s.group; ++g, ++r) {
        float* ar = acc + r * D;
        __m256 a[kVecs];
        for (int c = 0; c < kVecs; ++c) a[c] = _mm256_loadu_ps(ar + 8 * c);
        const float* sr = scores + r * kBlock;
        for (int64_t i = 0; i < n; ++i) {
          const KV* value = v_base + slots[i] * s.row + h * D;
          const __m256 p = _mm256_set1_ps(sr[i]);
          for (int c = 0; c < kVecs; ++c) a[c] = _mm256_fmadd_ps(p, load8(value + 8 * c), a[c]);
        }
        for (int c = 0; c < kVecs; ++c) _mm256_storeu_ps(ar + 8 * c, a[c]);
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch(v_base + slots[i + kAhead] * s.row, nh * d);
    const KV* value_row = v_base + slots[i] * s.row;
    for (int64_t h = 0, r = 0; h < nh; ++h) {
      const KV* value = value_row + h * d;
      for (int64_t j = 0; j < s.group; ++j, ++r) {
        const float p = scores[r * kBlock + i];
        float* ar = acc + r * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) ar[c] += p * widen(value[c]);
      }
    }
  }
}

// Heads h0 .. h0 + nh - 1 of one request over keys start .. end - 1: queries q [nh * group, dim]
// -> the softmax's unnormalized state: acc [nh * group, dim] (weighted values), run_max and
// run_sum [nh * group]. D > 0: the head dim known at compile time (the dot products and value
// rows unroll into whole vector registers); D == 0: s.dim at run time.
template <typename KV, int D>
void attend(const Shape& s, int64_t nh, const float* q, const KV* k_base,
            const KV* v_base, const int64_t* slots, int64_t start, int64_t end,
            float* scores, float* acc, float* run_max, float* run_sum) {
  const int64_t d = D > 0 ? D : s.dim;
  const int64_t rows = nh * s.group;  // query rows handled here
  std::fill(acc, acc + rows * d, 0.f);
  std::fill(run_max, run_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(run_sum, run_sum + rows, 0.f);
  for (int64_t t0 = start; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0);
    score_block<KV, D>(s, nh, q, k_base, slots + t0, n, scores);
    if (s.softcap > 0.f) {
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores + r * kBlock;
        for (int64_t i = 0; i < n; ++i) sr[i] = s.softcap * std::tanh(sr[i] / s.softcap);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores + r * kBlock;
      float sum = 0.f;
#ifdef RADIXSERVE_ATTN_AVX2
      // the scalar loops below stayed scalar in the compiled kernel: a quarter of its time
      const float block_max = softmax_block8(sr, n, run_max[r], &sum);
#else
      float block_max = run_max[r];
      for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, sr[i]);
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sr[i] = exp_nonpositive(sr[i] - block_max);
        sum += sr[i];
      }
#endif
      const float rescale = std::exp(run_max[r] - block_max);
      run_max[r] = block_max;
      run_sum[r] = run_sum[r] * rescale + sum;
      if (rescale != 1.f) {
        float* ar = acc + r * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) ar[c] *= rescale;
      }
    }
    accumulate_block<KV, D>(s, nh, v_base, slots + t0, n, scores, acc);
  }
}

template <typename KV>
using AttendFn = decltype(&attend<KV, 0>);

template <typename KV>
AttendFn<KV> attend_for(int64_t dim) {
  switch (dim) {
    case 64: return &attend<KV, 64>;
    case 128: return &attend<KV, 128>;
    default: return &attend<KV, 0>;
  }
}

// f(KV{}) with KV the C++ type of a cache of dtype `type` (float32, float16 or bfloat16).
template <typename F>
void with_kv_type(at::ScalarType type, const char* op, F&& f) {
  if (type == at::kFloat) {
    f(float{});
  } else if (type == at::kHalf) {
    f(c10::Half{});
  } else {
    TORCH_CHECK(type == at::kBFloat16, op, ": the KV cache must be float32, float16 or bfloat16");
    f(c10::BFloat16{});
  }
}

// q [nd, H, d]; k_buf, v_buf [slots, kvh, d]; slots [nd, L] (row b's first lens[b] used);
// keys starts[b] .. lens[b] - 1 attended (a sliding window starts past 0); softcap 0: none.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, const at::Tensor& starts,
                            const at::Tensor& lens, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "decode_attention: q must be a contiguous float32 [decodes, heads, dim] tensor");
  const auto kv_type = k_buf.scalar_type();
  TORCH_CHECK(k_buf.dim() == 3 &&
                  (kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) &&
                  k_buf.stride(2) == 1 && k_buf.stride(1) == k_buf.size(2) &&
                  k_buf.size(2) == q.size(2),
              "decode_attention: k_buf must be float32, float16 or bfloat16 [slots, kv_heads, "
              "dim] with dense rows");
  TORCH_CHECK(v_buf.sizes() == k_buf.sizes() && v_buf.strides() == k_buf.strides() &&
                  v_buf.scalar_type() == kv_type,
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
  // (its rows are then read once, whole), else one KV head of a request. With fewer items than
  // twice the threads (batch 1: 3 KV heads on 2 threads left one thread idle a third of the
  // time), each item's keys are split into parts whose softmax states are merged afterwards.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = nd >= 2 * threads ? kvh : 1;
  const int64_t items_per_request = kvh / heads_per_item;
  const int64_t rows = heads_per_item * s.group;
  int64_t longest = 0;
  for (int64_t b = 0; b < nd; ++b) longest = std::max(longest, ln[b] - st[b]);
  const int64_t items = nd * items_per_request;
  const int64_t parts = std::max<int64_t>(
      1, std::min((2 * threads + items - 1) / items, longest / kMinPartKeys));
  // The parts' states: acc [item, part, rows, dim], then max and sum [item, part, rows].
  std::vector<float> state(items * parts * rows * (s.dim + 2));
  float* acc_all = state.data();
  float* max_all = acc_all + items * parts * rows * s.dim;
  float* sum_all = max_all + items * parts * rows;
  // Item's output: its parts merged (each rescaled to the largest max) and normalized.
  auto finish = [&](int64_t item) {
    const int64_t b = item / items_per_request;
    const int64_t h0 = (item % items_per_request) * heads_per_item;
    float* o = op + (b * heads + h0 * s.group) * s.dim;
    for (int64_t r = 0; r < rows; ++r) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t part = 0; part < parts; ++part)
        top = std::max(top, max_all[(item * parts + part) * rows + r]);
      float total = 0.f;
      float* orow = o + r * s.dim;
      std::fill(orow, orow + s.dim, 0.f);
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t at = (item * parts + part) * rows + r;
        if (sum_all[at] == 0.f) continue;  // a part with no keys
        const float w = parts == 1 ? 1.f : std::exp(max_all[at] - top);
        total += sum_all[at] * w;
        const float* arow = acc_all + at * s.dim;
#pragma omp simd
        for (int64_t c = 0; c < s.dim; ++c) orow[c] += w * arow[c];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma omp simd
      for (int64_t c = 0; c < s.dim; ++c) orow[c] *= inv;
    }
  };
  auto run = [&](auto kv_tag) {
    using KV = decltype(kv_tag);
    const auto* kp = static_cast<const KV*>(k_buf.data_ptr());
    const auto* vp = static_cast<const KV*>(v_buf.data_ptr());
    const AttendFn<KV> fn = attend_for<KV>(s.dim);
    at::parallel_for(0, items * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(kBlock * rows);
      for (int64_t work = begin; work < end; ++work) {
        const int64_t item = work / parts, part = work % parts;
        const int64_t b = item / items_per_request;
        const int64_t h0 = (item % items_per_request) * heads_per_item;
        const int64_t q_off = (b * heads + h0 * s.group) * s.dim;
        const int64_t span = ln[b] - st[b], first = st[b] + span * part / parts,
                      last = st[b] + span * (part + 1) / parts;
        fn(s, heads_per_item, qp + q_off, kp + h0 * s.dim, vp + h0 * s.dim, sp + b * max_len,
           first, last, scores.data(), acc_all + work * rows * s.dim, max_all + work * rows,
           sum_all + work * rows);
        if (parts == 1) finish(item);
      }
    });
    if (parts > 1) {
      at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) finish(item);
      });
    }
  };
  with_kv_type(kv_type, "decode_attention", run);
  return out;
}

// k_new, v_new [nd, kvh, d] float32 written to rows loc[i] of k_buf, v_buf (rounded to their
// dtype), then decode_attention over the pool: a decode-only step's store and attention in one
// call, where the store alone took four more ops a layer (two casts, two index copies).
at::Tensor store_decode_attention(const at::Tensor& q, const at::Tensor& k_new,
                                  const at::Tensor& v_new, const at::Tensor& loc,
                                  const at::Tensor& k_buf, const at::Tensor& v_buf,
                                  const at::Tensor& slots, const at::Tensor& starts,
                                  const at::Tensor& lens, double scale, double softcap) {
  TORCH_CHECK(k_new.dim() == 3 && k_new.scalar_type() == at::kFloat &&
                  v_new.sizes() == k_new.sizes() && v_new.scalar_type() == at::kFloat &&
                  k_buf.dim() == 3 && k_new.size(1) == k_buf.size(1) &&
                  k_new.size(2) == k_buf.size(2),
              "store_decode_attention: k_new and v_new must be float32 [decodes, kv_heads, dim] "
              "matching the pool");
  TORCH_CHECK(loc.dim() == 1 && loc.scalar_type() == at::kLong && loc.size(0) == k_new.size(0),
              "store_decode_attention: loc must be int64 [decodes]");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && v_buf.sizes() == k_buf.sizes() &&
                  v_buf.scalar_type() == k_buf.scalar_type(),
              "store_decode_attention: k_buf and v_buf must be contiguous and alike");
  const at::Tensor kc = k_new.contiguous(), vc = v_new.contiguous(), lc = loc.contiguous();
  const int64_t n = kc.size(0), row = kc.size(1) * kc.size(2), slots_in_pool = k_buf.size(0);
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= lp[i] && lp[i] < slots_in_pool, "store_decode_attention: slot ", lp[i],
                " outside the pool of ", slots_in_pool);
  }
  auto store = [&](auto kv_tag) {
    using KV = decltype(kv_tag);
    const float* ks = kc.data_ptr<float>();
    const float* vs = vc.data_ptr<float>();
    KV* kd = static_cast<KV*>(k_buf.data_ptr());
    KV* vd = static_cast<KV*>(v_buf.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < row; ++c) {
        kd[lp[i] * row + c] = static_cast<KV>(ks[i * row + c]);
        vd[lp[i] * row + c] = static_cast<KV>(vs[i * row + c]);
      }
    }
  };
  with_kv_type(k_buf.scalar_type(), "store_decode_attention", store);
  return decode_attention(q, k_buf, v_buf, slots, starts, lens, scale, softcap);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor starts, "
      "Tensor lens, float scale, float softcap) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.def(
      "store_decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor loc, Tensor(a!) k_buf, "
      "Tensor(b!) v_buf, Tensor slots, Tensor starts, Tensor lens, float scale, float softcap) "
      "-> Tensor");
  m.impl("store_decode_attention", c10::DispatchKey::CPU, &store_decode_attention);
}

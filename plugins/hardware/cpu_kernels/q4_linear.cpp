// A linear layer over 4-bit weight blocks with 8-bit activation blocks: llama.cpp's arithmetic
// for a Q4_1 GGUF file (its vec_dot_q4_1_q8_1), for steps of a few rows.
//
// Weights: per output row, one 20-byte block per 32 input features, GGUF's block_q4_1 layout:
// float16 d, float16 m, then 16 bytes of codes where byte j holds q[j] (low nibble) and q[j + 16]
// (high nibble); w[i] = d * q[i] + m. Activations: each row is rounded per 32 features to int8
// codes with one float scale (amax / 127), and the block's sum kept, so a block's dot product is
// d * dx * sum(q * qx) + m * dx * sum(qx), with the sum of products in exact integers.
//
// Why integers: torch's int4 weight-only kernel converts every weight to float and is
// compute-bound on an AVX2 CPU at one row (16 ms a SmolLM2 step on one core, reading ~53 MB);
// here 32 weights cost a handful of integer instructions (unpack, u8 x s8 multiply-add), and the
// step is bounded by reading the blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXSERVE_Q4_AVX2 1
// AVX-512 VNNI (with 256-bit forms): one u8 x s8 multiply-add into int32 lanes (vpdpbusd) where
// AVX2 needs two (vpmaddubsw, vpmaddwd). The library is built with -march=native for the CPU it
// runs on (cpu_kernels/__init__.py keys it by the CPU), so the host's best form is chosen per
// machine; both give the same exact integer sums.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RADIXSERVE_Q4_VNNI 1
#endif
#endif

namespace {

constexpr int64_t kBlock = 32;       // features per block
constexpr int64_t kBlockBytes = 20;  // 2 + 2 + 16

float half_to_float(uint16_t h) {
#ifdef RADIXSERVE_Q4_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal
    if (man == 0) {
      bits = sign;
    } else {
      float f = std::ldexp(static_cast<float>(man), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// One activation row as 8-bit blocks: codes [in], and per block the pair (scale, scale * sum of
// codes), interleaved so that one 8-byte load brings both.
struct QuantRow {
  const int8_t* codes;
  const float* pairs;
};

void quantize_row(const float* x, int64_t n, int8_t* codes, float* pairs) {
  for (int64_t b = 0; b < n / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(xb[i] * id));
      codes[b * kBlock + i] = static_cast<int8_t>(q);
      sum += q;
    }
    pairs[2 * b] = d;
    pairs[2 * b + 1] = d * static_cast<float>(sum);
  }
}

#ifdef RADIXSERVE_Q4_AVX2
// One weight block, unpacked: (d, m) as floats in lanes 0 and 1, and its 32 codes as bytes,
// q[0..15] (low nibbles) then q[16..31] (high nibbles).
struct Block {
  __m128 dm;
  __m256i q;
};

inline Block unpack(const uint8_t* blk) {
  int32_t dm_bits;
  std::memcpy(&dm_bits, blk, 4);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  return {_mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits)),
          _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                           _mm256_set1_epi8(0x0f))};
}

// Block i against activation row x: the block's (d, m) times the activation block's
// (scale, scale * sum) in one multiply (lane 0 scales the integer sum, lane 1 is the m term,
// summed in `offset` rather than a scalar chain: 10% faster than converting d and m one at a
// time), and the codes' integer dot product scaled into `acc`.
inline void accumulate(const Block& w, const QuantRow& x, int64_t i, __m256& acc,
                       __m128& offset) {
  const __m128 xs = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.pairs + 2 * i)));
  const __m128 scales = _mm_mul_ps(w.dm, xs);  // [d * dx, m * dx * sum(qx), 0, 0]
  offset = _mm_add_ps(offset, scales);
  const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + i * kBlock));
#ifdef RADIXSERVE_Q4_VNNI
  const __m256i prod = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w.q, qx);
#else
  // u8 (0..15) x s8 pairs summed to s16: at most 2 * 15 * 127, no saturation
  const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(w.q, qx), _mm256_set1_epi16(1));
#endif
  acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), _mm256_cvtepi32_ps(prod), acc);
}

// The row's result: acc's lanes summed, plus the m terms (offset's lane 1).
inline float row_total(__m256 acc, __m128 offset) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_movehdup_ps(offset));
}
#endif

// The dot product of one weight row (its blocks) and one quantized activation row.
float dot_row(const uint8_t* w, const QuantRow& x, int64_t blocks) {
#ifdef RADIXSERVE_Q4_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  __m128 offset0 = _mm_setzero_ps(), offset1 = _mm_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {  // two chains for the FMA latency
    accumulate(unpack(w + b * kBlockBytes), x, b, acc0, offset0);
    accumulate(unpack(w + (b + 1) * kBlockBytes), x, b + 1, acc1, offset1);
  }
  if (b < blocks) accumulate(unpack(w + b * kBlockBytes), x, b, acc0, offset0);
  return row_total(_mm256_add_ps(acc0, acc1), _mm_add_ps(offset0, offset1));
#else
  float total = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = w + i * kBlockBytes;
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    const int8_t* qx = x.codes + i * kBlock;
    int32_t sum = 0;
    for (int64_t j = 0; j < 16; ++j) {
      sum += static_cast<int32_t>(blk[4 + j] & 0x0f) * qx[j];
      sum += static_cast<int32_t>(blk[4 + j] >> 4) * qx[j + 16];
    }
    total += half_to_float(dh) * x.pairs[2 * i] * static_cast<float>(sum) +
             half_to_float(mh) * x.pairs[2 * i + 1];
  }
  return total;
#endif
}

#ifdef RADIXSERVE_Q4_AVX2
// One weight row against R activation rows (2 <= R <= 4): each block is unpacked once and
// multiplied by every row's codes, where dot_row per row would unpack it R times (the LM head
// screen at 8 rows took 6x one row's time that way).
template <int R>
void dot_rows(const uint8_t* w, const QuantRow* x, int64_t blocks, float* y, int64_t y_stride) {
  __m256 acc[R];
  __m128 offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = _mm_setzero_ps();
  }
  for (int64_t i = 0; i < blocks; ++i) {
    const Block block = unpack(w + i * kBlockBytes);
    for (int r = 0; r < R; ++r) accumulate(block, x[r], i, acc[r], offset[r]);
  }
  for (int r = 0; r < R; ++r) y[r * y_stride] = row_total(acc[r], offset[r]);
}
#endif

// Output o for activation rows r0 .. rows - 1, written to y[r * out + o].
void weight_row(const uint8_t* w, const QuantRow* qrows, int64_t rows, int64_t blocks,
                float* y, int64_t out) {
  int64_t r = 0;
#ifdef RADIXSERVE_Q4_AVX2
  for (; r + 4 <= rows; r += 4) dot_rows<4>(w, qrows + r, blocks, y + r * out, out);
  switch (rows - r) {
    case 3: dot_rows<3>(w, qrows + r, blocks, y + r * out, out); return;
    case 2: dot_rows<2>(w, qrows + r, blocks, y + r * out, out); return;
    default: break;
  }
#endif
  for (; r < rows; ++r) y[r * out] = dot_row(w, qrows[r], blocks);
}

// x: float32 [rows, in]; blocks: uint8 [out, in / 32 * 20] -> float32 [rows, out]
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "q4_1_linear: x must be float32 [rows, in_features]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "q4_1_linear: blocks must be contiguous uint8 [out_features, in_features / 32 * 20]");
  const int64_t rows = x.size(0), in = x.size(1), out = blocks.size(0);
  TORCH_CHECK(in % kBlock == 0 && blocks.size(1) == in / kBlock * kBlockBytes,
              "q4_1_linear: ", in, " input features do not match blocks of shape ",
              blocks.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t nb = in / kBlock;
  std::vector<int8_t> codes(rows * in);
  std::vector<float> pairs(rows * nb * 2);
  std::vector<QuantRow> qrows(rows);
  const float* xp = xc.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(xp + r * in, in, codes.data() + r * in, pairs.data() + r * nb * 2);
    qrows[r] = {codes.data() + r * in, pairs.data() + r * nb * 2};
  }
  auto y = at::empty({rows, out}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = nb * kBlockBytes;
  // ~16 KB of weights per chunk: enough to pay for waking a thread
  const int64_t grain = std::max<int64_t>(16, 16384 / row_bytes);
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      weight_row(wp + o * row_bytes, qrows.data(), rows, nb, yp + o, out);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks) -> Tensor");
  m.impl("q4_1_linear", c10::DispatchKey::CPU, &q4_1_linear);
}

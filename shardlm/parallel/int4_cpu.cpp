// int4 weights x int8 activations on the CPU: llama.cpp's way of multiplying 4-bit blocks
// (Q4_1 x Q8_1), written for torch. Why it exists, what it replaced and its speed:
// shardlm/parallel/int4.py and docs/performance.md ("Int4 weights and llama.cpp").
//
// A weight row n is K / 32 blocks of 32 codes q in 0..15, two a byte (byte j of a block holds
// element j in its low nibble and element j + 16 in its high one, as a GGUF file does), and a
// float16 scale d and offset m per block: w = d * q + m. An activation row is quantized per block
// of 32 to int8 (xq = round(x / dx), dx = max|x| / 127), so a block's dot product is
//     d * dx * sum(q * xq) + m * dx * sum(xq)
// with sum(q * xq) in integers (AVX2: _mm256_maddubs_epi16 multiplies unsigned by signed bytes).
// Few rows (decode) take that path; many rows (prefill) are a float GEMM, so the weight is
// dequantized a slice of rows at a time and multiplied by torch's BLAS. The same for 8-bit blocks
// (Q8_0 x Q8_0), which hold the embedding / LM head. And, for the same decode steps, the paged KV
// cache's write and one-token attention in the model's dtype (a Python op's call overhead each).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SHARDLM_X86 1
#endif

namespace {

constexpr int64_t kGroup = 32;

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The activations' blocks: xq int8 [M, K], dx and sx = dx * sum(xq) float [M, K / 32], in the
// calling thread's buffers (reused from call to call: no allocation in a decode step).
struct QuantRows {
  const int8_t* xq;
  const float* dx;
  const float* sx;
};

// Where element j of block b of a row goes in xq. In natural order at b * 32 + j; ``paired``, each
// pair of blocks (b, b + 1), b even, in the order one 32-byte load of their codes unpacks to (low
// nibbles: both blocks' elements 0..15, high: both blocks' 16..31), so a pair needs no shuffle
// (``pair_dot``); a last, odd block stays in natural order.
inline int64_t slot(int64_t b, int j, int64_t B, bool paired) {
  if (!paired || (b == B - 1 && B % 2)) return b * kGroup + j;
  return (b - b % 2) * kGroup + (j / 16) * 32 + (b % 2) * 16 + j % 16;
}

// Ask for the bytes [p, p + n) ahead of their use (into every cache level); a no-op without x86.
// Always inlined: as a call inside attention's position loops it kept them from vectorising.
inline __attribute__((always_inline)) void prefetch_bytes(const void* p, int64_t n) {
#ifdef SHARDLM_X86
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
  _mm_prefetch(c + n - 1, _MM_HINT_T0);
#else
  (void)p;
  (void)n;
#endif
}

// One block's max |x|, and its quantization: its 32 codes, elements 0..15 to ``first`` and 16..31 to
// ``second``, returning sum(xq). The portable loops, then the same in AVX2 (the same values: both
// round half to even); without x86 the AVX2 names are the portable loops.
float block_amax(const float* v) {
  float amax = 0.f;
  for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(v[j]));
  return amax;
}

int quantize_block(const float* v, float inv, int8_t* first, int8_t* second) {
  int sum = 0;
  for (int j = 0; j < kGroup; ++j) {
    const int q = static_cast<int>(std::nearbyint(v[j] * inv));
    (j < 16 ? first : second)[j % 16] = static_cast<int8_t>(q);
    sum += q;
  }
  return sum;
}

#ifdef SHARDLM_X86
__attribute__((target("avx2,fma,f16c"))) float block_amax_avx2(const float* v) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(v));
  for (int j = 8; j < kGroup; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

__attribute__((target("avx2,fma,f16c"))) int quantize_block_avx2(const float* v, float inv, int8_t* first,
                                                                 int8_t* second) {
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int j = 0; j < 4; ++j)
    q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), scale),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
  s = _mm_hadd_epi32(s, s);
  s = _mm_hadd_epi32(s, s);
  // packs interleaves the 128-bit lanes: [0-3, 8-11, 16-19, 24-27, 4-7, ...]; put them back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(ordered));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm256_extracti128_si256(ordered, 1));
  return _mm_cvtsi128_si32(s);
}
#else
float block_amax_avx2(const float* v) { return block_amax(v); }
int quantize_block_avx2(const float* v, float inv, int8_t* first, int8_t* second) {
  return quantize_block(v, inv, first, second);
}
#endif

QuantRows quantize_rows(const float* xp, int64_t M, int64_t K, bool paired, bool avx2) {
  const int64_t B = K / kGroup;
  thread_local std::vector<int8_t> qs;
  thread_local std::vector<float> ds, ss;
  qs.resize(M * K);
  ds.resize(M * B);
  ss.resize(M * B);
  int8_t* qp = qs.data();
  float* dp = ds.data();
  float* sp = ss.data();
  at::parallel_for(0, M * B, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* v = xp + i * kGroup;  // block i of the flattened rows (K is whole blocks)
      int8_t* row = qp + (i / B) * K;
      const int64_t b = i % B;
      const float amax = avx2 ? block_amax_avx2(v) : block_amax(v);
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t *first = row + slot(b, 0, B, paired), *second = row + slot(b, 16, B, paired);
      const int sum = avx2 ? quantize_block_avx2(v, inv, first, second) : quantize_block(v, inv, first, second);
      dp[i] = d;
      sp[i] = d * static_cast<float>(sum);
    }
  });
  return {qp, dp, sp};
}

// y[m, n] for rows [n0, n1) of the weight; the portable loop (any CPU).
void dot_rows_scalar(const uint8_t* codes, const uint16_t* d, const uint16_t* mins, const QuantRows& a, float* y,
                     int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t B = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        const uint8_t* w = codes + n * (K / 2) + b * 16;
        const int8_t* v = a.xq + m * K + b * kGroup;
        int s = 0;
        for (int j = 0; j < 16; ++j) s += (w[j] & 0xf) * v[j] + (w[j] >> 4) * v[j + 16];
        acc += half_to_float(d[n * B + b]) * a.dx[m * B + b] * static_cast<float>(s) +
               half_to_float(mins[n * B + b]) * a.sx[m * B + b];
      }
      y[m * N + n] = acc;
    }
  }
}

#ifdef SHARDLM_X86
__attribute__((target("avx2,fma,f16c"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block's 32 codes as bytes 0..15 in element order.
__attribute__((target("avx2,fma,f16c"))) inline __m256i unpack(const uint8_t* w) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

// sum(q * xq) of one block as 8 int32 lanes, in float.
__attribute__((target("avx2,fma,f16c"))) inline __m256 block_dot(__m256i w, const int8_t* v) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

// sum(q * xq) of a pair of blocks from one 32-byte load of their codes, against the pair's 64
// activations in ``slot``'s paired order: lanes 0..3 the first block's, 4..7 the second's, in
// float. The two byte products' int16 sums are added before widening (each |.| <= 2 * 15 * 127 *
// 2, far from saturating).
__attribute__((target("avx2,fma,f16c"))) inline __m256 pair_dot(const uint8_t* w, const int8_t* v) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32));
  const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(raw, nib), x0);
  const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nib), x1);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(lo, hi), _mm256_set1_epi16(1)));
}

// How many weight rows ahead of its dot products a row's bytes are asked for: the hardware's own
// prefetch leaves a core's loads idle across the short streams of a row (codes, scales, offsets);
// the distance was chosen by measurement (docs/performance.md, "Int4 weights and llama.cpp").
constexpr int64_t kAhead = 8;

// sum_b mins[b] * sx[b]: the offsets' share of a row's dot product, 8 blocks at a time.
__attribute__((target("avx2,fma,f16c"))) inline float offsets(const uint16_t* mins, const float* sx, int64_t B) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= B; b += 8) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b)));
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx + b), acc);
  }
  float s = hsum(acc);
  for (; b < B; ++b) s += _cvtsh_ss(mins[b]) * sx[b];
  return s;
}

// One weight row against T activation rows (xq in ``slot``'s paired order), which share each
// loaded pair of weight blocks. Eight blocks a turn: their scales d * dx are one vector per row,
// and each pair's [d0 * dx0 x 4, d1 * dx1 x 4] a lane permutation of it; two accumulators per row.
template <int T>
__attribute__((target("avx2,fma,f16c"))) void dot_tile(const uint8_t* w, const uint16_t* d, const uint16_t* mins,
                                                       const int8_t* xq, const float* dx, const float* sx, float* y,
                                                       int64_t N, int64_t K) {
  const int64_t B = K / kGroup;
  const __m256i pick[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                           _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= B; b += 8) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b)));
    __m256 sc[T];
    for (int t = 0; t < T; ++t) sc[t] = _mm256_mul_ps(dv, _mm256_loadu_ps(dx + t * B + b));
    for (int p = 0; p < 4; ++p) {
      const uint8_t* wp = w + (b + 2 * p) * 16;
      for (int t = 0; t < T; ++t)
        acc[t][p & 1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc[t], pick[p]),
                                        pair_dot(wp, xq + t * K + (b + 2 * p) * kGroup), acc[t][p & 1]);
    }
  }
  for (; b + 2 <= B; b += 2) {  // the pairs left
    for (int t = 0; t < T; ++t) {
      const float s0 = _cvtsh_ss(d[b]) * dx[t * B + b], s1 = _cvtsh_ss(d[b + 1]) * dx[t * B + b + 1];
      acc[t][0] = _mm256_fmadd_ps(_mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1),
                                  pair_dot(w + b * 16, xq + t * K + b * kGroup), acc[t][0]);
    }
  }
  if (b < B) {  // an odd last block, in natural order
    const __m256i w0 = unpack(w + b * 16);
    for (int t = 0; t < T; ++t)
      acc[t][1] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(d[b]) * dx[t * B + b]),
                                  block_dot(w0, xq + t * K + b * kGroup), acc[t][1]);
  }
  for (int t = 0; t < T; ++t) y[t * N] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + offsets(mins, sx + t * B, B);
}

__attribute__((target("avx2,fma,f16c"))) void dot_rows_avx2(const uint8_t* codes, const uint16_t* d,
                                                            const uint16_t* mins, const QuantRows& a, float* y,
                                                            int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t B = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = codes + n * (K / 2);
    if (n + kAhead < n1) {
      prefetch_bytes(w + kAhead * (K / 2), K / 2);
      prefetch_bytes(d + (n + kAhead) * B, B * 2);
      prefetch_bytes(mins + (n + kAhead) * B, B * 2);
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      dot_tile<4>(w, d + n * B, mins + n * B, a.xq + m * K, a.dx + m * B, a.sx + m * B, y + m * N + n, N, K);
    for (; m < M; ++m)
      dot_tile<1>(w, d + n * B, mins + n * B, a.xq + m * K, a.dx + m * B, a.sx + m * B, y + m * N + n, N, K);
  }
}
#endif

// 8-bit weights (Q8_0: w = d * q, q in -127..127, a float16 d per 32): the embedding / LM head.
void q8_rows_scalar(const int8_t* codes, const uint16_t* d, const QuantRows& a, float* y, int64_t M, int64_t N,
                    int64_t K, int64_t n0, int64_t n1) {
  const int64_t B = K / kGroup;
  const int8_t* xq = a.xq;
  const float* dx = a.dx;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        const int8_t* w = codes + n * K + b * kGroup;
        const int8_t* v = xq + m * K + b * kGroup;
        int s = 0;
        for (int j = 0; j < kGroup; ++j) s += w[j] * v[j];
        acc += half_to_float(d[n * B + b]) * dx[m * B + b] * static_cast<float>(s);
      }
      y[m * N + n] = acc;
    }
  }
}

#ifdef SHARDLM_X86
// maddubs multiplies unsigned by signed bytes: |w| times x with w's sign (|w| <= 127, so no overflow)
__attribute__((target("avx2,fma,f16c"))) inline __m256 q8_block_dot(const int8_t* w, const int8_t* v) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

__attribute__((target("avx2,fma,f16c"))) void q8_rows_avx2(const int8_t* codes, const uint16_t* d,
                                                           const QuantRows& a, float* y, int64_t M, int64_t N,
                                                           int64_t K, int64_t n0, int64_t n1) {
  const int64_t B = K / kGroup;
  const int8_t* xq = a.xq;
  const float* dx = a.dx;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = codes + n * K;
    const uint16_t* dn = d + n * B;
    if (n + kAhead < n1) {
      prefetch_bytes(w + kAhead * K, K);
      prefetch_bytes(dn + kAhead * B, B * 2);
    }
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* v = xq + m * K;
      const float* dxm = dx + m * B;
      __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 2 <= B; b += 2) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(dn[b]) * dxm[b]), q8_block_dot(w + b * kGroup, v + b * kGroup),
                              acc);
        acc2 = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(dn[b + 1]) * dxm[b + 1]),
                               q8_block_dot(w + (b + 1) * kGroup, v + (b + 1) * kGroup), acc2);
      }
      if (b < B)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(dn[b]) * dxm[b]), q8_block_dot(w + b * kGroup, v + b * kGroup),
                              acc);
      y[m * N + n] = hsum(_mm256_add_ps(acc, acc2));
    }
  }
}
#endif

bool has_avx2() {
#ifdef SHARDLM_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// The two weight formats: 4-bit (codes uint8 [N, K / 2], scales float16 [2, N, K / 32]: d, then
// the offsets m) and 8-bit (codes int8 [N, K], scales float16 [N, K / 32]).
struct Weight {
  int64_t N, K;
  bool four_bit;
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* mins;  // 4-bit only
};

Weight weight_of(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool four_bit) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quantized linear: x must be 2-D on the CPU, got ", x.sizes());
  TORCH_CHECK(codes.scalar_type() == (four_bit ? at::kByte : at::kChar) && codes.dim() == 2 && codes.is_contiguous(),
              four_bit ? "int4_linear: codes must be contiguous uint8 [out, in / 2]"
                       : "q8_linear: codes must be contiguous int8 [out, in]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == (four_bit ? 3 : 2),
              "quantized linear: scales must be contiguous float16, ", four_bit ? "[2, out, in / 32]" : "[out, in / 32]");
  const int64_t N = codes.size(0), K = x.size(1);
  const bool fits = K % kGroup == 0 && codes.size(1) * (four_bit ? 2 : 1) == K &&
                    scales.size(-2) == N && scales.size(-1) * kGroup == K && (!four_bit || scales.size(0) == 2);
  TORCH_CHECK(fits, "quantized linear: x ", x.sizes(), ", codes ", codes.sizes(), " and scales ", scales.sizes(),
              " disagree");
  const uint16_t* d = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  return {N, K, four_bit, reinterpret_cast<const uint8_t*>(codes.data_ptr()), d,
          four_bit ? d + N * (K / kGroup) : nullptr};
}

// The weight's rows [n0, n1) as float32 [n1 - n0, K].
void dequantize_rows(const Weight& w, int64_t n0, int64_t n1, float* out) {
  const int64_t K = w.K, B = K / kGroup;
  at::parallel_for(n0, n1, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      float* o = out + (n - n0) * K;
      for (int64_t b = 0; b < B; ++b) {
        const float s = half_to_float(w.d[n * B + b]);
        if (w.four_bit) {
          const float z = half_to_float(w.mins[n * B + b]);
          const uint8_t* c = w.codes + n * (K / 2) + b * 16;
          for (int j = 0; j < 16; ++j) {
            o[b * kGroup + j] = s * static_cast<float>(c[j] & 0xf) + z;
            o[b * kGroup + j + 16] = s * static_cast<float>(c[j] >> 4) + z;
          }
        } else {
          const int8_t* c = reinterpret_cast<const int8_t*>(w.codes) + n * K + b * kGroup;
          for (int j = 0; j < kGroup; ++j) o[b * kGroup + j] = s * static_cast<float>(c[j]);
        }
      }
    }
  });
}

at::Tensor quantized_linear(const at::Tensor& x_in, const Weight& w, int64_t gemm_rows, bool simd) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = w.K, N = w.N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M >= gemm_rows) {  // compute-bound: float GEMM on slices of dequantized rows (~1 MiB each)
    const int64_t step = std::max<int64_t>(16, (int64_t{1} << 18) / K);
    at::Tensor rows = at::empty({std::min(step, N), K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += step) {
      const int64_t n1 = std::min(N, n0 + step);
      dequantize_rows(w, n0, n1, rows.data_ptr<float>());
      y.narrow(1, n0, n1 - n0).copy_(at::mm(x, rows.narrow(0, 0, n1 - n0).t()));
    }
    return y;
  }
  const bool avx2 = simd && has_avx2();
  const QuantRows a = quantize_rows(x.data_ptr<float>(), M, K, /*paired=*/avx2 && w.four_bit, avx2);
  float* yp = y.data_ptr<float>();
  const int8_t* c8 = reinterpret_cast<const int8_t*>(w.codes);
  // a small layer stays on one thread: at two threads, with the split at 2^18, 2^19 or 2^20
  // multiply-adds or every layer split, SmolLM2's decode step took the same within the noise,
  // and every layer on one thread was slower (docs/performance.md)
  const int64_t grain = M * N * K < (int64_t{1} << 19) ? N : 16;
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#ifdef SHARDLM_X86
    if (avx2 && w.four_bit) return dot_rows_avx2(w.codes, w.d, w.mins, a, yp, M, N, K, n0, n1);
    if (avx2) return q8_rows_avx2(c8, w.d, a, yp, M, N, K, n0, n1);
#endif
    if (w.four_bit) return dot_rows_scalar(w.codes, w.d, w.mins, a, yp, M, N, K, n0, n1);
    q8_rows_scalar(c8, w.d, a, yp, M, N, K, n0, n1);
  });
  (void)avx2;
  return y;
}

at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t gemm_rows,
                           bool simd) {
  return quantized_linear(x, weight_of(x, codes, scales, true), gemm_rows, simd);
}

at::Tensor q8_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t gemm_rows,
                         bool simd) {
  return quantized_linear(x, weight_of(x, codes, scales, false), gemm_rows, simd);
}

// Paged KV cache [2, blocks, block_size, kv_heads, d] of the model's dtype (models/attention.py):
// store the new tokens' keys and values at their slots (block * block_size + offset).
void write_kv(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() && k.scalar_type() == cache.scalar_type() &&
                  v.scalar_type() == cache.scalar_type(),
              "write_kv: a contiguous [2, blocks, block_size, heads, d] cache of the keys' dtype");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), sl = slots.to(at::kLong).contiguous();
  const int64_t row = cache.size(3) * cache.size(4), plane = cache.numel() / 2, n = sl.numel();
  TORCH_CHECK(kc.numel() == n * row && vc.numel() == n * row, "write_kv: keys ", k.sizes(), " for ", n, " slots");
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t bytes = row * cache.element_size();
  char* base = static_cast<char*>(cache.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] * row < plane, "write_kv: slot ", sp[i], " outside the cache");
    std::memcpy(base + sp[i] * bytes, static_cast<const char*>(kc.data_ptr()) + i * bytes, bytes);
    std::memcpy(base + (plane / row + sp[i]) * bytes, static_cast<const char*>(vc.data_ptr()) + i * bytes, bytes);
  }
}

// One (sequence, kv head, stretch of the context, share of the kv head's G query heads) task a
// call. Its partial softmax per query head (max score, sum of weights, weighted sum of values) goes
// to ``part``, and ``decode_attention`` merges a head's stretches (flash-decoding). A long context
// takes all G query heads a task, so each cached key and value row is read once, not G times, and
// is split into stretches so that one sequence's few kv heads still make work for every thread; a
// short one (in cache either way) one query head a task, the whole context.
template <typename T>
inline __attribute__((always_inline)) void attend(const T* qp, const T* kp, const T* vp, const int64_t* tp,
                                                  const int64_t* lp, float* part, int64_t task, int64_t H, int64_t G,
                                                  int64_t D, int64_t C, int64_t S, int64_t bs,
                                                  int64_t max_blocks, int64_t num_blocks, float scale, int64_t window,
                                                  T* op, std::vector<float>& scores, std::vector<float>& qf,
                                                  std::vector<float>& own) {
  const int64_t b = task / (H * C * S), h = task / (C * S) % H, c = task / S % C, len = lp[b];
  const int64_t g0 = task % S * G / S, g1 = (task % S + 1) * G / S;
  TORCH_CHECK(len <= max_blocks * bs, "decode_attention: context ", len, " beyond the block table");
  const auto row = [&](int64_t p) { return ((tp[b * max_blocks + p / bs] * bs + p % bs) * H + h) * D; };
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const int64_t first = window > 0 && len > window ? len - window : 0, span = (len - first + C - 1) / C;
  const int64_t p0 = std::min(len, first + c * span), p1 = std::min(len, p0 + span), n = p1 - p0;
  scores.resize(G * std::max<int64_t>(n, 1));
  for (int64_t g = g0; g < g1; ++g) {
    const T* qv = qp + ((b * H + h) * G + g) * D;
    for (int64_t j = 0; j < D; ++j) qf[g * D + j] = static_cast<float>(qv[j]) * scale;
  }
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t block = tp[b * max_blocks + p / bs];
    TORCH_CHECK(block >= 0 && block < num_blocks, "decode_attention: block ", block, " outside the cache");
    const T* kv = kp + row(p);
    if (S == 1 && p + 4 < p1) prefetch_bytes(kp + row(p + 4), row_bytes);  // a long context: from memory
    for (int64_t g = g0; g < g1; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < D; ++j) s += qf[g * D + j] * static_cast<float>(kv[j]);
      scores[g * n + p - p0] = s;
    }
  }
  // per query head: max, sum of weights, D weighted values; in the task's own buffer when the
  // context is one stretch, normalised into op at the end
  float* out = C == 1 ? own.data() : part + task / S * G * (D + 2);
  for (int64_t g = g0; g < g1; ++g) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, scores[g * n + i]);
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) total += scores[g * n + i] = std::exp(scores[g * n + i] - mx);
    out[g * (D + 2)] = mx;
    out[g * (D + 2) + 1] = total;
    std::fill(out + g * (D + 2) + 2, out + (g + 1) * (D + 2), 0.f);
  }
  for (int64_t p = p0; p < p1; ++p) {
    const T* vv = vp + row(p);
    if (S == 1 && p + 4 < p1) prefetch_bytes(vp + row(p + 4), row_bytes);
    for (int64_t g = g0; g < g1; ++g) {
      const float w = scores[g * n + p - p0];
      float* acc = out + g * (D + 2) + 2;
      for (int64_t j = 0; j < D; ++j) acc[j] += w * static_cast<float>(vv[j]);
    }
  }
  if (C > 1) return;
  for (int64_t g = g0; g < g1; ++g) {
    const float total = out[g * (D + 2) + 1], *acc = out + g * (D + 2) + 2;
    T* o = op + ((b * H + h) * G + g) * D;
    for (int64_t j = 0; j < D; ++j) o[j] = static_cast<T>(total > 0.f ? acc[j] / total : 0.f);
  }
}

#ifdef SHARDLM_X86
// The same loops compiled for AVX2 and FMA (the compiler vectorises the dot products and the
// weighted sums 8 floats wide; the build's baseline is SSE2).
template <typename T>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const T* qp, const T* kp, const T* vp, const int64_t* tp,
                                                          const int64_t* lp, float* part, int64_t task, int64_t H,
                                                          int64_t G, int64_t D, int64_t C, int64_t S, int64_t bs,
                                                          int64_t max_blocks, int64_t num_blocks, float scale,
                                                          int64_t window, T* op, std::vector<float>& scores,
                                                          std::vector<float>& qf, std::vector<float>& own) {
  attend<T>(qp, kp, vp, tp, lp, part, task, H, G, D, C, S, bs, max_blocks, num_blocks, scale, window, op, scores, qf,
            own);
}
#endif

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                           const at::Tensor& lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t bs = cache.size(2), plane = cache.numel() / 2, max_blocks = tables.size(1), num_blocks = cache.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = cache.data_ptr<T>();
  const T* vp = kp + plane;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const bool avx2 = has_avx2();
  const float sc = static_cast<float>(scale);
  // Attending to under 256 positions, one query head a task (splitting the context or grouping the
  // heads was no faster there); from 256, all G a task and the context in stretches, enough tasks
  // for two a thread (measured: docs/performance.md, "One-token attention at long contexts").
  const int64_t longest = B ? *std::max_element(lp, lp + B) : 0;
  const bool long_context = (window > 0 ? std::min(longest, window) : longest) >= 256;
  const int64_t S = long_context ? 1 : G;
  const int64_t heads = std::max<int64_t>(B * H, 1);
  const int64_t C = long_context ? std::max<int64_t>(1, (2 * at::get_num_threads() + heads - 1) / heads) : 1;
  std::vector<float> part(C > 1 ? B * H * C * G * (D + 2) : 0);
  at::parallel_for(0, B * H * C * S, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores, qf(G * D), own(C > 1 ? 0 : G * (D + 2));
    for (int64_t task = lo; task < hi; ++task) {
#ifdef SHARDLM_X86
      if (avx2) {
        attend_avx2<T>(qp, kp, vp, tp, lp, part.data(), task, H, G, D, C, S, bs, max_blocks, num_blocks, sc,
                       window, op, scores, qf, own);
        continue;
      }
#endif
      attend<T>(qp, kp, vp, tp, lp, part.data(), task, H, G, D, C, S, bs, max_blocks, num_blocks, sc, window, op,
                scores, qf, own);
    }
  });
  (void)avx2;
  if (C == 1) return;
  // merge each query head's stretches: rescale each to the largest max, then normalise
  at::parallel_for(0, B * H * G, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(D);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bh = i / G, g = i % G;
      float mx = -INFINITY;
      for (int64_t c = 0; c < C; ++c) mx = std::max(mx, part[((bh * C + c) * G + g) * (D + 2)]);
      float total = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < C; ++c) {
        const float* pc = part.data() + ((bh * C + c) * G + g) * (D + 2);
        if (pc[1] == 0.f) continue;  // an empty stretch
        const float f = std::exp(pc[0] - mx);
        total += f * pc[1];
        for (int64_t j = 0; j < D; ++j) acc[j] += f * pc[2 + j];
      }
      T* o = op + i * D;
      for (int64_t j = 0; j < D; ++j) o[j] = static_cast<T>(total > 0.f ? acc[j] / total : 0.f);
    }
  });
}

// One new token per sequence: q [B, kv_heads, group, d] against the first lens[b] cached positions
// (the last ``window`` of them when window > 0) of a [2, blocks, block_size, kv_heads, d] cache.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& cache, const at::Tensor& tables_in,
                            const at::Tensor& lens_in, double scale, int64_t window) {
  TORCH_CHECK(q_in.dim() == 4 && cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                  cache.scalar_type() == q_in.scalar_type() && cache.size(3) == q_in.size(1) &&
                  cache.size(4) == q_in.size(3),
              "decode_attention: q ", q_in.sizes(), " against a cache ", cache.sizes());
  const at::Tensor q = q_in.contiguous(), tables = tables_in.to(at::kLong).contiguous(),
                   lens = lens_in.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, cache, tables, lens, scale, window, out);
  });
  return out;
}

bool vectorised() { return has_avx2(); }

}  // namespace

// How many threads at::parallel_for splits a loop over (each chunk calls the body once): 1 when the
// extension is built without OpenMP, whatever torch.set_num_threads says.
int64_t parallel_threads() {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, 1 << 10, 1, [&](int64_t, int64_t) { chunks += 1; });
  return chunks;
}

// simd=False takes the portable loops on any CPU (for the test that compares the two)
TORCH_LIBRARY(shardlm_int4, m) {
  m.def("parallel_threads() -> int", &parallel_threads);
  m.def("linear(Tensor x, Tensor codes, Tensor scales, int gemm_rows, bool simd=True) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &int4_linear_cpu);
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales, int gemm_rows, bool simd=True) -> Tensor");
  m.impl("q8_linear", c10::DispatchKey::CPU, &q8_linear_cpu);
  m.def("vectorised() -> bool", &vectorised);
  m.def("write_kv(Tensor(a!) cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
  m.def("decode_attention(Tensor q, Tensor cache, Tensor tables, Tensor lens, float scale, int window) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}

// AVX2 + FMA helpers shared by the kernels: loads and stores of 8 lanes from float32 or bfloat16,
// a fixed-order horizontal sum, and e^x. Every kernel reduces with these, so the order of each
// reduction is written down once, here.
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the exact kernels need AVX2 and FMA (x86-64-v3)"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu.h"

namespace kv {

using bf16 = uint16_t;  // the raw bits of a bfloat16: the top half of a float32

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, NaN to the canonical 0x7fc0: what torch's float -> bfloat16 conversion does.
inline bf16 to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fff + ((bits >> 16) & 1);
  return bf16(bits >> 16);
}

template <typename T>
inline T from_f32(float f);
template <>
inline float from_f32<float>(float f) {
  return f;
}
template <>
inline bf16 from_f32<bf16>(float f) {
  return to_bf16(f);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}

// int8 (a KV cache's quantized keys and values), widened exactly.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int i = 0; i < 8; ++i) p[i] = to_bf16(lanes[i]);
}

// The first n (< 8) lanes: tails go through the same vector arithmetic as full vectors.
template <typename T>
inline __m256 load_partial(const T* p, int n) {
  alignas(32) float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; ++i) lanes[i] = to_f32(p[i]);
  return _mm256_load_ps(lanes);
}
template <typename T>
inline void store_partial(T* p, __m256 v, int n) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int i = 0; i < n; ++i) p[i] = from_f32<T>(lanes[i]);
}

// Each lane rounded to bfloat16 (nearest even, NaN to the canonical 0x7fc0), kept as a float32: to_bf16
// then to_f32, 8 lanes at a time.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  r = _mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

// A value as an activation of type T holds it: unchanged in float32, rounded to bfloat16 otherwise. The
// families' kernels round where a bfloat16 model's torch ops round (each op's output), so that their
// bfloat16 arithmetic is transformers' own.
template <typename T>
inline __m256 as_activation(__m256 v) {
  if constexpr (sizeof(T) == 2)
    return round_bf16(v);
  else
    return v;
}

// Lanes 0..7 summed as ((0+4) + (2+6)) + ((1+5) + (3+7)): one fixed tree.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// e^x, lane by lane. x = n ln2 + r with n = round(x / ln2) and ln2 split in two parts (so r is
// exact to float32), e^r from a degree-7 Taylor-like polynomial in Horner form with FMAs (|r| <=
// ln2 / 2), then scaled by 2^n through the exponent bits. Below -87.3 the result is 0 (no
// subnormals), above 88.376 (where n would pass 127) it is inf, NaN stays NaN. About 1-2 ulp against float64 (tested).
inline __m256 exp8(__m256 x) {
  const __m256 max_x = _mm256_set1_ps(88.3762626647949f);
  const __m256 min_x = _mm256_set1_ps(-87.33654022216797f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  // 1/7!, 1/6!, ..., 1/2!, then the linear and constant terms
  __m256 p = _mm256_set1_ps(1.98412698e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.38888889e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n for n in [-126, 127]; the clamps below cover the rest
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  e = _mm256_max_epi32(_mm256_min_epi32(e, _mm256_set1_epi32(254)), _mm256_set1_epi32(1));
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, min_x, _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, max_x, _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// GELU, tanh form: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), computed as the
// equal x / (1 + e^(-2u)).
inline __m256 gelu8(__m256 x) {
  const __m256 c = _mm256_set1_ps(0.044715f);
  const __m256 minus_two_sqrt_2_over_pi = _mm256_set1_ps(-1.5957691216057308f);
  __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  __m256 inner = _mm256_add_ps(x, _mm256_mul_ps(c, x3));
  __m256 z = exp8(_mm256_mul_ps(minus_two_sqrt_2_over_pi, inner));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), z));
}

// SiLU: x / (1 + e^(-x)), as torch computes it.
inline __m256 silu8(__m256 x) {
  const __m256 z = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), z));
}

// Code that uses wider instructions than AVX2 lives in a namespace named for them (avx512, avx512_vnni,
// avx512_bf16, avx_vnni, amx), so that a disassembly shows none outside (tests/model/test_isa.py). Here:
// 16 lanes on AVX-512, widened exactly as load8 does, and the two halves of 16 lanes.
namespace avx512 {
KV_TARGET_AVX512 inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
KV_TARGET_AVX512 inline __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
KV_TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
KV_TARGET_AVX512 inline __m512 load16(const bf16* p) {
  const __m512i widened = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
}
KV_TARGET_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
}  // namespace avx512

}  // namespace kv

// The int8-weight product: linear_q8 (linear_q8.cpp) quantizes the rows and hands them to one of
// its paths, picked per call (cpu.h): AVX2 or AVX-VNNI (linear_q8_avx2.cpp), AVX512-VNNI
// (linear_q8.cpp), AMX tiles (linear_q8_amx.cpp). Every path sums in int32, which is exact, and
// ends each output element with the same float sequence (dequantize8 / dequantize16), so a row
// gets the same bits on any path.
#pragma once

#include <cstdint>

#include "api.h"
#include "cpu.h"
#include "epilogue.h"

namespace kv {

// Rows of norm(x) quantized to int8, by the row's own max |x|: q (rows rounded up to 16, Kp) bytes,
// zero past K; signed, or unsigned (q + 128) for the vpdpbusd and tdpbusd paths, whose weights'
// offsets (kv_weight.offset) take the shift back out. sx (rows,): each row's scale.
struct QuantizedRows {
  const uint8_t* q;
  const float* sx;
  int64_t rows;
  int64_t Kp;  // K rounded up to a quad
};

// The one float sequence after an int8 product's exact int32 sum, per output element o of row r:
// float(sum) * (sx[r] * sw[o]). 8 columns (AVX2) or 16 (AVX-512) at a time, the same per element.
inline __m256 dequantize8(__m256i exact, const float* sw, __m256 sx) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(sx, _mm256_loadu_ps(sw)));
}
namespace avx512 {
KV_TARGET_AVX512 inline __m512 dequantize16(__m512i exact, const float* sw, __m512 sx) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sx, _mm512_loadu_ps(sw)));
}
}  // namespace avx512

// y = epilogue(dequantize(quantize(norm(x)) @ Wq) + b); 0 (every CPU the library loads on has a path).
int linear_q8(const kv_weight& w, const float* x, int64_t rows, float* y, int epilogue, const float* residual,
              const Norm& norm);

// The paths, for rows already quantized (signed for AVX2, unsigned for the others).
void linear_q8_avx2(const kv_weight& w, const QuantizedRows& in, const Output<float>& out, bool avx_vnni);
void linear_q8_amx(const kv_weight& w, const QuantizedRows& in, const Output<float>& out);

}  // namespace kv

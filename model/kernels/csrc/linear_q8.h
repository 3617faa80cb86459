// The int8-weight product (linear_q8.cpp), called by kv_linear for KV_WEIGHT_INT8.
#pragma once

#include "api.h"
#include "epilogue.h"

namespace kv {

#if defined(__AVX512F__)
// The one float sequence after an int8 product's exact int32 sums, for 16 columns of one row:
// float(acc - offset[o]) * (sx * sw[o]). Both int8 paths (VNNI tiles, AMX tiles) end here, so a
// row gets the same bits on either.
inline __m512 dequantize16(__m512i acc, const int32_t* offset, const float* sw, __m512 sx) {
  const __m512i exact = _mm512_sub_epi32(acc, _mm512_loadu_si512(offset));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sx, _mm512_loadu_ps(sw)));
}
#endif

// y = epilogue(dequantize(quantize(norm(x)) @ Wq) + b); -1 where this build has no VNNI.
int linear_q8(const kv_weight& w, const float* x, int64_t rows, float* y, int epilogue, const float* residual,
              const Norm& norm);

}  // namespace kv

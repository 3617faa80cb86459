// What every product does after its sums: add the bias, apply the epilogue (KV_EPILOGUE_*), store;
// and the layer norm a product may apply to its input rows first. Shared by the float products
// (linear.cpp) and the int8 ones (linear_q8.cpp), so both end each output element the same way.
#pragma once

#include <algorithm>

#include "api.h"
#include "cpu.h"
#include "vec.h"

namespace kv {

template <typename T>
struct Output {
  T* y;               // (rows, O)
  const T* residual;  // (rows, O) or null
  const float* bias;  // (O padded to the group), float32
  int64_t O;
  int epilogue;
};

struct Norm {
  const float* weight;  // (K,) float32, or null: no layer norm before the product
  const float* bias;    // (K,) float32
  float eps;
};

// Adds the bias, applies the epilogue and stores R rows x (8 * NV) columns from column `col`.
template <int R, int NV, typename T>
inline void finish(const Output<T>& out, int64_t row, int64_t col, __m256 acc[R][NV]) {
  for (int c = 0; c < NV; ++c) {
    const int64_t o = col + 8 * c;
    if (o >= out.O) return;
    const int n = int(std::min<int64_t>(8, out.O - o));
    const __m256 b = load8(out.bias + o);
    for (int r = 0; r < R; ++r) {
      __m256 v = _mm256_add_ps(acc[r][c], b);
      if (out.epilogue == KV_EPILOGUE_GELU) v = gelu8(v);
      const int64_t at = (row + r) * out.O + o;
      if (out.epilogue == KV_EPILOGUE_RESIDUAL)
        v = _mm256_add_ps(n == 8 ? load8(out.residual + at) : load_partial(out.residual + at, n), v);
      if (n == 8)
        store8(out.y + at, v);
      else
        store_partial(out.y + at, v, n);
    }
  }
}

// Code that uses wider instructions than AVX2 lives in a namespace named for them (avx512, avx512_vnni,
// avx512_bf16, avx_vnni, amx), so that a disassembly shows none outside (tests/model/test_isa.py).
namespace avx512 {
KV_TARGET_AVX512 inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
KV_TARGET_AVX512 inline __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
}  // namespace avx512

}  // namespace kv

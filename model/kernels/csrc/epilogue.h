// What every product does after its sums: add the bias, apply the epilogue (KV_EPILOGUE_*), store;
// and the norm a product may apply to its input rows first. Shared by every product path (linear.cpp,
// linear_bf16.cpp, linear_q8*.cpp: AVX2, AVX-512, AVX512-BF16, AVX-VNNI, AVX512-VNNI, AMX), so all of them
// end each output element the same way.
#pragma once

#include <algorithm>

#include "api.h"
#include "cpu.h"
#include "layer_norm.h"
#include "vec.h"

namespace kv {

template <typename T>
struct Output {
  T* y;               // (rows, O)
  const T* residual;  // (rows, O) or null
  const float* bias;  // (the product's columns padded to the group), float32
  int64_t O;          // y's columns: the product's, or half of them for KV_EPILOGUE_SILU_MUL
  int epilogue;
};

// y's columns for a product of n_out columns.
inline int64_t output_columns(int64_t n_out, int epilogue) {
  return epilogue == KV_EPILOGUE_SILU_MUL ? n_out / 2 : n_out;
}

struct Norm {
  int kind;             // KV_NORM_LAYER or KV_NORM_RMS
  const float* weight;  // (K,) float32, or null: no norm before the product
  const float* bias;    // (K,) float32 (a layer norm's)
  float eps;
};

// One input row normalized into float32 (layer_norm.h).
template <typename T>
inline void norm_row(const T* x, int64_t K, const Norm& norm, float* y) {
  if (norm.kind == KV_NORM_RMS)
    rms_norm_row(x, K, norm.weight, norm.eps, y);
  else
    layer_norm_row(x, K, norm.weight, norm.bias, norm.eps, y);
}

// SwiGLU's end of R rows x (8 * NV) product columns from column `col` (a multiple of 16): each pair of
// vectors holds 8 gate columns then the 8 up columns of the same outputs (api.h), so
//   y[o] = T(T(silu(T(gate + b))) * T(up + b'))
// per output element, with T() as in layer_norm.h's RMSNorm (a bfloat16 model's rounding after each op).
template <int R, int NV, typename T>
inline void finish_silu_mul(const Output<T>& out, int64_t row, int64_t col, __m256 acc[R][NV]) {
  static_assert(NV % 2 == 0, "gate and up vectors come in pairs");
  for (int c = 0; c < NV; c += 2) {
    const int64_t f = col + 8 * c, o = f / 2;
    if (o >= out.O) return;
    const int n = int(std::min<int64_t>(8, out.O - o));
    const __m256 bg = load8(out.bias + f), bu = load8(out.bias + f + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 gate = as_activation<T>(_mm256_add_ps(acc[r][c], bg));
      const __m256 up = as_activation<T>(_mm256_add_ps(acc[r][c + 1], bu));
      const __m256 v = _mm256_mul_ps(as_activation<T>(silu8(gate)), up);
      const int64_t at = (row + r) * out.O + o;
      if (n == 8)
        store8(out.y + at, v);
      else
        store_partial(out.y + at, v, n);
    }
  }
}

// Adds the bias, applies the epilogue and stores R rows x (8 * NV) columns from column `col`.
template <int R, int NV, typename T>
inline void finish(const Output<T>& out, int64_t row, int64_t col, __m256 acc[R][NV]) {
  if (out.epilogue == KV_EPILOGUE_SILU_MUL) {
    finish_silu_mul<R, NV>(out, row, col, acc);
    return;
  }
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

}  // namespace kv

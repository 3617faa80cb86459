// The norms the linear kernel may apply to its input rows (its prologue), one row into float32: layer
// norm (GPT-2) and RMSNorm (Llama, Qwen; also each head's QK-norm, csrc/rope.cpp).
//
// Layer norm's reduction order, per row of n values: lane l of a vector accumulator adds x[j] for j = l, l + 8,
// ... in order (a tail through the same vector code, zero-padded), then hsum8's fixed tree:
//   mean = sum(x) / n;  var = sum((x - mean)^2) / n;  rstd = 1 / sqrt(var + eps)
//   y[j] = fma((x[j] - mean) * rstd, weight[j], bias[j])
// Every row is normalized by the same code whatever the rest of the batch, so the result of a row
// depends on that row alone.
#pragma once

#include <cmath>

#include "vec.h"

namespace kv {

template <typename T>
inline void layer_norm_row(const T* x, int64_t n, const float* weight, const float* bias, float eps, float* y) {
  const int64_t full = n / 8 * 8;
  const int tail = int(n - full);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) sum = _mm256_add_ps(sum, load8(x + j));
  if (tail) sum = _mm256_add_ps(sum, load_partial(x + full, tail));
  const float mean = hsum8(sum) / float(n);
  const __m256 mv = _mm256_set1_ps(mean);
  __m256 sq = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 d = _mm256_sub_ps(load8(x + j), mv);
    sq = _mm256_add_ps(sq, _mm256_mul_ps(d, d));
  }
  if (tail) {
    const __m256 lanes =
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 d = _mm256_and_ps(_mm256_sub_ps(load_partial(x + full, tail), mv), lanes);
    sq = _mm256_add_ps(sq, _mm256_mul_ps(d, d));
  }
  const float rstd = 1.0f / std::sqrt(hsum8(sq) / float(n) + eps);
  const __m256 rv = _mm256_set1_ps(rstd);
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(load8(x + j), mv), rv);
    _mm256_storeu_ps(y + j, _mm256_fmadd_ps(t, _mm256_loadu_ps(weight + j), _mm256_loadu_ps(bias + j)));
  }
  if (tail) {
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(load_partial(x + full, tail), mv), rv);
    store_partial(y + full, _mm256_fmadd_ps(t, load_partial(weight + full, tail), load_partial(bias + full, tail)),
                  tail);
  }
}

// RMSNorm, as transformers computes it: statistics in float32, the normalized row cast to the
// activations' type T before the weight multiplies it.
// Reduction order, per row of n values: lane l of a vector accumulator adds x[j]^2 for j = l, l + 8, ...
// in order (a zero-padded tail through the same code), then hsum8's fixed tree:
//   rstd = 1 / sqrt(sum(x^2) / n + eps);  y[j] = T(weight[j] * T(x[j] * rstd))
// (T() rounds to bfloat16 for a bfloat16 model, nothing for float32), so a row's result depends on it alone.
template <typename T>
inline void rms_norm_row(const T* x, int64_t n, const float* weight, float eps, float* y) {
  const int64_t full = n / 8 * 8;
  const int tail = int(n - full);
  __m256 sq = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 v = load8(x + j);
    sq = _mm256_add_ps(sq, _mm256_mul_ps(v, v));
  }
  if (tail) {
    const __m256 v = load_partial(x + full, tail);
    sq = _mm256_add_ps(sq, _mm256_mul_ps(v, v));
  }
  const __m256 rv = _mm256_set1_ps(1.0f / std::sqrt(hsum8(sq) / float(n) + eps));
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 t = as_activation<T>(_mm256_mul_ps(load8(x + j), rv));
    _mm256_storeu_ps(y + j, as_activation<T>(_mm256_mul_ps(_mm256_loadu_ps(weight + j), t)));
  }
  if (tail) {
    const __m256 t = as_activation<T>(_mm256_mul_ps(load_partial(x + full, tail), rv));
    store_partial(y + full, as_activation<T>(_mm256_mul_ps(load_partial(weight + full, tail), t)), tail);
  }
}

}  // namespace kv

// y = epilogue(norm(x) @ W + b) with bfloat16 activations and weights through AVX512-BF16's
// vdpbf16ps, which multiplies pairs of bfloat16 and adds both products to a float32 lane.
//
// Reduction order: for each output element, acc = dpbf16(acc, (x[2j], x[2j+1]), (W[2j][o], W[2j+1][o]))
// for j = 0, 1, ..., K/2 - 1 in order (K padded with a zero to even), the pair's arithmetic the
// instruction's own (the products are exact in float32; subnormals flushed; round to nearest even),
// whatever the number of rows, the row's place or the thread: cached equals uncached, alone equals
// batched. Rows to normalize are normalized in float32 (layer_norm.h) and rounded to bfloat16 once,
// as a bfloat16 model's norm output is.
//
// Weights (model/kernels/exact.py, KV_WEIGHT_BF16_PAIRS): groups of 64 columns, each four strips of
// 16 columns with k in pairs, (groups, 4, K/2, 16, 2): one 64-byte line per strip per pair of k.
#include "linear_bf16.h"

#include <cstring>
#include <vector>

#include "cpu.h"
#include "thread_pool.h"

namespace kv {
namespace {

constexpr int64_t kGroup = 64, kStrip = 16, kStrips = 4;
constexpr int64_t kRowTile = 6;    // 24 accumulators + 4 weights + a broadcast fit the 32 registers
constexpr int64_t kRowBlock = 96;  // rows per task when there are many (a multiple of kRowTile)
constexpr int64_t kPrefetchAhead = 32;

namespace avx512_bf16 {

inline int32_t pair(const bf16* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int R, typename T>
KV_TARGET_AVX512_BF16 void rows_by_group(const bf16* x, int64_t Kp, const bf16* wg, const Output<T>& out, int64_t row,
                                         int64_t col) {
  const int64_t pairs = Kp / 2;
  __m512 acc[R][kStrips];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) acc[r][s] = _mm512_setzero_ps();
  const bf16* xr = x + row * Kp;
  for (int64_t k = 0; k < pairs; ++k) {
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) {
      const bf16* wk = wg + (s * pairs + k) * 2 * kStrip;
      const __m512bh w = (__m512bh)_mm512_loadu_si512(wk);
      if (R > 1) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead * 2 * kStrip), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][s] = _mm512_dpbf16_ps(acc[r][s], (__m512bh)_mm512_set1_epi32(pair(xr + r * Kp + 2 * k)), w);
    }
  }
  __m256 sums[R][2 * kStrips];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) {
      sums[r][2 * s] = avx512::low_half(acc[r][s]);
      sums[r][2 * s + 1] = avx512::high_half(acc[r][s]);
    }
  finish<R, 2 * kStrips>(out, row, col, sums);
}

}  // namespace avx512_bf16

template <typename T>
void linear(const kv_weight& w, const bf16* x, int64_t rows, T* y, int epilogue, const T* residual, const Norm& norm) {
  const int64_t K = w.n_in, O = w.n_out, Kp = (K + 1) / 2 * 2;
  thread_local std::vector<bf16> scratch;
  if (scratch.size() < size_t(rows * Kp)) scratch.resize(size_t(rows * Kp));
  bf16* xs = scratch.data();
  ThreadPool::instance().run(rows, [&](int64_t r) {
    bf16* dst = xs + r * Kp;
    if (norm.weight != nullptr) {
      thread_local std::vector<float> normed;
      if (normed.size() < size_t(K)) normed.resize(size_t(K));
      norm_row(x + r * K, K, norm, normed.data());
      for (int64_t k = 0; k < K; ++k) dst[k] = to_bf16(normed[k]);
    } else {
      std::memcpy(dst, x + r * K, size_t(K) * sizeof(bf16));
    }
    if (Kp > K) dst[K] = 0;
  });
  const Output<T> out{y, residual, w.bias, output_columns(O, epilogue), epilogue};
  const auto* weights = static_cast<const bf16*>(w.data);
  const int64_t groups = (O + kGroup - 1) / kGroup;
  const int64_t row_blocks = rows > 2 * kRowBlock ? (rows + kRowBlock - 1) / kRowBlock : 1;
  const int64_t block = row_blocks == 1 ? rows : kRowBlock;
  ThreadPool::instance().run(groups * row_blocks, [&](int64_t task) {
    const int64_t g = task % groups, rb = task / groups;
    const int64_t first = rb * block, end = std::min(rows, first + block);
    const bf16* wg = weights + g * Kp * kGroup;
    const int64_t col = g * kGroup;
    for (int64_t r = first; r < end; r += kRowTile) {
      switch (std::min<int64_t>(kRowTile, end - r)) {
        case 1:
          avx512_bf16::rows_by_group<1>(xs, Kp, wg, out, r, col);
          break;
        case 2:
          avx512_bf16::rows_by_group<2>(xs, Kp, wg, out, r, col);
          break;
        case 3:
          avx512_bf16::rows_by_group<3>(xs, Kp, wg, out, r, col);
          break;
        case 4:
          avx512_bf16::rows_by_group<4>(xs, Kp, wg, out, r, col);
          break;
        case 5:
          avx512_bf16::rows_by_group<5>(xs, Kp, wg, out, r, col);
          break;
        default:
          avx512_bf16::rows_by_group<6>(xs, Kp, wg, out, r, col);
          break;
      }
    }
  });
}

}  // namespace

int linear_bf16(const kv_weight& w, const bf16* x, int64_t rows, bf16* y, int epilogue, const bf16* residual,
                const Norm& norm) {
  if (kernel_path(KV_WEIGHT_BF16_PAIRS) != KV_PATH_AVX512_BF16) return -1;
  linear(w, x, rows, y, epilogue, residual, norm);
  return 0;
}

int linear_bf16(const kv_weight& w, const bf16* x, int64_t rows, float* y, int epilogue, const float* residual,
                const Norm& norm) {
  if (kernel_path(KV_WEIGHT_BF16_PAIRS) != KV_PATH_AVX512_BF16) return -1;
  linear(w, x, rows, y, epilogue, residual, norm);
  return 0;
}

}  // namespace kv

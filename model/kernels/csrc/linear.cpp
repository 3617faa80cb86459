// y = epilogue(x @ W + b): the linear layers and the tied head.
//
// Reduction order, the property every test leans on: each output element y[r][o] is
//     acc = 0;  for k = 0 .. K-1:  acc = fma(x[r][k], W[k][o], acc);  y = epilogue(acc + b[o])
// sequential over k, one FMA per k, whatever the number of rows, the row's place in the batch,
// the tile it falls in or the thread that computes it. Tiles differ only in how many rows and
// columns share each load, never in the arithmetic of one element.
//
// W is packed once at load (model/kernels/__init__.py, PackedWeight.pack): groups of 64 columns,
// each four strips of 16 columns stored k-major, (groups, 4, K, 16), zero-padded past O. A strip is
// one cache line per k, so whatever the tile, the weights stream from memory in order, once.
// Threads split the groups (and, for many rows, blocks of rows); never the reduction.
//
// Two paths of that one arithmetic, picked per call (cpu.h): 8-lane tiles on AVX2, and 16-lane ones
// on AVX-512 (each strip one register). They give the same bits; bfloat16 weights take both, widened
// to float32 by a 16-bit shift in registers, so they read half the bytes on any CPU.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "api.h"
#include "cpu.h"
#include "epilogue.h"
#include "linear_bf16.h"
#include "linear_q8.h"
#include "thread_pool.h"
#include "vec.h"

namespace kv {
namespace {

constexpr int64_t kGroup = 64;  // columns per packed group: one task
constexpr int64_t kStrip = 16;  // columns per strip: two vectors
constexpr int64_t kStrips = kGroup / kStrip;
constexpr int64_t kRowTile = 6;    // rows sharing each weight load, at most
constexpr int64_t kRowBlock = 96;  // rows per task when there are many (a multiple of kRowTile)
// How many k rows (cache lines) of a strip are asked for ahead of the loads, in tiles of several rows:
// their compute between two lines of a strip is long enough that the hardware prefetcher alone leaves
// the first pass waiting on memory. The one-row tile streams four strips at once, fast enough for it.
constexpr int64_t kPrefetchAhead = 32;

// acc[r][2s + c] = sum over k of x[r][k] * ws[s][k][8c .. 8c+7]: R rows against S adjacent strips
// (K * 16 apart). The sums live in a local array that nothing else can see until the loop ends, so
// they stay in registers (__m256 may alias float, so sums written through a pointer would go back to
// memory every k).
template <int R, int S, typename W>
inline void tile(const float* x, int64_t K, const W* ws, __m256 (&out)[R][2 * S]) {
  __m256 acc[R][2 * S];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < 2 * S; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const W* wk = ws + (s * K + k) * kStrip;
      const __m256 w0 = load8(wk), w1 = load8(wk + 8);
      if (R > 1) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead * kStrip), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
        acc[r][2 * s] = _mm256_fmadd_ps(xb, w0, acc[r][2 * s]);
        acc[r][2 * s + 1] = _mm256_fmadd_ps(xb, w1, acc[r][2 * s + 1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < 2 * S; ++c) out[r][c] = acc[r][c];
}

namespace avx512 {

using kv::avx512::load16;

// The same sums as `tile`, one strip per 16-lane register, all four strips of the group at once:
// acc = fma(x[r][k], W[k][o], acc) for k in order, as on the AVX2 path, so both give the same bits.
// R <= 6: 4R accumulators, 4 weights and a broadcast fit the 32 registers.
template <int R, typename W>
KV_TARGET_AVX512 inline void tile16(const float* x, int64_t K, const W* wg, __m256 (&out)[R][2 * kStrips]) {
  __m512 acc[R][kStrips];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) {
      const W* wk = wg + (s * K + k) * kStrip;
      const __m512 w = load16(wk);
      if (R > 1) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead * kStrip), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][s] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r][s]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) {
      out[r][2 * s] = kv::avx512::low_half(acc[r][s]);
      out[r][2 * s + 1] = kv::avx512::high_half(acc[r][s]);
    }
}

// Rows [row, row + R) against one group on AVX-512: the four strips in one tile.
template <int R, typename W, typename T>
KV_TARGET_AVX512 void rows_by_group16(const float* x, int64_t K, const W* wg, const Output<T>& out, int64_t row,
                                      int64_t col) {
  __m256 sums[R][2 * kStrips];
  tile16<R>(x + row * K, K, wg, sums);
  finish<R, 2 * kStrips>(out, row, col, sums);
}

}  // namespace avx512

// Rows [row, row + R) against one group on AVX2, S strips per tile: enough accumulators to keep the
// FMA pipes busy (8 to 12) and few enough to stay in the 16 registers with the weights and a broadcast.
template <int R, typename W, typename T>
inline void rows_by_group8(const float* x, int64_t K, const W* wg, const Output<T>& out, int64_t row, int64_t col) {
  constexpr int S = R == 1 ? 4 : R <= 3 ? 2 : 1;
  for (int64_t s = 0; s < kStrips; s += S) {
    __m256 acc[R][2 * S];
    tile<R, S>(x + row * K, K, wg + s * K * kStrip, acc);
    finish<R, 2 * S>(out, row, col + s * kStrip, acc);
  }
}

template <int R, typename W, typename T>
inline void rows_by_group(bool wide, const float* x, int64_t K, const W* wg, const Output<T>& out, int64_t row,
                          int64_t col) {
  if (wide)
    avx512::rows_by_group16<R>(x, K, wg, out, row, col);
  else
    rows_by_group8<R>(x, K, wg, out, row, col);
}

template <typename W, typename T>
void run_rows(bool wide, const float* x, int64_t K, const W* wg, const Output<T>& out, int64_t row, int64_t rows,
              int64_t col) {
  for (int64_t r = row; r < row + rows; r += kRowTile) {
    switch (std::min<int64_t>(kRowTile, row + rows - r)) {
      case 1:
        rows_by_group<1>(wide, x, K, wg, out, r, col);
        break;
      case 2:
        rows_by_group<2>(wide, x, K, wg, out, r, col);
        break;
      case 3:
        rows_by_group<3>(wide, x, K, wg, out, r, col);
        break;
      case 4:
        rows_by_group<4>(wide, x, K, wg, out, r, col);
        break;
      case 5:
        rows_by_group<5>(wide, x, K, wg, out, r, col);
        break;
      default:
        rows_by_group<6>(wide, x, K, wg, out, r, col);
        break;
    }
  }
}

template <typename X, typename W, typename T>
void linear(const X* x_in, int64_t rows, int64_t K, const W* w, const float* bias, T* y, int64_t O, int epilogue,
            const T* residual, const Norm& norm) {
  // The tiles read float32 rows: bfloat16 ones are widened once (exactly), and rows to normalize are
  // normalized once, into a scratch buffer of the calling thread.
  thread_local std::vector<float> scratch;
  const float* x;
  if (norm.weight != nullptr || !std::is_same_v<X, float>) {
    if (scratch.size() < size_t(rows * K)) scratch.resize(size_t(rows * K));
    float* s = scratch.data();
    if (norm.weight != nullptr) {
      ThreadPool::instance().run(rows, [&](int64_t r) { norm_row(x_in + r * K, K, norm, s + r * K); });
    } else {
      for (int64_t i = 0; i < rows * K; ++i) s[i] = to_f32(x_in[i]);
    }
    x = s;
  } else {
    x = reinterpret_cast<const float*>(x_in);
  }
  const Output<T> out{y, residual, bias, output_columns(O, epilogue), epilogue};
  const bool wide = kernel_path(KV_WEIGHT_F32) == KV_PATH_AVX512;
  const int64_t groups = (O + kGroup - 1) / kGroup;
  const int64_t row_blocks = rows > 2 * kRowBlock ? (rows + kRowBlock - 1) / kRowBlock : 1;
  const int64_t block = row_blocks == 1 ? rows : kRowBlock;
  ThreadPool::instance().run(groups * row_blocks, [&](int64_t task) {
    const int64_t g = task % groups, rb = task / groups;
    const int64_t row = rb * block, n = std::min(block, rows - row);
    run_rows(wide, x, K, w + g * K * kGroup, out, row, n, g * kGroup);
  });
}

}  // namespace
}  // namespace kv

extern "C" {

int kv_linear(const kv_weight* w, int dtype, const void* x, int64_t rows, void* y, int epilogue, const void* residual,
              int norm_kind, const float* norm_weight, const float* norm_bias, float norm_eps) {
  using kv::bf16;
  const kv::Norm norm{norm_kind, norm_weight, norm_bias, norm_eps};
  const int64_t K = w->n_in, O = w->n_out;
  if (epilogue == KV_EPILOGUE_SILU_MUL && O % 2 != 0) return -1;
  if (norm_kind != KV_NORM_LAYER && norm_kind != KV_NORM_RMS) return -1;
  if (w->format == KV_WEIGHT_INT8) {
    if (dtype != KV_DTYPE_F32) return -1;
    return kv::linear_q8(*w, static_cast<const float*>(x), rows, static_cast<float*>(y), epilogue,
                         static_cast<const float*>(residual), norm);
  }
  if (w->format == KV_WEIGHT_BF16_PAIRS) {
    if (dtype == KV_DTYPE_BF16)
      return kv::linear_bf16(*w, static_cast<const bf16*>(x), rows, static_cast<bf16*>(y), epilogue,
                             static_cast<const bf16*>(residual), norm);
    if (dtype == KV_DTYPE_BF16_F32)
      return kv::linear_bf16(*w, static_cast<const bf16*>(x), rows, static_cast<float*>(y), epilogue,
                             static_cast<const float*>(residual), norm);
    return -1;
  }
  if ((w->format == KV_WEIGHT_F32) != (dtype == KV_DTYPE_F32)) return -1;
  switch (dtype) {
    case KV_DTYPE_F32:
      kv::linear(static_cast<const float*>(x), rows, K, static_cast<const float*>(w->data), w->bias,
                 static_cast<float*>(y), O, epilogue, static_cast<const float*>(residual), norm);
      return 0;
    case KV_DTYPE_BF16:
      kv::linear(static_cast<const bf16*>(x), rows, K, static_cast<const bf16*>(w->data), w->bias,
                 static_cast<bf16*>(y), O, epilogue, static_cast<const bf16*>(residual), norm);
      return 0;
    case KV_DTYPE_BF16_F32:
      kv::linear(static_cast<const bf16*>(x), rows, K, static_cast<const bf16*>(w->data), w->bias,
                 static_cast<float*>(y), O, epilogue, static_cast<const float*>(residual), norm);
      return 0;
    default:
      return -1;
  }
}
}

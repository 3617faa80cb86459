// y = epilogue(norm(x) @ W + b) with int8 weights: each row of norm(x) quantized to int8 on the fly,
// the products summed in int32 by AVX512-VNNI, the sums scaled back to float32.
//
// Reduction order: the sum over k is in int32, which is exact (|sum| <= 255 * 127 * K < 2^31 for
// K < 66,000), so no order of it can change a bit. Every float operation after it is per output
// element, in one fixed sequence:
//     y = epilogue(float(acc - offset[o]) * (sx[r] * sw[o]) + b[o])      (epilogue.h)
// Each row's activations are quantized from that row alone (symmetric, by its own max |x|), so a
// row's outputs never depend on the rest of the batch: cached equals uncached, alone equals batched.
//
// Weights (model/kernels/int8.py): per-output-column symmetric int8, groups of 64 columns, each four
// strips of 16 columns with k in quads, (groups, 4, K/4, 16, 4): one 64-byte line per strip per quad.
// vpdpbusd multiplies 4 unsigned bytes of x (q + 128) by the 4 signed bytes of each of 16 columns and
// adds the four products to the column's int32 lane; offset[o] = 128 * sum_k W[k][o] removes the shift.
#include "linear_q8.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "layer_norm.h"
#include "linear_q8_amx.h"
#include "thread_pool.h"

namespace kv {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

constexpr int64_t kGroup = 64, kStrip = 16, kStrips = 4;
constexpr int64_t kRowTile = 6;         // rows sharing each weight load: 24 accumulators + 4 weights fit 32 registers
constexpr int64_t kRowBlock = 96;       // rows per task when there are many (a multiple of kRowTile)
constexpr int64_t kPrefetchAhead = 32;  // quads (cache lines of a strip) asked for ahead, for multi-row tiles
constexpr int64_t kAmxMinRows = 4;      // from this many rows on, AMX tiles (same bits, see linear_q8_amx.cpp)

// One row to unsigned bytes: q[k] = rne(x[k] * 127 / amax) + 128, and 128 (zero) from K up to Kp.
// scale = amax / 127; NaN where the row holds a NaN or an infinity, so that its outputs are NaN too.
void quantize_row(const float* x, int64_t K, int64_t Kp, uint8_t* q, float* scale) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 amax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, x + k));
    amax = _mm512_max_ps(amax, a);
    bad |= _mm512_mask_cmp_ps_mask(lanes, a, inf, _CMP_NLT_UQ);  // NaN or inf
  }
  const float m = _mm512_reduce_max_ps(amax);  // a maximum: exact in any order
  if (bad) {
    *scale = NAN;
    std::memset(q, 128, size_t(Kp));
    return;
  }
  *scale = m / 127.0f;
  const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
  const __m128i shift = _mm_set1_epi8(char(0x80));
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + k), inv));  // nearest even
    const __m128i b = _mm_xor_si128(_mm512_cvtsepi32_epi8(i), shift);
    _mm_mask_storeu_epi8(q + k, lanes, b);
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = 128;
}

inline int32_t quad(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [row, row + R) of the quantized input against one group of 64 columns, all four strips.
template <int R>
inline void rows_by_group(const uint8_t* q, const float* sx, int64_t Kp, const int8_t* wg, const int32_t* offset,
                          const float* sw, const Output<float>& out, int64_t row, int64_t col) {
  const int64_t quads = Kp / 4;
  __m512i acc[R][kStrips];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) acc[r][s] = _mm512_setzero_si512();
  const uint8_t* qr = q + row * Kp;
  for (int64_t k = 0; k < quads; ++k) {
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) {
      const int8_t* wk = wg + (s * quads + k) * 64;
      const __m512i w = _mm512_loadu_si512(wk);
      if (R > 1) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead * 64), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][s] = _mm512_dpbusd_epi32(acc[r][s], _mm512_set1_epi32(quad(qr + r * Kp + 4 * k)), w);
    }
  }
  __m256 sums[R][2 * kStrips];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 rs = _mm512_set1_ps(sx[row + r]);
#pragma GCC unroll 4
    for (int s = 0; s < kStrips; ++s) {
      const __m512 v = dequantize16(acc[r][s], offset + col + s * kStrip, sw + col + s * kStrip, rs);
      sums[r][2 * s] = low_half(v);
      sums[r][2 * s + 1] = high_half(v);
    }
  }
  finish<R, 2 * kStrips>(out, row, col, sums);
}

}  // namespace

int linear_q8(const kv_weight& w, const float* x, int64_t rows, float* y, int epilogue, const float* residual,
              const Norm& norm) {
  const int64_t K = w.n_in, O = w.n_out, Kp = (K + 3) / 4 * 4;
  const bool amx = rows >= kAmxMinRows && Kp % 64 == 0 && amx_int8_ready();
  const int64_t stored_rows = (rows + 15) / 16 * 16;  // whole tiles of 16 rows for AMX to read
  thread_local std::vector<uint8_t> quantized;
  thread_local std::vector<float> scales;
  if (quantized.size() < size_t(stored_rows * Kp)) quantized.resize(size_t(stored_rows * Kp), 128);
  if (scales.size() < size_t(rows)) scales.resize(size_t(rows));
  uint8_t* q = quantized.data();
  float* sx = scales.data();
  ThreadPool::instance().run(rows, [&](int64_t r) {
    const float* in = x + r * K;
    thread_local std::vector<float> normed;
    if (norm.weight != nullptr) {
      if (normed.size() < size_t(K)) normed.resize(size_t(K));
      layer_norm_row(in, K, norm.weight, norm.bias, norm.eps, normed.data());
      in = normed.data();
    }
    quantize_row(in, K, Kp, q + r * Kp, sx + r);
  });
  const Output<float> out{y, residual, w.bias, O, epilogue};
  if (amx) {
    linear_q8_amx(w, q, sx, rows, Kp, out);
    return 0;
  }
  const auto* weights = static_cast<const int8_t*>(w.data);
  const int64_t groups = (O + kGroup - 1) / kGroup;
  const int64_t row_blocks = rows > 2 * kRowBlock ? (rows + kRowBlock - 1) / kRowBlock : 1;
  const int64_t block = row_blocks == 1 ? rows : kRowBlock;
  ThreadPool::instance().run(groups * row_blocks, [&](int64_t task) {
    const int64_t g = task % groups, rb = task / groups;
    const int64_t first = rb * block, end = std::min(rows, first + block);
    const int8_t* wg = weights + g * Kp * kGroup;
    for (int64_t r = first; r < end; r += kRowTile) {
      const int64_t col = g * kGroup;
      switch (std::min<int64_t>(kRowTile, end - r)) {
        case 1:
          rows_by_group<1>(q, sx, Kp, wg, w.offset, w.scale, out, r, col);
          break;
        case 2:
          rows_by_group<2>(q, sx, Kp, wg, w.offset, w.scale, out, r, col);
          break;
        case 3:
          rows_by_group<3>(q, sx, Kp, wg, w.offset, w.scale, out, r, col);
          break;
        case 4:
          rows_by_group<4>(q, sx, Kp, wg, w.offset, w.scale, out, r, col);
          break;
        case 5:
          rows_by_group<5>(q, sx, Kp, wg, w.offset, w.scale, out, r, col);
          break;
        default:
          rows_by_group<6>(q, sx, Kp, wg, w.offset, w.scale, out, r, col);
          break;
      }
    }
  });
  return 0;
}

#else

int linear_q8(const kv_weight&, const float*, int64_t, float*, int, const float*, const Norm&) { return -1; }

#endif

}  // namespace kv

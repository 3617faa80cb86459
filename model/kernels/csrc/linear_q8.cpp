// y = epilogue(norm(x) @ W + b) with int8 weights: each row of norm(x) quantized to int8 on the fly,
// the products summed in int32, the sums scaled back to float32; and the AVX512-VNNI path.
//
// Reduction order: the sum over k is in int32, which is exact (|sum| <= 255 * 127 * K < 2^31 for
// K < 66,000), so no order of it can change a bit. Every float operation after it is per output
// element, in one fixed sequence:
//     y = epilogue(float(sum_k q[r][k] * W[k][o]) * (sx[r] * sw[o]) + b[o])      (epilogue.h)
// Each row's activations are quantized from that row alone (symmetric, by its own max |x|), so a
// row's outputs never depend on the rest of the batch: cached equals uncached, alone equals batched.
// Every path (AVX2, AVX-VNNI, AVX512-VNNI, AMX) computes those same sums and that same sequence, so
// a row gets the same bits on any of them.
//
// Weights (model/kernels/int8.py): per-output-column symmetric int8, groups of 64 columns, each four
// strips of 16 columns with k in quads, (groups, 4, K/4, 16, 4): one 64-byte line per strip per quad.
// Here vpdpbusd multiplies 4 unsigned bytes of x (q + 128) by the 4 signed bytes of each of 16 columns
// and adds the four products to the column's int32 lane; offset[o] = 128 * sum_k W[k][o] removes the
// shift.
#include "linear_q8.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "thread_pool.h"

namespace kv {
namespace {

constexpr int64_t kGroup = 64, kStrip = 16, kStrips = 4;
constexpr int64_t kRowTile = 6;         // rows sharing each weight load: 24 accumulators + 4 weights fit 32 registers
constexpr int64_t kRowBlock = 96;       // rows per task when there are many (a multiple of kRowTile)
constexpr int64_t kPrefetchAhead = 32;  // quads (cache lines of a strip) asked for ahead, for multi-row tiles
constexpr int64_t kAmxMinRows = 4;      // from this many rows on, AMX tiles (same bits, see linear_q8_amx.cpp)

// One row to int8: q[k] = rne(x[k] * (127 / amax)), with `shift` (0, or 0x80 for q + 128) xored in,
// and `shift` (a zero) from K up to Kp. |q| <= 127, since x[k] * (127 / amax) rounds to at most 127.
// scale = amax / 127; NaN where the row holds a NaN or an infinity, so that its outputs are NaN too.
void quantize_row(const float* x, int64_t K, int64_t Kp, uint8_t shift, uint8_t* q, float* scale) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
  __m256 amax = _mm256_setzero_ps();
  int bad = 0;
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = K - k >= 8 ? load8(x + k) : load_partial(x + k, int(K - k));  // zeros past K
    const __m256 a = _mm256_and_ps(v, magnitude);
    amax = _mm256_max_ps(amax, a);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or inf
  }
  const float m = hmax8(amax);  // a maximum: exact in any order
  if (bad) {
    *scale = NAN;
    std::memset(q, shift, size_t(Kp));
    return;
  }
  *scale = m / 127.0f;
  const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256i flip = _mm256_set1_epi8(char(shift));
  for (int64_t k = 0; k < K; k += 32) {
    const int n = int(std::min<int64_t>(32, K - k));
    alignas(32) float tail[32] = {};
    const float* src = x + k;
    if (n < 32) {
      std::memcpy(tail, src, size_t(n) * sizeof(float));
      src = tail;
    }
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + 8 * j), inv));  // nearest even
    const __m256i words = _mm256_packs_epi32(i[0], i[1]), words2 = _mm256_packs_epi32(i[2], i[3]);
    const __m256i bytes = _mm256_xor_si256(_mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2), order), flip);
    if (n == 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), bytes);
    } else {
      alignas(32) uint8_t out[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(out), bytes);
      std::memcpy(q + k, out, size_t(n));
    }
  }
  std::memset(q + K, shift, size_t(Kp - K));
}

inline int32_t quad(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

namespace avx512_vnni {

// Rows [row, row + R) of the unsigned rows against NS strips of one group of 64 columns, from strip s0:
// all four, or a half of a group (see linear_q8_avx512_vnni). A column's sum is the same whichever strips
// share its loop.
template <int R, int NS = kStrips>
KV_TARGET_AVX512_VNNI void rows_by_group(const QuantizedRows& in, const int8_t* wg, const kv_weight& w,
                                         const Output<float>& out, int64_t row, int64_t col, int s0 = 0) {
  const int64_t Kp = in.Kp, quads = Kp / 4;
  __m512i acc[R][NS];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < NS; ++s) acc[r][s] = _mm512_setzero_si512();
  const uint8_t* qr = in.q + row * Kp;
  const int8_t* ws = wg + s0 * quads * 64;
  for (int64_t k = 0; k < quads; ++k) {
#pragma GCC unroll 4
    for (int s = 0; s < NS; ++s) {
      const int8_t* wk = ws + (s * quads + k) * 64;
      const __m512i wv = _mm512_loadu_si512(wk);
      if (R > 1) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead * 64), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][s] = _mm512_dpbusd_epi32(acc[r][s], _mm512_set1_epi32(quad(qr + r * Kp + 4 * k)), wv);
    }
  }
  const int64_t first = col + s0 * kStrip;
  __m256 sums[R][2 * NS];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 rs = _mm512_set1_ps(in.sx[row + r]);
#pragma GCC unroll 4
    for (int s = 0; s < NS; ++s) {
      const int64_t o = first + s * kStrip;
      const __m512i exact = _mm512_sub_epi32(acc[r][s], _mm512_loadu_si512(w.offset + o));
      const __m512 v = avx512::dequantize16(exact, w.scale + o, rs);
      sums[r][2 * s] = avx512::low_half(v);
      sums[r][2 * s + 1] = avx512::high_half(v);
    }
  }
  finish<R, 2 * NS>(out, row, first, sums);
}

}  // namespace avx512_vnni

// Rows [first, end) against NS strips of one group from strip s0, in tiles of up to kRowTile rows.
template <int NS>
void vnni_rows(const QuantizedRows& in, const int8_t* wg, const kv_weight& w, const Output<float>& out, int64_t first,
               int64_t end, int64_t col, int s0) {
  for (int64_t r = first; r < end; r += kRowTile) {
    switch (std::min<int64_t>(kRowTile, end - r)) {
      case 1:
        avx512_vnni::rows_by_group<1, NS>(in, wg, w, out, r, col, s0);
        break;
      case 2:
        avx512_vnni::rows_by_group<2, NS>(in, wg, w, out, r, col, s0);
        break;
      case 3:
        avx512_vnni::rows_by_group<3, NS>(in, wg, w, out, r, col, s0);
        break;
      case 4:
        avx512_vnni::rows_by_group<4, NS>(in, wg, w, out, r, col, s0);
        break;
      case 5:
        avx512_vnni::rows_by_group<5, NS>(in, wg, w, out, r, col, s0);
        break;
      default:
        avx512_vnni::rows_by_group<6, NS>(in, wg, w, out, r, col, s0);
        break;
    }
  }
}

// Tasks are groups of 64 columns (and, for many rows, blocks of rows). With one block of rows, groups that
// do not share out evenly among the threads (SmolLM2's 576 columns are 9 groups) leave one thread a group
// more than the other: the last (groups % threads) groups then go in halves of two strips, so that each
// thread reads about as many weights. Halves or wholes, a column's arithmetic is the same.
void linear_q8_avx512_vnni(const kv_weight& w, const QuantizedRows& in, const Output<float>& out) {
  const auto* weights = static_cast<const int8_t*>(w.data);
  const int64_t rows = in.rows, groups = (w.n_out + kGroup - 1) / kGroup;
  const int64_t row_blocks = rows > 2 * kRowBlock ? (rows + kRowBlock - 1) / kRowBlock : 1;
  const int64_t block = row_blocks == 1 ? rows : kRowBlock;
  const int64_t threads = ThreadPool::instance().num_threads();
  const int64_t halved = row_blocks == 1 && groups > threads ? groups % threads : 0;  // the last groups, in halves
  const int64_t whole = groups - halved;
  ThreadPool::instance().run(whole * row_blocks + 2 * halved, [&](int64_t task) {
    const bool half = task >= whole * row_blocks;
    const int64_t g = half ? whole + (task - whole * row_blocks) / 2 : task % whole;
    const int64_t rb = half ? 0 : task / whole;
    const int s0 = half ? int((task - whole * row_blocks) % 2) * 2 : 0;
    const int64_t first = rb * block, end = std::min(rows, first + block);
    const int8_t* wg = weights + g * in.Kp * kGroup;
    const int64_t col = g * kGroup;
    if (half)
      vnni_rows<2>(in, wg, w, out, first, end, col, s0);
    else
      vnni_rows<kStrips>(in, wg, w, out, first, end, col, 0);
  });
}

}  // namespace

int linear_q8(const kv_weight& w, const float* x, int64_t rows, float* y, int epilogue, const float* residual,
              const Norm& norm) {
  const int64_t K = w.n_in, O = w.n_out, Kp = (K + 3) / 4 * 4;
  int path = kernel_path(KV_WEIGHT_INT8);
  if (path == KV_PATH_AMX && (rows < kAmxMinRows || Kp % 64 != 0))
    path = KV_PATH_AVX512_VNNI;                           // cpu.cpp: AMX
                                                          // comes with it
  const uint8_t shift = path == KV_PATH_AVX2 ? 0 : 0x80;  // vpdpbusd and tdpbusd read unsigned bytes
  const int64_t stored_rows = (rows + 15) / 16 * 16;      // whole tiles of 16 rows for AMX to read
  thread_local std::vector<uint8_t> quantized;
  thread_local std::vector<float> scales;
  if (quantized.size() < size_t(stored_rows * Kp)) quantized.resize(size_t(stored_rows * Kp));
  if (scales.size() < size_t(rows)) scales.resize(size_t(rows));
  uint8_t* q = quantized.data();
  float* sx = scales.data();
  ThreadPool::instance().run(rows, [&](int64_t r) {
    const float* row = x + r * K;
    thread_local std::vector<float> normed;
    if (norm.weight != nullptr) {
      if (normed.size() < size_t(K)) normed.resize(size_t(K));
      norm_row(row, K, norm, normed.data());
      row = normed.data();
    }
    quantize_row(row, K, Kp, shift, q + r * Kp, sx + r);
  });
  const QuantizedRows in{q, sx, rows, Kp};
  const Output<float> out{y, residual, w.bias, output_columns(O, epilogue), epilogue};
  switch (path) {
    case KV_PATH_AMX:
      linear_q8_amx(w, in, out);
      break;
    case KV_PATH_AVX512_VNNI:
      linear_q8_avx512_vnni(w, in, out);
      break;
    default:
      linear_q8_avx2(w, in, out, path == KV_PATH_AVX_VNNI);
      break;
  }
  return 0;
}

}  // namespace kv

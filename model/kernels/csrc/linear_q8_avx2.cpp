// int8 products on 256-bit registers: plain AVX2 (every CPU the library runs on) and AVX-VNNI.
//
// AVX2 has no signed-by-signed byte product, and vpmaddubsw (unsigned bytes times signed bytes, pairs
// summed into int16 with saturation) would saturate on q + 128 (255 * 127 * 2 > 32767). So the rows
// stay signed, and each product is |w| times x with w's sign (vpsignb): |w| <= 127 and |x| <= 127
// make a pair at most 2 * 127 * 127 = 32258, never saturated; vpmaddwd by ones then sums the two
// pairs of each column's quad into its int32 lane. That is sum_k x[k] * W[k][o] itself, exact, so no
// offset is needed. AVX-VNNI's vpdpbusd reads the shifted rows (q + 128) as the AVX512-VNNI path
// does, and the offset takes the shift back out. Both end in dequantize8, the float sequence of
// every int8 path (linear_q8.cpp), so a row gets the same bits here as there.
//
// A group's strip of 16 columns is 64 bytes per quad: two registers of 8 columns. A tile covers R
// rows and V such registers, R * V accumulators in the 16 registers beside the weights and a row's
// broadcast quad.
#include <cstring>

#include "linear_q8.h"
#include "thread_pool.h"

namespace kv {
namespace {

constexpr int64_t kGroup = 64, kVectors = kGroup / 8;  // a group: 8 registers of 8 columns
constexpr int64_t kRowTile = 4;
constexpr int64_t kRowBlock = 96;  // rows per task when there are many (a multiple of kRowTile)
constexpr int64_t kPrefetchAhead = 32;

template <int R>
constexpr int kTileVectors = R == 1   ? 8
                             : R == 2 ? 4
                                      : 2;

inline int32_t quad(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The register of 8 columns v (0..7) of a group at quad k: strip v / 2, its half v % 2.
inline const int8_t* vector_at(const int8_t* wg, int64_t quads, int v, int64_t k) {
  return wg + ((v / 2) * quads + k) * 64 + (v % 2) * 32;
}

// acc[r][v] = sum_k x[r][k] * W[k][8v..8v+7] for registers v of 8 columns, rows signed.
template <int R, int V>
inline void tile_avx2(const uint8_t* q, int64_t Kp, const int8_t* wg, __m256i (&acc)[R][V]) {
  const int64_t quads = Kp / 4;
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
  for (int64_t k = 0; k < quads; ++k) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const int8_t* wk = vector_at(wg, quads, v, k);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      const __m256i magnitude = _mm256_abs_epi8(wv);
      if (R > 1 && v % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead * 64), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(quad(q + r * Kp + 4 * k));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, wv));
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
}

namespace avx_vnni {

// The same sums by AVX-VNNI on rows shifted to unsigned, before the offsets come off.
template <int R, int V>
KV_TARGET_AVX_VNNI void tile(const uint8_t* q, int64_t Kp, const int8_t* wg, __m256i (&acc)[R][V]) {
  const int64_t quads = Kp / 4;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
  for (int64_t k = 0; k < quads; ++k) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const int8_t* wk = vector_at(wg, quads, v, k);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      if (R > 1 && v % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead * 64), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][v] = _mm256_dpbusd_avx_epi32(acc[r][v], _mm256_set1_epi32(quad(q + r * Kp + 4 * k)), wv);
    }
  }
}

}  // namespace avx_vnni

// Rows [row, row + R) against one group of 64 columns, V registers of 8 columns per tile.
template <int R>
void rows_by_group(const QuantizedRows& in, const int8_t* wg, const kv_weight& w, const Output<float>& out, int64_t row,
                   int64_t col, bool avx_vnni) {
  constexpr int V = kTileVectors<R>;
  const int64_t quads = in.Kp / 4;
  const uint8_t* q = in.q + row * in.Kp;
  for (int v0 = 0; v0 < kVectors; v0 += V) {
    const int8_t* wt = wg + (v0 / 2) * quads * 64;  // V is even: the tile starts at a strip
    __m256i acc[R][V];
    if (avx_vnni)
      avx_vnni::tile<R, V>(q, in.Kp, wt, acc);
    else
      tile_avx2<R, V>(q, in.Kp, wt, acc);
    __m256 sums[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 sx = _mm256_set1_ps(in.sx[row + r]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const int64_t o = col + 8 * (v0 + v);
        __m256i exact = acc[r][v];
        if (avx_vnni)
          exact = _mm256_sub_epi32(exact, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.offset + o)));
        sums[r][v] = dequantize8(exact, w.scale + o, sx);
      }
    }
    finish<R, V>(out, row, col + 8 * v0, sums);
  }
}

}  // namespace

void linear_q8_avx2(const kv_weight& w, const QuantizedRows& in, const Output<float>& out, bool avx_vnni) {
  const auto* weights = static_cast<const int8_t*>(w.data);
  const int64_t rows = in.rows, groups = (w.n_out + kGroup - 1) / kGroup;
  const int64_t row_blocks = rows > 2 * kRowBlock ? (rows + kRowBlock - 1) / kRowBlock : 1;
  const int64_t block = row_blocks == 1 ? rows : kRowBlock;
  ThreadPool::instance().run(groups * row_blocks, [&](int64_t task) {
    const int64_t g = task % groups, rb = task / groups;
    const int64_t first = rb * block, end = std::min(rows, first + block);
    const int8_t* wg = weights + g * in.Kp * kGroup;
    const int64_t col = g * kGroup;
    for (int64_t r = first; r < end; r += kRowTile) {
      switch (std::min<int64_t>(kRowTile, end - r)) {
        case 1:
          rows_by_group<1>(in, wg, w, out, r, col, avx_vnni);
          break;
        case 2:
          rows_by_group<2>(in, wg, w, out, r, col, avx_vnni);
          break;
        case 3:
          rows_by_group<3>(in, wg, w, out, r, col, avx_vnni);
          break;
        default:
          rows_by_group<4>(in, wg, w, out, r, col, avx_vnni);
          break;
      }
    }
  });
}

}  // namespace kv

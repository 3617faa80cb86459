// int8 products on AMX tiles (tdpbusd): 16 rows x 64 bytes of unsigned activations against 16 quads
// x 16 columns of signed weights, summed in int32 lanes.
//
// The weights keep linear_q8's layout, (groups, 4 strips, K / 4 quads, 16 columns, 4): a strip's 16
// quads from k = 64c are one contiguous 1 KiB tile, 64 bytes a row, which is how tdpbusd reads its
// second operand. The sums are int32 and exact, so they equal the other paths' whatever the order;
// the float sequence after them is the one of linear_q8.cpp, element by element:
//     y = epilogue(float(acc - offset[o]) * (sx[r] * sw[o]) + b[o])
// A row's outputs are therefore the same bits on any path, and in any batch.
#include <cstring>

#include "linear_q8.h"
#include "thread_pool.h"

namespace kv {
namespace {

constexpr int64_t kTileRows = 16, kTileBytes = 64, kGroup = 64, kStrip = 16, kStrips = 4;
constexpr int64_t kRowBlock = 2 * kTileRows;  // rows per task: two A tiles share each B tile

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

namespace amx {

// Tiles 0-3 accumulate (2 row tiles x 2 strips), 4-5 hold activations, 6-7 weights.
KV_TARGET_AMX void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = kTileBytes;
  }
  _tile_loadconfig(&c);
}

// dequantize16 (linear_q8.h) and the epilogue for one row and two strips (32 columns).
KV_TARGET_AMX inline void finish_row(const int32_t* acc, const kv_weight& w, float sx, const Output<float>& out,
                                     int64_t row, int64_t col) {
  __m256 sums[1][4];
  const __m512 rs = _mm512_set1_ps(sx);
  for (int s = 0; s < 2; ++s) {
    const int64_t o = col + s * kStrip;
    const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(acc + s * kStrip), _mm512_loadu_si512(w.offset + o));
    const __m512 v = avx512::dequantize16(exact, w.scale + o, rs);
    sums[0][2 * s] = avx512::low_half(v);
    sums[0][2 * s + 1] = avx512::high_half(v);
  }
  finish<1, 4>(out, row, col, sums);
}

// One task: up to 32 rows from `first` against group g, all four strips.
KV_TARGET_AMX void group_task(const kv_weight& w, const QuantizedRows& in, const Output<float>& out, int64_t g,
                              int64_t first) {
  configure_tiles();  // per task: the thread may have run other tile code since
  const int64_t Kp = in.Kp, quads = Kp / 4, chunks = Kp / kTileBytes;
  const int64_t n = std::min(kRowBlock, in.rows - first);
  const bool two = n > kTileRows;
  const int8_t* wg = static_cast<const int8_t*>(w.data) + g * Kp * kGroup;
  const uint8_t* a0 = in.q + first * Kp;
  const uint8_t* a1 = a0 + kTileRows * Kp;
  alignas(64) int32_t acc[kRowBlock][2 * kStrip];  // (rows, 2 strips x 16 columns)
  for (int64_t s = 0; s < kStrips; s += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int8_t* b0 = wg + s * quads * kTileBytes;
    const int8_t* b1 = b0 + quads * kTileBytes;
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, a0 + c * kTileBytes, Kp);
      _tile_loadd(6, b0 + c * kTileRows * kTileBytes, kTileBytes);
      _tile_loadd(7, b1 + c * kTileRows * kTileBytes, kTileBytes);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      if (two) {
        _tile_loadd(5, a1 + c * kTileBytes, Kp);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
      }
    }
    _tile_stored(0, &acc[0][0], 2 * kStrip * sizeof(int32_t));
    _tile_stored(1, &acc[0][kStrip], 2 * kStrip * sizeof(int32_t));
    if (two) {
      _tile_stored(2, &acc[kTileRows][0], 2 * kStrip * sizeof(int32_t));
      _tile_stored(3, &acc[kTileRows][kStrip], 2 * kStrip * sizeof(int32_t));
    }
    const int64_t col = g * kGroup + s * kStrip;
    for (int64_t r = 0; r < n; ++r) finish_row(acc[r], w, in.sx[first + r], out, first + r, col);
  }
}

}  // namespace amx
}  // namespace

void linear_q8_amx(const kv_weight& w, const QuantizedRows& in, const Output<float>& out) {
  const int64_t groups = (w.n_out + kGroup - 1) / kGroup;
  const int64_t row_blocks = (in.rows + kRowBlock - 1) / kRowBlock;
  ThreadPool::instance().run(groups * row_blocks, [&](int64_t task) {
    amx::group_task(w, in, out, task % groups, task / groups * kRowBlock);
  });
}

}  // namespace kv

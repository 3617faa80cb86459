// Causal attention of a flattened step over a paged KV cache.
//
// The step holds the new tokens of several sequences back to back (their query_start offsets).
// Each token's keys and values are first written to its cache slot (slot_mapping); then each
// (token, head) attends over keys 0..position of its own sequence, read in place from the blocks
// its block table lists. A prefill row at position t and a decode step at position t therefore run
// the same code over the same keys.
//
// Grouped-query attention: a token's row of qkv holds its `heads` query heads, then `kv_heads` key heads,
// then as many value heads; query head h reads key/value head h / (heads / kv_heads) from the cache in
// place (no copy per query head). GPT-2 has kv_heads == heads.
//
// Cache layout per layer: (num_blocks, 2, kv_heads, block_size * head_dim), keys then values. Keys are
// stored transposed within a block, [head_dim][block_size], so 8 keys' scores come from one FMA per
// dimension with no horizontal sum; values are [block_size][head_dim].
//
// Reduction order for one (token, head) with n = position + 1 keys:
//   score[j] = (sum over even d + sum over odd d of q[d] k_j[d], each sequential by FMA) * scale
//   m        = max over j (exact in any order)
//   p[j]     = exp(score[j] - m)                          (kv::exp8)
//   sum      = lane l adds p[j] for j = l, l + 8, ... in order, then hsum8's fixed tree
//   out[d]   = (sum over even j + sum over odd j of p[j] v_j[d], each sequential by FMA) / sum
// Every one depends on n alone.
//
// Two paths, the same bits: 8 lanes on AVX2, and 16 on AVX-512 (attend_for), each lane running the same
// sequence of a key's score or an output dimension's sum.
//
// The cache may hold a narrower type than the step's activations (float32 activations over a
// bfloat16 cache): keys and values are rounded once, when written, and widened exactly when read,
// so a prefill row and a decode step still read the same values.
//
// An int8 cache quantizes each (token, head)'s keys and its values when written: a float32 scale
// s = max |x| / 127 and q = round(x / s) in [-127, 127], the head's bs scales stored after its int8 block
// ([hd][bs] keys or [bs][hd] values, then bs floats). Read, q widens exactly to float and the scales
// enter once per key: score[j] = ((even + odd) * s_k[j]) * scale, and each weight p[j] is taken as
// p[j] * s_v[j] (one float product) before the value sums; the softmax's sum is of the p[j] themselves.
// Half the bytes of a bfloat16 cache plus 4 per (token, head); every identity above holds, as the
// values are the same wherever they are read.
#include <algorithm>
#include <vector>

#include "api.h"
#include "cpu.h"
#include "thread_pool.h"
#include "vec.h"

namespace kv {
namespace {

struct Step {
  int64_t tokens, heads, kv_heads, head_dim, block_size;
  const int64_t* slot_mapping;  // (tokens,) cache slot = block * block_size + offset, or -1: not written
  int64_t seqs;
  const int32_t* query_start;   // (seqs + 1,) first token of each sequence in the step
  const int32_t* seq_lens;      // (seqs,) keys of each sequence after this step (its last position + 1)
  const int32_t* block_tables;  // (rows, max_blocks) block ids
  int64_t block_table_stride;
  const int32_t* seq_rows;  // (seqs,) each sequence's row in block_tables
  float scale;
};

// A value as the cache stores it: unchanged in the step's own type, else rounded to nearest even.
template <typename C, typename T>
inline C to_cache(T v) {
  if constexpr (std::is_same_v<C, T>)
    return v;
  else
    return from_f32<C>(to_f32(v));
}

// A token's row of qkv: its query heads, key heads and value heads.
inline int64_t row_width(const Step& s) { return (s.heads + 2 * s.kv_heads) * s.head_dim; }

template <typename KV>
constexpr bool kQuantized = std::is_same_v<KV, int8_t>;

// One head's part of a block, in cache elements: its keys [hd][bs] or values [bs][hd], then, in an int8
// cache, their bs float32 scales. A block is (2, kv_heads, region): every head's keys, then their values.
template <typename KV>
inline int64_t head_region(int64_t hd, int64_t bs) {
  return hd * bs + (kQuantized<KV> ? int64_t(sizeof(float)) * bs : 0);
}

// The scales of the region at `region` (an int8 cache's).
inline const float* scales_of(const int8_t* region, int64_t hd, int64_t bs) {
  return reinterpret_cast<const float*>(region + hd * bs);
}
inline float* scales_of(int8_t* region, int64_t hd, int64_t bs) { return reinterpret_cast<float*>(region + hd * bs); }

// n values (one token's head; n a multiple of 8) into q[i * stride] with their scale: s = max |x| / 127,
// q = round(x / s), 8 lanes at a time (each lane's division and rounding are the scalar ones). A head with a
// NaN or inf gets a NaN scale (every score or value it enters is NaN, as in a float cache); an all-zero head,
// scale 0 and zeros.
template <typename T>
inline void quantize_head(const T* x, int64_t n, int8_t* q, int64_t stride, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, load8(x + i));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or inf
    amax = _mm256_max_ps(amax, a);
  }
  const bool finite = _mm256_movemask_ps(bad) == 0;
  const float s = finite ? hmax8(amax) / 127.0f : NAN;
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  alignas(32) int32_t lanes[8];
  for (int64_t i = 0; i < n; i += 8) {
    __m256 r = _mm256_setzero_ps();
    if (finite && s > 0.0f)
      r = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_div_ps(load8(x + i), sv),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_cvtps_epi32(r));
    for (int l = 0; l < 8; ++l) q[(i + l) * stride] = int8_t(lanes[l]);
  }
}

template <typename T, typename C>
void write_cache(const T* qkv, C* cache, const Step& s) {
  const int64_t width = s.kv_heads * s.head_dim, bs = s.block_size, hd = s.head_dim;
  const int64_t region = head_region<C>(hd, bs), block_elems = 2 * s.kv_heads * region;
  constexpr int64_t kTokensPerTask = 16;
  ThreadPool::instance().run((s.tokens + kTokensPerTask - 1) / kTokensPerTask, [&](int64_t task) {
    for (int64_t i = task * kTokensPerTask; i < std::min(s.tokens, (task + 1) * kTokensPerTask); ++i) {
      const int64_t slot = s.slot_mapping[i];
      if (slot < 0) continue;
      const int64_t block = slot / bs, offset = slot % bs;
      const T* k = qkv + i * row_width(s) + s.heads * hd;
      const T* v = k + width;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        C* keys = cache + block * block_elems + h * region;                   // [hd][bs]
        C* values = cache + block * block_elems + (s.kv_heads + h) * region;  // [bs][hd]
        if constexpr (kQuantized<C>) {
          quantize_head(k + h * hd, hd, keys + offset, bs, scales_of(keys, hd, bs) + offset);
          quantize_head(v + h * hd, hd, values + offset * hd, 1, scales_of(values, hd, bs) + offset);
        } else {
          for (int64_t d = 0; d < hd; ++d) {
            keys[d * bs + offset] = to_cache<C>(k[h * hd + d]);
            values[offset * hd + d] = to_cache<C>(v[h * hd + d]);
          }
        }
      }
    }
  });
}

// Keys and values while earlier blocks are read: blocks lie anywhere in the cache, so the hardware
// prefetcher cannot see the next one coming, and a block is little work (16 keys of a head), so the one
// after it would come too late: the loops ask for block b + kAhead while they read block b. The scores'
// loop asks for the keys and (into L2) the values, so that the values wait there for the softmax to end.
constexpr int64_t kAhead = 4;

// Asks for `elems` elements from p into the cache level Hint names (_MM_HINT_T0: L1, _MM_HINT_T1: L2).
template <_mm_hint Hint = _MM_HINT_T0, typename T>
inline void prefetch(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t at = 0; at < elems * int64_t(sizeof(T)); at += 64) _mm_prefetch(c + at, Hint);
}

// Where one head's keys ([hd][bs]) and values ([bs][hd]) of each block lie, and the prefetches above.
template <typename KV>
struct HeadBlocks {
  const KV* cache;
  const int32_t* blocks;
  int64_t num_blocks, block_elems, key_offset, value_offset, elems, hd, bs;
  const KV* keys(int64_t b) const { return cache + int64_t(blocks[b]) * block_elems + key_offset; }
  const KV* values(int64_t b) const { return cache + int64_t(blocks[b]) * block_elems + value_offset; }
  // An int8 cache's scales of block b's keys and values (bs each).
  const float* key_scales(int64_t b) const { return scales_of(keys(b), hd, bs); }
  const float* value_scales(int64_t b) const { return scales_of(values(b), hd, bs); }
  void ask_keys_values(int64_t b) const {  // block b's keys and values, where there is one
    if (b >= num_blocks) return;
    prefetch(keys(b), elems);
    prefetch<_MM_HINT_T1>(values(b), elems);
  }
  void ask_values(int64_t b) const {
    if (b < num_blocks) prefetch(values(b), elems);
  }
};

template <typename KV>
inline HeadBlocks<KV> head_blocks(const KV* cache, const int32_t* blocks, int64_t n, int64_t head, const Step& s) {
  const int64_t bs = s.block_size, hd = s.head_dim, region = head_region<KV>(hd, bs);
  HeadBlocks<KV> h{
      cache, blocks, (n + bs - 1) / bs, 2 * s.kv_heads * region, head * region, (s.kv_heads + head) * region, region,
      hd,    bs};
  for (int64_t b = 0; b < kAhead; ++b) h.ask_keys_values(b);
  return h;
}

// Scores of G groups of 8 keys at once, each group's two chains (even and odd d) as in the order
// above: the groups are independent, so interleaving them only hides the FMA latency (a lone
// group's 2 chains of hd / 2 dependent FMAs wait on it); no lane's sequence changes.
template <int G, int HD, typename C>
inline void score_groups(const float* q, const C* const* keys, const float* const* key_scales, int64_t bs,
                         float* const* out, __m256 scale) {
  __m256 even[G], odd[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int64_t d = 0; d < HD; d += 2) {
    const __m256 qe = _mm256_set1_ps(q[d]), qo = _mm256_set1_ps(q[d + 1]);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      even[g] = _mm256_fmadd_ps(qe, load8(keys[g] + d * bs), even[g]);
      odd[g] = _mm256_fmadd_ps(qo, load8(keys[g] + (d + 1) * bs), odd[g]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m256 sum = _mm256_add_ps(even[g], odd[g]);
    if constexpr (kQuantized<C>) sum = _mm256_mul_ps(sum, _mm256_loadu_ps(key_scales[g]));
    _mm256_storeu_ps(out[g], _mm256_mul_ps(sum, scale));
  }
}

// The softmax of one (token, head)'s scores in place, as the order above gives it: keys past n (the rest of
// the last block) count for nothing (-inf, p = 0, never a value read). Returns the sum, in every lane.
inline __m256 softmax_in_place(float* sc, int64_t n, int64_t padded) {
  for (int64_t j = n; j < padded; ++j) sc[j] = -INFINITY;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + j));
  const __m256 m = _mm256_set1_ps(hmax8(mv));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m));
    _mm256_storeu_ps(sc + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return _mm256_set1_ps(hsum8(sum));
}

// The weights block b's values are summed with: the softmax's p[j] themselves, or in an int8 cache p[j] times
// each value's scale (into scratch, one float product each).
constexpr int64_t kMaxBlock = KV_INT8_CACHE_MAX_BLOCK;  // the largest block_size an int8 cache takes
template <typename KV>
inline const float* weights_of(const float* p, int64_t len, const HeadBlocks<KV>& hb, int64_t b, float* scratch) {
  if constexpr (kQuantized<KV>) {
    const float* vs = hb.value_scales(b);
    for (int64_t o = 0; o < len; ++o) scratch[o] = p[o] * vs[o];
    return scratch;
  } else {
    return p;
  }
}

// One (token, query head) over key/value head `head`: NV = head_dim / 8 vectors per key, so the sums stay
// in registers.
template <int NV, typename T, typename KV>
void attend_one(const T* q_in, const KV* cache, const int32_t* blocks, int64_t n, int64_t head, const Step& s,
                std::vector<float>& scores, T* out) {
  constexpr int64_t hd = 8 * NV;
  constexpr int kGroups = 4;  // groups of 8 keys scored together: 8 independent chains
  const int64_t bs = s.block_size;
  const HeadBlocks<KV> hb = head_blocks(cache, blocks, n, head, s);
  alignas(32) float q[hd];
  for (int64_t d = 0; d < hd; ++d) q[d] = to_f32(q_in[d]);
  const int64_t padded = (n + bs - 1) / bs * bs;
  if (int64_t(scores.size()) < padded) scores.resize(size_t(padded));
  float* sc = scores.data();
  const __m256 scale = _mm256_set1_ps(s.scale);
  const KV* group_keys[kGroups];
  const float* group_scales[kGroups] = {};
  float* group_out[kGroups];
  int pending = 0;
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
    const KV* keys = hb.keys(b);  // [hd][bs]
    hb.ask_keys_values(b + kAhead);
    for (int64_t c = 0; c < bs; c += 8) {
      if constexpr (kQuantized<KV>) group_scales[pending] = hb.key_scales(b) + c;
      group_keys[pending] = keys + c;
      group_out[pending] = sc + j0 + c;
      if (++pending == kGroups) {
        score_groups<kGroups, hd>(q, group_keys, group_scales, bs, group_out, scale);
        pending = 0;
      }
    }
  }
  switch (pending) {
    case 1:
      score_groups<1, hd>(q, group_keys, group_scales, bs, group_out, scale);
      break;
    case 2:
      score_groups<2, hd>(q, group_keys, group_scales, bs, group_out, scale);
      break;
    case 3:
      score_groups<3, hd>(q, group_keys, group_scales, bs, group_out, scale);
      break;
    default:
      break;
  }
  const __m256 total = softmax_in_place(sc, n, padded);
  float wscratch[kMaxBlock];
  __m256 even[NV], odd[NV];  // keys at even and odd positions (block_size is even, so offsets share the parity)
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) even[c] = odd[c] = _mm256_setzero_ps();
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
    const KV* values = hb.values(b);  // [bs][hd]
    hb.ask_values(b + kAhead);
    const int64_t len = std::min(bs, n - j0);
    const float* p = weights_of(sc + j0, len, hb, b, wscratch);
    int64_t o = 0;
    for (; o + 1 < len; o += 2) {
      const __m256 pe = _mm256_set1_ps(p[o]), po = _mm256_set1_ps(p[o + 1]);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) {
        even[c] = _mm256_fmadd_ps(pe, load8(values + o * hd + 8 * c), even[c]);
        odd[c] = _mm256_fmadd_ps(po, load8(values + (o + 1) * hd + 8 * c), odd[c]);
      }
    }
    if (o < len) {
      const __m256 pe = _mm256_set1_ps(p[o]);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) even[c] = _mm256_fmadd_ps(pe, load8(values + o * hd + 8 * c), even[c]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) store8(out + 8 * c, _mm256_div_ps(_mm256_add_ps(even[c], odd[c]), total));
}

// The same (token, head) on AVX-512, twice the lanes: 16 keys' scores per FMA (a block of 16 keys is one
// 16-lane row of a dimension), 16 of the output's dimensions per FMA. Each lane runs the sequence of the
// 8-lane code above (a key's two chains over d, then even + odd, then the scale; an output dimension's two
// chains over j, then even + odd, over the sum), and the softmax between them is that code's: the two paths
// give the same bits. Needs block_size % 16 == 0 and head_dim % 32 == 0 (attend_for).
namespace avx512 {

using kv::avx512::high_half;
using kv::avx512::load16;
using kv::avx512::low_half;

template <int G, int HD, typename C>
KV_TARGET_AVX512 inline void score_groups16(const float* q, const C* const* keys, const float* const* key_scales,
                                            int64_t bs, float* const* out, __m512 scale) {
  __m512 even[G], odd[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t d = 0; d < HD; d += 2) {
    const __m512 qe = _mm512_set1_ps(q[d]), qo = _mm512_set1_ps(q[d + 1]);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      even[g] = _mm512_fmadd_ps(qe, load16(keys[g] + d * bs), even[g]);
      odd[g] = _mm512_fmadd_ps(qo, load16(keys[g] + (d + 1) * bs), odd[g]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m512 sum = _mm512_add_ps(even[g], odd[g]);
    if constexpr (kQuantized<C>) sum = _mm512_mul_ps(sum, _mm512_loadu_ps(key_scales[g]));
    _mm512_storeu_ps(out[g], _mm512_mul_ps(sum, scale));
  }
}

template <typename T>
KV_TARGET_AVX512 inline void store16(T* p, __m512 v) {
  store8(p, low_half(v));
  store8(p + 8, high_half(v));
}

template <int NV, typename T, typename KV>
KV_TARGET_AVX512 void attend_one(const T* q_in, const KV* cache, const int32_t* blocks, int64_t n, int64_t head,
                                 const Step& s, std::vector<float>& scores, T* out) {
  constexpr int64_t hd = 8 * NV, nw = NV / 2;  // nw 16-lane vectors per key
  constexpr int kGroups = 4;                   // groups of 16 keys scored together: 8 independent chains
  const int64_t bs = s.block_size;
  const HeadBlocks<KV> hb = head_blocks(cache, blocks, n, head, s);
  alignas(64) float q[hd];
  for (int64_t d = 0; d < hd; ++d) q[d] = to_f32(q_in[d]);
  const int64_t padded = (n + bs - 1) / bs * bs;
  if (int64_t(scores.size()) < padded) scores.resize(size_t(padded));
  float* sc = scores.data();
  const __m512 scale = _mm512_set1_ps(s.scale);
  const KV* group_keys[kGroups];
  const float* group_scales[kGroups] = {};
  float* group_out[kGroups];
  int pending = 0;
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
    const KV* keys = hb.keys(b);  // [hd][bs]
    hb.ask_keys_values(b + kAhead);
    for (int64_t c = 0; c < bs; c += 16) {
      if constexpr (kQuantized<KV>) group_scales[pending] = hb.key_scales(b) + c;
      group_keys[pending] = keys + c;
      group_out[pending] = sc + j0 + c;
      if (++pending == kGroups) {
        score_groups16<kGroups, hd>(q, group_keys, group_scales, bs, group_out, scale);
        pending = 0;
      }
    }
  }
  switch (pending) {
    case 1:
      score_groups16<1, hd>(q, group_keys, group_scales, bs, group_out, scale);
      break;
    case 2:
      score_groups16<2, hd>(q, group_keys, group_scales, bs, group_out, scale);
      break;
    case 3:
      score_groups16<3, hd>(q, group_keys, group_scales, bs, group_out, scale);
      break;
    default:
      break;
  }
  const __m512 total = _mm512_broadcast_f32x8(softmax_in_place(sc, n, padded));
  float wscratch[kMaxBlock];
  __m512 even[nw], odd[nw];
#pragma GCC unroll 16
  for (int c = 0; c < nw; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
    const KV* values = hb.values(b);  // [bs][hd]
    hb.ask_values(b + kAhead);
    const int64_t len = std::min(bs, n - j0);
    const float* p = weights_of(sc + j0, len, hb, b, wscratch);
    int64_t o = 0;
    for (; o + 1 < len; o += 2) {
      const __m512 pe = _mm512_set1_ps(p[o]), po = _mm512_set1_ps(p[o + 1]);
#pragma GCC unroll 16
      for (int c = 0; c < nw; ++c) {
        even[c] = _mm512_fmadd_ps(pe, load16(values + o * hd + 16 * c), even[c]);
        odd[c] = _mm512_fmadd_ps(po, load16(values + (o + 1) * hd + 16 * c), odd[c]);
      }
    }
    if (o < len) {
      const __m512 pe = _mm512_set1_ps(p[o]);
#pragma GCC unroll 16
      for (int c = 0; c < nw; ++c) even[c] = _mm512_fmadd_ps(pe, load16(values + o * hd + 16 * c), even[c]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < nw; ++c) store16(out + 16 * c, _mm512_div_ps(_mm512_add_ps(even[c], odd[c]), total));
}

// G query heads of one token that read the same key/value head (a grouped-query model's group, or up to 4 of its
// heads), together: each block's keys and values are loaded and widened once for all G (an int8 cache's
// widening is most of a key's cost), and each head's lanes run attend_one's sequences: the same bits. KG
// groups of 16 keys are scored at once (2 G KG independent chains).
template <int KG, int G, int HD, typename C>
KV_TARGET_AVX512 inline void score_heads16(const float (*q)[HD], const C* const* keys, const float* const* key_scales,
                                           int64_t bs, float* sc, int64_t padded, const int64_t* at, __m512 scale) {
  __m512 even[G][KG], odd[G][KG];
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
    for (int g = 0; g < KG; ++g) even[h][g] = odd[h][g] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t d = 0; d < HD; d += 2) {
    __m512 ke[KG], ko[KG];
#pragma GCC unroll 4
    for (int g = 0; g < KG; ++g) {
      ke[g] = load16(keys[g] + d * bs);
      ko[g] = load16(keys[g] + (d + 1) * bs);
    }
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m512 qe = _mm512_set1_ps(q[h][d]), qo = _mm512_set1_ps(q[h][d + 1]);
#pragma GCC unroll 4
      for (int g = 0; g < KG; ++g) {
        even[h][g] = _mm512_fmadd_ps(qe, ke[g], even[h][g]);
        odd[h][g] = _mm512_fmadd_ps(qo, ko[g], odd[h][g]);
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
    for (int g = 0; g < KG; ++g) {
      __m512 sum = _mm512_add_ps(even[h][g], odd[h][g]);
      if constexpr (kQuantized<C>) sum = _mm512_mul_ps(sum, _mm512_loadu_ps(key_scales[g]));
      _mm512_storeu_ps(sc + h * padded + at[g], _mm512_mul_ps(sum, scale));
    }
}

// Output vectors per pass of the value sums: G W even and odd sums stay within 24 registers.
constexpr int value_width(int G, int nw) {
  int w = nw;
  while (2 * G * w > 24) w /= 2;
  return w;
}

template <int NV, int G, typename T, typename KV>
KV_TARGET_AVX512 void attend_heads(const T* q_in, const KV* cache, const int32_t* blocks, int64_t n, int64_t head,
                                   const Step& s, std::vector<float>& scores, T* out) {
  constexpr int64_t hd = 8 * NV;
  constexpr int nw = NV / 2, KG = 2, W = value_width(G, nw);
  const int64_t bs = s.block_size;
  const HeadBlocks<KV> hb = head_blocks(cache, blocks, n, head, s);
  alignas(64) float q[G][hd];
  for (int h = 0; h < G; ++h)
    for (int64_t d = 0; d < hd; ++d) q[h][d] = to_f32(q_in[h * hd + d]);
  const int64_t padded = (n + bs - 1) / bs * bs;
  if (int64_t(scores.size()) < G * padded) scores.resize(size_t(G * padded));
  float* sc = scores.data();  // head h's scores at sc + h * padded
  const __m512 scale = _mm512_set1_ps(s.scale);
  const KV* group_keys[KG];
  const float* group_scales[KG] = {};
  int64_t group_at[KG];
  int pending = 0;
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
    const KV* keys = hb.keys(b);  // [hd][bs]
    hb.ask_keys_values(b + kAhead);
    for (int64_t c = 0; c < bs; c += 16) {
      if constexpr (kQuantized<KV>) group_scales[pending] = hb.key_scales(b) + c;
      group_keys[pending] = keys + c;
      group_at[pending] = j0 + c;
      if (++pending == KG) {
        score_heads16<KG, G, hd>(q, group_keys, group_scales, bs, sc, padded, group_at, scale);
        pending = 0;
      }
    }
  }
  if (pending == 1) score_heads16<1, G, hd>(q, group_keys, group_scales, bs, sc, padded, group_at, scale);
  __m512 total[G];
  for (int h = 0; h < G; ++h) total[h] = _mm512_broadcast_f32x8(softmax_in_place(sc + h * padded, n, padded));
  float weights[G][kMaxBlock];
  for (int c0 = 0; c0 < nw; c0 += W) {
    __m512 even[G][W], odd[G][W];
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) even[h][w] = odd[h][w] = _mm512_setzero_ps();
    for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
      const KV* values = hb.values(b) + 16 * c0;  // [bs][hd], from output vector c0
      hb.ask_values(b + kAhead);
      const int64_t len = std::min(bs, n - j0);
      const float* p[G];
      for (int h = 0; h < G; ++h) p[h] = weights_of(sc + h * padded + j0, len, hb, b, weights[h]);
      int64_t o = 0;
      for (; o + 1 < len; o += 2) {
#pragma GCC unroll 8
        for (int w = 0; w < W; ++w) {
          const __m512 ve = load16(values + o * hd + 16 * w), vo = load16(values + (o + 1) * hd + 16 * w);
#pragma GCC unroll 4
          for (int h = 0; h < G; ++h) {
            even[h][w] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][o]), ve, even[h][w]);
            odd[h][w] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][o + 1]), vo, odd[h][w]);
          }
        }
      }
      if (o < len) {
#pragma GCC unroll 8
        for (int w = 0; w < W; ++w) {
          const __m512 ve = load16(values + o * hd + 16 * w);
#pragma GCC unroll 4
          for (int h = 0; h < G; ++h) even[h][w] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][o]), ve, even[h][w]);
        }
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w)
        store16(out + h * hd + 16 * (c0 + w), _mm512_div_ps(_mm512_add_ps(even[h][w], odd[h][w]), total[h]));
  }
}

}  // namespace avx512

template <typename T, typename KV>
using AttendFn = void (*)(const T*, const KV*, const int32_t*, int64_t, int64_t, const Step&, std::vector<float>&, T*);

// The AVX-512 path where the kernels may use it and the shapes allow, else the AVX2 one (the same bits).
template <typename T, typename KV>
AttendFn<T, KV> attend_for(int64_t head_dim, int64_t block_size) {
  if (block_size % 16 == 0 && kernel_path(KV_WEIGHT_F32) == KV_PATH_AVX512) {
    switch (head_dim) {
      case 32:
        return avx512::attend_one<4, T, KV>;
      case 64:
        return avx512::attend_one<8, T, KV>;
      case 128:
        return avx512::attend_one<16, T, KV>;
      default:
        break;
    }
  }
  switch (head_dim) {
    case 8:
      return attend_one<1, T, KV>;
    case 16:
      return attend_one<2, T, KV>;
    case 32:
      return attend_one<4, T, KV>;
    case 64:
      return attend_one<8, T, KV>;
    case 128:
      return attend_one<16, T, KV>;
    default:
      return nullptr;
  }
}

// attend_heads for G = 2, 3 or 4 heads where the AVX-512 path runs (as attend_for picks it), else null.
template <typename T, typename KV>
AttendFn<T, KV> attend_heads_for(int64_t head_dim, int64_t block_size, int64_t G) {
  if (block_size % 16 != 0 || kernel_path(KV_WEIGHT_F32) != KV_PATH_AVX512 || G < 2 || G > 4) return nullptr;
  constexpr AttendFn<T, KV> by_dim[3][3] = {
      {avx512::attend_heads<4, 2, T, KV>, avx512::attend_heads<4, 3, T, KV>, avx512::attend_heads<4, 4, T, KV>},
      {avx512::attend_heads<8, 2, T, KV>, avx512::attend_heads<8, 3, T, KV>, avx512::attend_heads<8, 4, T, KV>},
      {avx512::attend_heads<16, 2, T, KV>, avx512::attend_heads<16, 3, T, KV>, avx512::attend_heads<16, 4, T, KV>},
  };
  const int dim = head_dim == 32 ? 0 : head_dim == 64 ? 1 : head_dim == 128 ? 2 : -1;
  return dim < 0 ? nullptr : by_dim[dim][G - 2];
}

template <typename T, typename KV>
void paged_attention(const T* qkv, KV* cache, const Step& s, T* out) {
  write_cache(qkv, cache, s);
  const int64_t C = s.heads * s.head_dim, width = row_width(s), group = s.heads / s.kv_heads;
  std::vector<int32_t> seq_of(size_t(s.tokens));
  for (int64_t q = 0; q < s.seqs; ++q)
    for (int32_t i = s.query_start[q]; i < s.query_start[q + 1]; ++i) seq_of[size_t(i)] = int32_t(q);
  const AttendFn<T, KV> attend = attend_for<T, KV>(s.head_dim, s.block_size);
  AttendFn<T, KV> heads_fn[5] = {};  // by G: the grouped path for G heads of one key/value head
  for (int64_t G = 2; G <= 4; ++G) heads_fn[G] = attend_heads_for<T, KV>(s.head_dim, s.block_size, G);
  // A task is a token and a span of its heads: all of them (the heads of a block sit side by side)
  // when there are tokens enough to keep every thread busy, one each otherwise.
  const int64_t span = s.tokens >= 2 * ThreadPool::instance().num_threads() ? s.heads : 1;
  const int64_t spans = s.heads / span;
  ThreadPool::instance().run(s.tokens * spans, [&](int64_t task) {
    thread_local std::vector<float> scores;
    const int64_t i = task / spans, first = task % spans * span;
    const int64_t q = seq_of[size_t(i)];
    const int64_t position = s.seq_lens[q] - (s.query_start[q + 1] - i);
    const int32_t* blocks = s.block_tables + int64_t(s.seq_rows[q]) * s.block_table_stride;
    for (int64_t head = first; head < first + span;) {
      // a span of whole groups: their heads together, in runs of up to 4 (5 as 3 + 2), else one at a time
      const int64_t left = std::min(group - head % group, first + span - head);
      const int64_t G = left == 5 ? 3 : std::min<int64_t>(left, 4);
      const AttendFn<T, KV> fn = span == s.heads ? heads_fn[G] : nullptr;
      (fn ? fn : attend)(qkv + i * width + head * s.head_dim, cache, blocks, position + 1, head / group, s, scores,
                         out + i * C + head * s.head_dim);
      head += fn ? G : 1;
    }
  });
}

}  // namespace
}  // namespace kv

extern "C" {

int kv_paged_attention(int dtype, int cache_dtype, const void* qkv, int64_t tokens, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, void* cache, int64_t block_size, const int64_t* slot_mapping, int64_t seqs,
                       const int32_t* query_start, const int32_t* seq_lens, const int32_t* block_tables,
                       int64_t block_table_stride, const int32_t* seq_rows, float scale, void* out) {
  using kv::bf16;
  const kv::Step s{tokens,      heads,    kv_heads,     head_dim,           block_size, slot_mapping, seqs,
                   query_start, seq_lens, block_tables, block_table_stride, seq_rows,   scale};
  if (kv::attend_for<float, float>(head_dim, block_size) == nullptr || block_size % 8 != 0) return -1;
  if (kv_heads <= 0 || heads % kv_heads != 0) return -1;
  if (dtype == KV_DTYPE_F32 && cache_dtype == KV_DTYPE_F32)
    kv::paged_attention(static_cast<const float*>(qkv), static_cast<float*>(cache), s, static_cast<float*>(out));
  else if (dtype == KV_DTYPE_F32 && cache_dtype == KV_DTYPE_BF16)
    kv::paged_attention(static_cast<const float*>(qkv), static_cast<bf16*>(cache), s, static_cast<float*>(out));
  else if (dtype == KV_DTYPE_BF16 && cache_dtype == KV_DTYPE_BF16)
    kv::paged_attention(static_cast<const bf16*>(qkv), static_cast<bf16*>(cache), s, static_cast<bf16*>(out));
  else if (cache_dtype == KV_DTYPE_I8 && block_size > kv::kMaxBlock)
    return -1;
  else if (dtype == KV_DTYPE_F32 && cache_dtype == KV_DTYPE_I8)
    kv::paged_attention(static_cast<const float*>(qkv), static_cast<int8_t*>(cache), s, static_cast<float*>(out));
  else if (dtype == KV_DTYPE_BF16 && cache_dtype == KV_DTYPE_I8)
    kv::paged_attention(static_cast<const bf16*>(qkv), static_cast<int8_t*>(cache), s, static_cast<bf16*>(out));
  else
    return -1;
  return 0;
}
}

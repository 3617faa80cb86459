// The greedy pick and the log-normalizer of each row of logits, in one pass over the row:
// the first index of the largest logit, and lse = m + log(sum(exp(x - m))) with the sum in
// fixed order (lane l adds x[j] for j = l, l + 8, ...; the tail through the same vector code,
// padded with -inf; then hsum8's tree). A row's results depend on that row alone. NaN or +inf
// anywhere, or no finite logit, makes lse non-finite: the caller fails that row's request.
//
// out (rows, >= 3) float64, rows out_stride apart, gets what the engine copies back per row: the token, its logprob
// (logit - lse, in float32 as torch computes it for a sampled row) and 1 if lse is finite.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "api.h"
#include "thread_pool.h"
#include "vec.h"

extern "C" {

void kv_greedy(const float* logits, int64_t rows, int64_t V, double* out, int64_t out_stride, float* lse) {
  kv::ThreadPool::instance().run(rows, [&](int64_t r) {
    const float* x = logits + r * V;
    float best = -INFINITY;
    int64_t at = 0;
    bool nan = false;
    for (int64_t j = 0; j < V; ++j) {  // scalar: the first maximum, exactly
      if (x[j] > best) best = x[j], at = j;
      nan |= std::isnan(x[j]);
    }
    out[out_stride * r] = double(at);
    if (nan || !std::isfinite(best)) {
      lse[r] = nan ? NAN : best;
      out[out_stride * r + 1] = 0.0;
      out[out_stride * r + 2] = 0.0;
      return;
    }
    const __m256 m = _mm256_set1_ps(best);
    const int64_t full = V / 8 * 8;
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 8) sum = _mm256_add_ps(sum, kv::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), m)));
    if (full < V) {
      alignas(32) float tail[8];
      for (int i = 0; i < 8; ++i) tail[i] = full + i < V ? x[full + i] : -INFINITY;
      sum = _mm256_add_ps(sum, kv::exp8(_mm256_sub_ps(_mm256_load_ps(tail), m)));
    }
    const float normalizer = best + std::log(kv::hsum8(sum));
    lse[r] = normalizer;
    out[out_stride * r + 1] = double(best - normalizer);
    out[out_stride * r + 2] = std::isfinite(normalizer) ? 1.0 : 0.0;
  });
}

// The first maximum among the allowed tokens, as torch's argmax of the row with the others set to -inf finds
// it (none allowed, or all -inf: index 0), and its logprob x - lse in float32, as torch subtracts.
void kv_greedy_masked(const float* logits, int64_t V, const int64_t* rows, int64_t n, const int32_t* bitmask,
                      int64_t words, double* out, int64_t out_stride, const float* lse) {
  kv::ThreadPool::instance().run(n, [&](int64_t i) {
    const int64_t r = rows[i];
    double* o = out + out_stride * r;
    if (o[2] == 0.0) return;  // a row with NaN or inf: its request fails, its pick means nothing
    const float* x = logits + r * V;
    const int32_t* allowed = bitmask + i * words;
    float best = -INFINITY;
    int64_t at = 0;
    for (int64_t w = 0; w * 32 < V; ++w) {
      uint32_t bits;
      std::memcpy(&bits, allowed + w, 4);
      while (bits != 0) {  // each allowed token of this word, in order
        const int64_t j = w * 32 + __builtin_ctz(bits);
        bits &= bits - 1;
        if (j >= V) break;
        if (x[j] > best) best = x[j], at = j;
      }
    }
    o[0] = double(at);
    o[1] = double(float(x[at] - lse[r]));
  });
}
}

// QK-norm and rotary position embedding, in place on the step's queries and keys (kv_rope): what the
// Llama-style decoders apply after the q/k/v product and before a key is written to the cache.
//
// Per token at position p and per head vector x of its row (its query heads, then its key heads; the
// values untouched), with h = head_dim / 2 and c[j] = T(rope[p][j]), s[j] = T(rope[p][h + j]), the float32
// table's cosine and sine of angle j cast to the activations' type T (nothing for float32, bfloat16
// rounding for a bfloat16 model, as transformers casts its tables):
//   QK-norm, where its weights are given: x = RMSNorm over head_dim (layer_norm.h, its reduction order)
//   y[j]     = T(T(x[j] * c[j]) - T(x[j + h] * s[j]))      for j < h: dims j and j + h rotate together
//   y[j + h] = T(T(x[j + h] * c[j]) + T(x[j] * s[j]))
// One product per term and no fused multiply-add, as torch's `x * cos + rotate_half(x) * sin`. Besides the
// norm's sum there is no reduction: a token's result depends on its row and its position alone.
#include <algorithm>
#include <vector>

#include "api.h"
#include "layer_norm.h"
#include "thread_pool.h"
#include "vec.h"

namespace kv {
namespace {

template <typename T>
inline __m256 lanes(const float* p, int n) {
  return as_activation<T>(n == 8 ? _mm256_loadu_ps(p) : load_partial(p, n));
}

template <typename T>
void rotate_head(T* x, int64_t hd, const float* cs, const float* norm, float eps, float* buf) {
  const int64_t h = hd / 2;
  if (norm != nullptr)
    rms_norm_row(x, hd, norm, eps, buf);
  else
    for (int64_t j = 0; j < hd; ++j) buf[j] = to_f32(x[j]);
  for (int64_t j = 0; j < h; j += 8) {
    const int n = int(std::min<int64_t>(8, h - j));
    const __m256 a = lanes<float>(buf + j, n), b = lanes<float>(buf + h + j, n);
    const __m256 c = lanes<T>(cs + j, n), s = lanes<T>(cs + h + j, n);
    const __m256 ac = as_activation<T>(_mm256_mul_ps(a, c)), bs = as_activation<T>(_mm256_mul_ps(b, s));
    const __m256 bc = as_activation<T>(_mm256_mul_ps(b, c)), as = as_activation<T>(_mm256_mul_ps(a, s));
    const __m256 lo = _mm256_sub_ps(ac, bs), hi = _mm256_add_ps(bc, as);
    if (n == 8) {
      store8(x + j, lo);
      store8(x + h + j, hi);
    } else {
      store_partial(x + j, lo, n);
      store_partial(x + h + j, hi, n);
    }
  }
}

template <typename T>
void rope(T* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t hd, const int64_t* positions,
          const float* table, const float* q_norm, const float* k_norm, float eps) {
  const int64_t width = (heads + 2 * kv_heads) * hd;
  constexpr int64_t kTokensPerTask = 8;
  ThreadPool::instance().run((tokens + kTokensPerTask - 1) / kTokensPerTask, [&](int64_t task) {
    thread_local std::vector<float> buf;
    if (buf.size() < size_t(hd)) buf.resize(size_t(hd));
    for (int64_t i = task * kTokensPerTask; i < std::min(tokens, (task + 1) * kTokensPerTask); ++i) {
      const float* cs = table + positions[i] * hd;
      T* row = qkv + i * width;
      for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * hd, hd, cs, q_norm, eps, buf.data());
      for (int64_t g = 0; g < kv_heads; ++g) rotate_head(row + (heads + g) * hd, hd, cs, k_norm, eps, buf.data());
    }
  });
}

}  // namespace
}  // namespace kv

extern "C" {

int kv_rope(int dtype, void* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
            const int64_t* positions, const float* rope, int64_t rope_positions, const float* q_norm,
            const float* k_norm, float eps) {
  if (head_dim <= 0 || head_dim % 2 != 0) return -1;
  for (int64_t i = 0; i < tokens; ++i)
    if (positions[i] < 0 || positions[i] >= rope_positions) return -1;
  if (dtype == KV_DTYPE_F32)
    kv::rope(static_cast<float*>(qkv), tokens, heads, kv_heads, head_dim, positions, rope, q_norm, k_norm, eps);
  else if (dtype == KV_DTYPE_BF16)
    kv::rope(static_cast<kv::bf16*>(qkv), tokens, heads, kv_heads, head_dim, positions, rope, q_norm, k_norm, eps);
  else
    return -1;
  return 0;
}
}

// The step's input rows: out[i] = wte[token_ids[i]] + wpe[positions[i]], one add per element
// (float32 arithmetic; bfloat16 rounded once), the same for every row; or out[i] = wte[token_ids[i]],
// copied, for a model without learned positions (wpe null: the Llama-style decoders).
#include <cstring>

#include "api.h"
#include "thread_pool.h"
#include "vec.h"

namespace kv {
namespace {

template <typename T>
void embed(const int64_t* ids, const int64_t* positions, int64_t n, const T* wte, const T* wpe, int64_t C, T* out) {
  ThreadPool::instance().run((n + 31) / 32, [&](int64_t task) {
    for (int64_t i = task * 32; i < std::min(n, task * 32 + 32); ++i) {
      if (wpe == nullptr) {
        std::memcpy(out + i * C, wte + ids[i] * C, size_t(C) * sizeof(T));
        continue;
      }
      const T* a = wte + ids[i] * C;
      const T* b = wpe + positions[i] * C;
      T* y = out + i * C;
      int64_t j = 0;
      for (; j + 8 <= C; j += 8) store8(y + j, _mm256_add_ps(load8(a + j), load8(b + j)));
      if (j < C)
        store_partial(y + j, _mm256_add_ps(load_partial(a + j, int(C - j)), load_partial(b + j, int(C - j))),
                      int(C - j));
    }
  });
}

}  // namespace
}  // namespace kv

extern "C" {

int kv_embed(int dtype, const int64_t* ids, const int64_t* positions, int64_t n, const void* wte, const void* wpe,
             int64_t C, void* out) {
  if (dtype == KV_DTYPE_F32)
    kv::embed(ids, positions, n, static_cast<const float*>(wte), static_cast<const float*>(wpe), C,
              static_cast<float*>(out));
  else if (dtype == KV_DTYPE_BF16)
    kv::embed(ids, positions, n, static_cast<const kv::bf16*>(wte), static_cast<const kv::bf16*>(wpe), C,
              static_cast<kv::bf16*>(out));
  else
    return -1;
  return 0;
}
}

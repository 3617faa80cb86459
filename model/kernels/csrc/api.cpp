// The pool's controls, and the version the Python loader checks the library against.
#include "api.h"

#include "linear_q8_amx.h"
#include "thread_pool.h"

extern "C" {

int kv_abi_version() { return KV_ABI_VERSION; }
void kv_set_num_threads(int n) { kv::ThreadPool::instance().set_num_threads(n < 1 ? 1 : n); }
int kv_num_threads() { return kv::ThreadPool::instance().num_threads(); }
void kv_set_spin_us(int64_t microseconds) { kv::ThreadPool::instance().set_spin_us(microseconds); }
int64_t kv_spin_us() { return kv::ThreadPool::instance().spin_us(); }

int64_t kv_features() {
  int64_t features = 0;
#ifdef __AVX512F__
  features |= KV_FEATURE_AVX512F;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  features |= KV_FEATURE_AVX512BF16;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  features |= KV_FEATURE_AVX512VNNI;
#endif
  if (kv::amx_int8_built_and_granted()) features |= KV_FEATURE_AMX_INT8;
  return features;
}
}

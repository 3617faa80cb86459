// The pool's controls, and the version the Python loader checks the library against.
#include "api.h"

#include "thread_pool.h"

extern "C" {

int kv_abi_version() { return KV_ABI_VERSION; }
void kv_set_num_threads(int n) { kv::ThreadPool::instance().set_num_threads(n < 1 ? 1 : n); }
int kv_num_threads() { return kv::ThreadPool::instance().num_threads(); }
void kv_set_spin_us(int64_t microseconds) { kv::ThreadPool::instance().set_spin_us(microseconds); }
int64_t kv_spin_us() { return kv::ThreadPool::instance().spin_us(); }
}

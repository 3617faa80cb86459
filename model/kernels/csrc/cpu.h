// Which instruction sets the kernels may use, asked per call: what the CPU has (cpuid, with the
// register state the OS saves, and the OS's grant of the AMX tiles), capped by kv_set_isa
// (KVSERVE_ISA). The library is compiled for x86-64-v3 (AVX2 and FMA); each wider path is compiled
// for its own instruction set with a target attribute below, so one build holds every path and a
// product picks one when it runs.
#pragma once

#include <cstdint>

#include "api.h"

#define KV_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define KV_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define KV_TARGET_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define KV_TARGET_AVX_VNNI __attribute__((target("avxvnni")))
#define KV_TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

namespace kv {

// KV_FEATURE_* bits of what the CPU has and the OS enables, asked once.
int64_t cpu_features();

// cpu_features() within the cap kv_set_isa set: what the kernels may use now.
int64_t allowed_features();

inline bool allowed(int64_t feature) { return (allowed_features() & feature) == feature; }

// The KV_PATH_* a product on weights of `format` (KV_WEIGHT_*) runs on now, or -1 where none may
// run them. int8 on AMX means AMX tiles from 4 rows on, the AVX512-VNNI tiles below.
int kernel_path(int64_t format);

}  // namespace kv

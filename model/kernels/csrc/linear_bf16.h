// The bfloat16 product through vdpbf16ps (linear_bf16.cpp), called by kv_linear for KV_WEIGHT_BF16_PAIRS.
#pragma once

#include "api.h"
#include "epilogue.h"

namespace kv {

// y = epilogue(bf16(norm(x)) @ W + b), float32 sums; -1 where AVX512-BF16 may not run
// (the CPU lacks it, or KVSERVE_ISA caps it off).
int linear_bf16(const kv_weight& w, const bf16* x, int64_t rows, bf16* y, int epilogue, const bf16* residual,
                const Norm& norm);
int linear_bf16(const kv_weight& w, const bf16* x, int64_t rows, float* y, int epilogue, const float* residual,
                const Norm& norm);

}  // namespace kv

// The int8-weight product (linear_q8.cpp), called by kv_linear for KV_WEIGHT_INT8.
#pragma once

#include "api.h"
#include "epilogue.h"

namespace kv {

// y = epilogue(dequantize(quantize(norm(x)) @ Wq) + b); -1 where this build has no VNNI.
int linear_q8(const kv_weight& w, const float* x, int64_t rows, float* y, int epilogue, const float* residual,
              const Norm& norm);

}  // namespace kv

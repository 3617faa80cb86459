// The int8-weight product on AMX tiles (linear_q8_amx.cpp), for batches big enough to fill them.
#pragma once

#include <cstdint>

#include "api.h"
#include "epilogue.h"

namespace kv {

// Whether this process may use AMX int8 tiles: the build has them, the CPU has them, the kernel
// granted the tile state (asked once), and kv_set_amx has not turned them off.
bool amx_int8_ready();
bool amx_int8_built_and_granted();

// The products of linear_q8 for rows already quantized: q (rows rounded up to 16, Kp) unsigned
// bytes, sx (rows,) their scales; the same float sequence per output element as the VNNI tiles,
// since int32 sums are exact in any order. Needs Kp % 64 == 0.
void linear_q8_amx(const kv_weight& w, const uint8_t* q, const float* sx, int64_t rows, int64_t Kp,
                   const Output<float>& out);

}  // namespace kv

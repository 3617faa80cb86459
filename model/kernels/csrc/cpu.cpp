// The CPU's instruction sets (cpuid leaves 1 and 7, XCR0 for the registers the OS saves, and the
// AMX tile state asked of Linux with arch_prctl), the cap on them (KV_ISA_*), and the path each
// weight format takes under it.
#include "cpu.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace kv {
namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureTileData = 18;      // the AMX tile data

constexpr uint64_t kXcr0Avx = 0x6;           // xmm and ymm state
constexpr uint64_t kXcr0Avx512 = 0xe6;       // and opmask, zmm0-15 upper halves, zmm16-31
constexpr uint64_t kXcr0Amx = 0x3ull << 17;  // tile config and tile data

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return uint64_t(hi) << 32 | lo;
}

inline bool bit(unsigned reg, int n) { return (reg >> n) & 1u; }

int64_t detect() {
  unsigned a, b, c, d;
  if (__get_cpuid_max(0, nullptr) < 7 || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const bool fma = bit(c, 12), osxsave = bit(c, 27), avx = bit(c, 28);
  if (!osxsave || !avx) return 0;
  const uint64_t xcr = xcr0();
  if ((xcr & kXcr0Avx) != kXcr0Avx) return 0;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned leaf7_subleaves = a, b7 = b, c7 = c, d7 = d;
  unsigned a71 = 0;
  if (leaf7_subleaves >= 1) __cpuid_count(7, 1, a71, b, c, d);
  int64_t features = 0;
  if (bit(b7, 5) && fma) features |= KV_FEATURE_AVX2;
  if (!(features & KV_FEATURE_AVX2)) return 0;
  if (bit(a71, 4)) features |= KV_FEATURE_AVX_VNNI;
  // AVX-512 F, DQ, BW and VL: what every AVX-512 CPU since Skylake-SP has, and what the paths use
  const bool avx512 = bit(b7, 16) && bit(b7, 17) && bit(b7, 30) && bit(b7, 31);
  if (!avx512 || (xcr & kXcr0Avx512) != kXcr0Avx512) return features;
  features |= KV_FEATURE_AVX512F;
  if (bit(a71, 5)) features |= KV_FEATURE_AVX512BF16;
  if (bit(c7, 11)) features |= KV_FEATURE_AVX512VNNI;
  // AMX int8 tiles, used with AVX512-VNNI for the batches too small to fill them
  const bool amx = bit(d7, 24) && bit(d7, 25) && (features & KV_FEATURE_AVX512VNNI);
  if (amx && (xcr & kXcr0Amx) == kXcr0Amx && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0)
    features |= KV_FEATURE_AMX_INT8;
  return features;
}

// What each level lets the kernels use, and the feature that names it (a CPU without it lacks the level).
constexpr int64_t kLevelMask[] = {
    KV_FEATURE_AVX2,
    KV_FEATURE_AVX2 | KV_FEATURE_AVX_VNNI,
    KV_FEATURE_AVX2 | KV_FEATURE_AVX_VNNI | KV_FEATURE_AVX512F,
    KV_FEATURE_AVX2 | KV_FEATURE_AVX_VNNI | KV_FEATURE_AVX512F | KV_FEATURE_AVX512VNNI | KV_FEATURE_AVX512BF16,
    KV_FEATURE_AVX2 | KV_FEATURE_AVX_VNNI | KV_FEATURE_AVX512F | KV_FEATURE_AVX512VNNI | KV_FEATURE_AVX512BF16 |
        KV_FEATURE_AMX_INT8,
};
constexpr int64_t kLevelFeature[] = {KV_FEATURE_AVX2, KV_FEATURE_AVX_VNNI, KV_FEATURE_AVX512F, KV_FEATURE_AVX512VNNI,
                                     KV_FEATURE_AMX_INT8};

std::atomic<int> isa_cap{KV_ISA_AMX};

}  // namespace

int64_t cpu_features() {
  static const int64_t features = detect();
  return features;
}

int64_t allowed_features() { return cpu_features() & kLevelMask[isa_cap.load(std::memory_order_relaxed)]; }

int kernel_path(int64_t format) {
  switch (format) {
    case KV_WEIGHT_F32:
    case KV_WEIGHT_BF16:
      return allowed(KV_FEATURE_AVX512F) ? KV_PATH_AVX512 : KV_PATH_AVX2;
    case KV_WEIGHT_BF16_PAIRS:
      return allowed(KV_FEATURE_AVX512BF16) ? KV_PATH_AVX512_BF16 : -1;
    case KV_WEIGHT_INT8:
      if (allowed(KV_FEATURE_AMX_INT8)) return KV_PATH_AMX;
      if (allowed(KV_FEATURE_AVX512VNNI)) return KV_PATH_AVX512_VNNI;
      return allowed(KV_FEATURE_AVX_VNNI) ? KV_PATH_AVX_VNNI : KV_PATH_AVX2;
    default:
      return -1;
  }
}

}  // namespace kv

extern "C" {

int64_t kv_cpu_features() { return kv::cpu_features(); }
int64_t kv_features() { return kv::allowed_features(); }

int kv_cpu_has_isa(int level) {
  return level >= KV_ISA_AVX2 && level <= KV_ISA_AMX && (kv::cpu_features() & kv::kLevelFeature[level]) ? 1 : 0;
}

int kv_set_isa(int level) {
  if (!kv_cpu_has_isa(level)) return -1;
  kv::isa_cap.store(level, std::memory_order_relaxed);
  return 0;
}

int kv_isa() {
  int level = kv::isa_cap.load(std::memory_order_relaxed);
  while (level > KV_ISA_AVX2 && !kv_cpu_has_isa(level)) --level;
  return level;
}

int kv_kernel_path(int format) { return kv::kernel_path(format); }
}

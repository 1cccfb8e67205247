// Run-time CPU feature checks of the C++ CPU kernels: their AVX2 paths are compiled with
// `__attribute__((target("avx2,fma")))` and chosen here, so one build serves any x86-64 CPU.
#pragma once

namespace pagedjax {

inline bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

}  // namespace pagedjax

// Run-time CPU feature checks of the C++ CPU kernels: their AVX2 (and AVX-512) paths are compiled
// with `__attribute__((target("avx2,fma")))` (`"avx512f"`) and chosen here, so one build serves
// any x86-64 CPU.
#pragma once

#include <cstdlib>

namespace pagedjax {

// PAGEDJAX_NO_AVX2=1 in the environment (read once) keeps every kernel on its portable path, as
// on a CPU without AVX2 (or not x86), to test that path on any machine.
inline bool cpu_simd_allowed() {
  static const bool allowed = !std::getenv("PAGEDJAX_NO_AVX2");
  return allowed;
}

inline bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  static const bool has = cpu_simd_allowed() && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// AVX2 with F16C (every AVX2 CPU has it): the quantized kernels' fp16 scales.
inline bool cpu_has_avx2_f16c() {
#if defined(__x86_64__)
  static const bool has = cpu_simd_allowed() && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

// PAGEDJAX_NO_AVX512=1 in the environment (read once) keeps the AVX2 paths, to compare them.
inline bool cpu_has_avx512f() {
#if defined(__x86_64__)
  static const bool has = cpu_simd_allowed() && __builtin_cpu_supports("avx512f") &&
                          !std::getenv("PAGEDJAX_NO_AVX512");
  return has;
#else
  return false;
#endif
}

// AVX-512 VNNI on 256-bit registers (AVX512VL): the quantized kernels' dpbusd, the same integers
// as AVX2's maddubs + madd in fewer instructions; off with PAGEDJAX_NO_AVX512=1 as well.
inline bool cpu_has_avx512_vnni() {
#if defined(__x86_64__)
  static const bool has = cpu_has_avx512f() && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vl") && cpu_has_avx2_f16c();
  return has;
#else
  return false;
#endif
}

}  // namespace pagedjax

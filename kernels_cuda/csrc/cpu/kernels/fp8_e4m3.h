// float8 e4m3 ("fn": no infinities, 0x7F / 0xFF are NaN, largest finite 448) as the FP8 KV cache
// stores it (kv_cache_dtype="fp8", vLLM's semantics): a cached key is k / k_scale rounded to
// nearest even, saturated to +-448; attention reads code_value * k_scale. Framework-free: the
// torch ops see torch.float8_e4m3fn caches as these bytes, the XLA FFI handlers
// jnp.float8_e4m3fn buffers.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace pagedjax::fp8 {

// One cached element's byte; a distinct type so templates tell an fp8 cache from a uint8 one.
struct E4M3 {
  uint8_t bits;
};
static_assert(sizeof(E4M3) == 1, "an fp8 cache element is one byte");

constexpr float kMax = 448.f;  // the largest finite e4m3 value

// The value of each of the 256 codes (exact in float32).
inline std::array<float, 256> make_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 15, mantissa = code & 7;
    float value;
    if (exponent == 15 && mantissa == 7) {
      value = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      value = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-9
    } else {
      value = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // 1.m * 2^(e-7)
    }
    table[code] = (code & 0x80) ? -value : value;
  }
  return table;
}

// The table, built once; take a reference outside hot loops (a function-local static).
inline const float* table() {
  static const std::array<float, 256> values = make_table();
  return values.data();
}

inline float to_float(E4M3 x) { return table()[x.bits]; }

// x rounded to the nearest e4m3 value (ties to even), saturated to +-448; NaN stays NaN.
inline E4M3 from_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return {static_cast<uint8_t>(sign | 0x7F)};   // NaN
  if (magnitude >= 0x43E00000u) return {static_cast<uint8_t>(sign | 0x7E)};  // >= 448, inf
  if (magnitude < 0x3C800000u) {  // below 2^-6: subnormal codes m * 2^-9, m in [0, 8]
    float value;
    std::memcpy(&value, &magnitude, sizeof(value));
    // value * 512 is exact; nearbyint rounds ties to even (the default rounding mode); 8 is the
    // code of 2^-6, the smallest normal
    return {static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(value * 512.f)))};
  }
  // normal: keep 3 of the 23 mantissa bits, ties to even; a carry moves into the exponent
  const uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
  uint32_t code = (rounded >> 20) - (120u << 3);  // rebias the exponent: 127 → 7
  if (code > 0x7Eu) code = 0x7Eu;                  // [448, 464) rounds to 448 anyway
  return {static_cast<uint8_t>(sign | code)};
}

template <typename T>
constexpr bool is_fp8 = std::is_same_v<T, E4M3>;

// dst[i] = src[i] as the cache stores it: src / scale in fp8, else src cast to cache_t (scale 1).
template <typename cache_t, typename src_t>
void store_row(const src_t* src, cache_t* dst, int64_t n, float scale) {
  if constexpr (is_fp8<cache_t>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float(static_cast<float>(src[i]) / scale);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<cache_t>(src[i]);
  }
}

// dst[i] = src[i] * scale as acc_t (a cached fp8 tile as attention reads it).
template <typename acc_t>
void load_row(const E4M3* src, acc_t* dst, int64_t n, acc_t scale) {
  const float* values = table();
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(values[src[i].bits]) * scale;
}

}  // namespace pagedjax::fp8

// bfloat16 <-> float32 for the cpu backend's C++ kernels (gemv.cpp,
// int8_gemv.cpp): bf16 is the high half of a float32; rounding to bf16 is to
// nearest even, as torch rounds. Hashed into the library's cache key with
// the .cpp sources (cpu_kernels/__init__.py _SOURCES).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace vllm_br_bf16 {

inline float to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, like torch
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace vllm_br_bf16

// The sampler's random numbers: a counter-based hash, so that the CPU and CUDA backends draw the
// same uniform for the same (seed, step) and a captured graph needs only a device step counter.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define OCRIA_RT_HOST_DEVICE __host__ __device__
#else
#define OCRIA_RT_HOST_DEVICE
#endif

namespace ocria_rt {

// splitmix64 finaliser (Steele, Lea, Flood 2014).
OCRIA_RT_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 random bits.
OCRIA_RT_HOST_DEVICE inline float uniform_hash(uint64_t seed, uint64_t counter) {
  return float(splitmix64(seed ^ splitmix64(counter)) >> 40) * (1.0f / 16777216.0f);
}

}  // namespace ocria_rt

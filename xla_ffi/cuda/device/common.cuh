// What every kernel uses: K blocks, shared-memory addresses and the stage layout of core matrices, fast
// division by launch-time divisors.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"

namespace jaxbnn::cuda {

constexpr int kKBlockWords = 32;  // one pipeline stage covers 1024 bits of K
constexpr int kRowGroupBytes = 1024;  // 8 rows x 128 bytes

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A divisor d >= 1 fixed at launch, for Quotient (n / d by a multiply-high and a shift: the round-up method
// of Granlund and Montgomery, magic = ceil(2^(31 + l) / d), l = ceil(log2 d), exact for 0 <= n < 2^31)
// instead of a ~20-instruction integer division. Built on the host; kernels take it as a parameter, so
// the magic number is a constant-bank operand.
struct FastDivisor {
  int divisor = 1;
  uint32_t magic = 0, shift = 0;
  FastDivisor() = default;
  explicit FastDivisor(int d) : divisor(d > 1 ? d : 1) {
    if (divisor == 1) return;
    int log2_ceil = 0;
    while ((1ll << log2_ceil) < divisor) ++log2_ceil;
    magic = static_cast<uint32_t>(((1ull << (31 + log2_ceil)) + divisor - 1) / divisor);
    shift = static_cast<uint32_t>(log2_ceil - 1);
  }
};
__host__ __device__ __forceinline__ int Quotient(int n, const FastDivisor& d) {
#ifdef __CUDA_ARCH__
  const uint32_t high = __umulhi(static_cast<uint32_t>(n), d.magic);
#else
  const uint32_t high = static_cast<uint32_t>(uint64_t{static_cast<uint32_t>(n)} * d.magic >> 32);
#endif
  return d.divisor == 1 ? n : static_cast<int>(high >> d.shift);
}

// The divisors of a problem that the loaders use once per K block, built once per launch (DivisorsOf).
struct LaunchDivisors {
  FastDivisor cw, kw, tap_bytes, image_pixels, out_w;
};

__device__ __forceinline__ uint32_t StageOffset(int row, int chunk) {
  return (row / 8) * kRowGroupBytes + chunk * 128 + (row % 8) * 16;
}

}  // namespace jaxbnn::cuda

// Global pooling of the integer residual stream into threshold planes' bits (ops.global_sum_bits) on the CPU.
#ifndef JAXBNN_XLA_FFI_CPU_POOL_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_POOL_KERNELS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {

// bits[b, p, c / 32] bit c % 32: sum over pixels i of stream[b, i, c] in int32 (wrapping) >= threshold[p, c], or
// <= where flip[p, c]; padding bits 0.
struct GlobalSumProblem {
  const void* stream = nullptr;  // (batch, pixels, channels): int16 where narrow, else int32
  bool narrow = false;
  const int32_t* threshold = nullptr;  // (planes, channels)
  const uint8_t* flip = nullptr;       // (planes, channels)
  uint32_t* bits = nullptr;            // (batch, planes, ceil(channels / 32))
  int64_t batch = 0, pixels = 0, channels = 0, planes = 0;
};

// Runs the pooling, images split over the pool's threads where there is enough work.
void RunGlobalSumBits(const GlobalSumProblem& problem, xla::ffi::ThreadPool* pool);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_POOL_KERNELS_H_

// Global pooling of the integer residual stream into the next layer's bits (ops.global_sum_bits), outside the
// binary engine: per image and channel the int32 sum of the stream over the image's pixels, compared with each
// threshold plane. docs/ops.md states the contract.
#ifndef JAXBNN_XLA_FFI_CUDA_GLOBAL_POOL_H_
#define JAXBNN_XLA_FFI_CUDA_GLOBAL_POOL_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxbnn::cuda {

// sum[b, c] = the sum over pixels i of stream[b, i, c] in int32, wrapping as XLA's int32 sum does; bit c of plane
// p of image b: sum[b, c] >= threshold[p, c] (sum[b, c] <= threshold[p, c] where flip[p, c]), padding bits 0.
struct GlobalSumProblem {
  const void* stream = nullptr;        // (batch, pixels, channels): int16 where narrow, else int32
  const int32_t* threshold = nullptr;  // (planes, channels)
  const uint8_t* flip = nullptr;       // (planes, channels)
  uint32_t* out_bits = nullptr;        // (batch, planes, ceil(channels / 32))
  int batch = 0, pixels = 0, channels = 0, planes = 0;
  bool narrow = false;
};

inline constexpr int kMaxGlobalSumPlanes = 8;

// Launches the pooling on `stream` (nothing for an empty batch); returns the launch error, if any. The handler
// has checked the extents: batch * ceil(channels / 32) items within int32, batch * pixels * channels within
// int64.
cudaError_t LaunchGlobalSumBits(const GlobalSumProblem& problem, cudaStream_t stream);

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_GLOBAL_POOL_H_

// The residual stream's threshold planes, pixel by pixel (a ternary conv1's two planes of an int32 stream, more
// than two planes; and LaunchBinaryGemm's pass after a residual kernel whose epilogue writes one plane): outside
// the binary engine, like global pooling.
#ifndef JAXBNN_XLA_FFI_CUDA_STREAM_BITS_H_
#define JAXBNN_XLA_FFI_CUDA_STREAM_BITS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxbnn::cuda {

// Bit c of plane p of row r: stream[r, c] >= threshold[p, c] (stream[r, c] <= threshold[p, c] where flip[p, c]),
// compared as int32; padding bits 0.
struct StreamBitsProblem {
  const void* stream = nullptr;        // (rows, channels): int16 where narrow, else int32
  const int32_t* threshold = nullptr;  // (planes, channels)
  const uint8_t* flip = nullptr;       // (planes, channels)
  uint32_t* out_bits = nullptr;        // (rows, planes, ceil(channels / 32))
  long long rows = 0;
  int channels = 0, planes = 0;
  bool narrow = false;
};

inline constexpr int kMaxStreamBitsPlanes = 8;

// Launches the thresholds on `stream` (nothing for no rows); returns the launch error, if any. The handler has
// checked the extents: rows * channels within int64, channels within int32.
cudaError_t LaunchStreamBits(const StreamBitsProblem& problem, cudaStream_t stream);

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_STREAM_BITS_H_

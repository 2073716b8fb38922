// The first layer of a network on the CUDA engine (ops.image_conv2d / image_matmul): int8 image levels times
// int8 weights on the integer tensor cores, with the max-pool and the next layer's threshold bits (or the
// integer residual stream) written from the epilogue. docs/ops.md states the contract.
#ifndef JAXBNN_XLA_FFI_CUDA_IMAGE_CONV_H_
#define JAXBNN_XLA_FFI_CUDA_IMAGE_CONV_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxbnn::cuda {

// pre[b, oy, ox, n] = sum over taps (i, j) and channels c of levels[b, oy * stride_h + i - pad_top,
// ox * stride_w + j - pad_left, c] * kernel[i, j, c, n], out-of-frame taps adding 0 (level 0, pixel 128);
// max-pooled over (pool_h, pool_w) windows (window = stride, floor); then v = pre >> shift, narrowed to int16 (its
// low 16 bits, as a two's-complement cast) where narrow_stream (shift and narrow_stream with out_stream only: the
// launcher refuses them without it). Outputs, at least one of them:
// - out_stream: v, int32 or int16 (pooled pixels, n), the residual stream;
// - out_bits: uint32 (pooled pixels, planes, ceil(n / 32)), bit n of plane p being v >= threshold[p, n]
//   (v <= threshold[p, n] where flip[p, n]), padding bits 0.
struct ImageConvProblem {
  const int8_t* levels = nullptr;     // (batch, in_h, in_w, c): int8 levels, or uint8 pixels where `pixels`
  const int8_t* kernel = nullptr;     // (kh, kw, c, n), HWIO
  const int32_t* threshold = nullptr; // (planes, n)
  const uint8_t* flip = nullptr;      // (planes, n)
  void* out_stream = nullptr;         // nullptr: no stream output
  uint32_t* out_bits = nullptr;       // nullptr (planes == 0): no threshold planes
  int batch = 0, in_h = 0, in_w = 0, c = 0, n = 0;
  int kh = 1, kw = 1, stride_h = 1, stride_w = 1, pad_top = 0, pad_left = 0;
  int pool_h = 1, pool_w = 1;
  int out_h = 0, out_w = 0;  // pooled
  int planes = 0;
  int shift = 0;
  bool narrow_stream = false;
  // `levels` holds the uint8 pixels p as they are stored; the kernels read each byte's level p - 128 (the byte
  // XOR 0x80), so that no pass over the image converts them first. Out-of-frame taps stay level 0 (pixel 128).
  bool pixels = false;
};

// What the kernels XOR into each word they read of `levels`: 0x80 in every byte where they are pixels.
inline constexpr uint32_t kPixelLevelFlip = 0x80808080u;

// The rows of one tile of the kernel: a pool window must fit in them.
inline constexpr int kMaxImagePoolWindow = 128;
inline constexpr int kMaxImagePlanes = 8;
// Output-channel tiles per launch (the grid's y extent).
inline constexpr int kMaxImageColumnTiles = 65535;
inline constexpr int kImageTileColumns = 64;

// Launches the first layer on `stream` (nothing for an empty problem): the direct kernel where it takes the problem
// (threshold planes of at most 32 channels from at most 12 products), else the windowed kernel where it does, the
// GEMM form where it does (ImageGemmTakes: on an sm_90 device the wgmma kernel, kernels/image_wgmma.h, where it
// takes the problem, else the mma.sync one), else the im2col kernel; returns the launch error, if any.
cudaError_t LaunchImageConv(const ImageConvProblem& problem, cudaStream_t stream);

// Whether `problem` has the GEMM form: a 1 x 1 kernel at stride 1, no padding or pool, C and N multiples of 16,
// levels and weights 16-byte aligned (a dense first layer: output rows are the levels' rows).
bool ImageGemmTakes(const ImageConvProblem& problem);

// The GEMM form on mma.sync (sm_80+), for a problem ImageGemmTakes; LaunchImageConv's choice where the wgmma kernel
// does not take it.
cudaError_t LaunchImageGemm(const ImageConvProblem& problem, cudaStream_t stream);

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_IMAGE_CONV_H_

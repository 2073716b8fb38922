// The direct first-layer kernel (kernels/image_direct.cu): small first layers on the CUDA cores. LaunchImageConv
// takes it for the problems it covers, ahead of the windowed kernel.
#ifndef JAXBNN_XLA_FFI_CUDA_KERNELS_IMAGE_DIRECT_H_
#define JAXBNN_XLA_FFI_CUDA_KERNELS_IMAGE_DIRECT_H_

#include <cuda_runtime_api.h>

#include "cuda/image_conv.h"

namespace jaxbnn::cuda {

// The most products a pre-activation of the direct kernel sums (kh * kw * C) and the most output channels it
// writes.
inline constexpr int kMaxDirectProducts = 12;
inline constexpr int kMaxDirectChannels = 32;

// Whether the direct kernel computes `p`: threshold planes only (no stream, shift 0), at most kMaxDirectProducts
// products and kMaxDirectChannels channels, the padded frame, the fields' reach and a tap's offset from its
// receptive field's first pixel within int32.
bool ImageDirectTakes(const ImageConvProblem& p);

// Launches it on `stream` (`p` taken); returns the launch error, if any.
cudaError_t LaunchImageDirect(const ImageConvProblem& p, cudaStream_t stream);

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_KERNELS_IMAGE_DIRECT_H_

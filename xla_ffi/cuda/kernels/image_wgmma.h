// The first layer's GEMM form on Hopper's integer wgmma (ImageWgmmaKernel): which problems it takes and its launcher,
// for LaunchImageConv.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/image_conv.h"

namespace jaxbnn::cuda {

// The longest reduction the kernel takes: a 128-column tile's weights of K bytes stay in shared memory whole.
inline constexpr int kMaxImageWgmmaK = 1248;

// Whether the wgmma kernel takes `p`: a GEMM-form problem (ImageGemmTakes) of K <= kMaxImageWgmmaK on an sm_90
// device whose driver encodes TMA tensor maps.
bool ImageWgmmaTakes(const ImageConvProblem& p);

// Launches it on `stream`; the caller has checked ImageWgmmaTakes.
cudaError_t LaunchImageWgmma(const ImageConvProblem& p, cudaStream_t stream);

}  // namespace jaxbnn::cuda

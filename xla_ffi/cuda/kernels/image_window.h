// The windowed first-layer kernel (kernels/image_window.cu): images of at most four channels, convolved from a
// window of the frame held in shared memory. LaunchImageConv takes it for the problems it covers.
#ifndef JAXBNN_XLA_FFI_CUDA_KERNELS_IMAGE_WINDOW_H_
#define JAXBNN_XLA_FFI_CUDA_KERNELS_IMAGE_WINDOW_H_

#include <cuda_runtime_api.h>

#include "cuda/image_conv.h"

namespace jaxbnn::cuda {

// Whether the windowed kernel computes `p`: 1 to 4 channels, no pool or a 2 x 2 one, a kernel of at most 256
// four-byte slots (kh * ceil(kw * C' / 4), C' the channels rounded up to 1, 2 or 4), a frame window that fits
// its shared memory and a CTA's shared memory within the current device's, an output at least a third of a tile
// wide and tall, 4-byte aligned levels of at most 2^31 - 33 bytes.
bool ImageWindowTakes(const ImageConvProblem& p);

// Launches it on `stream` (`p` non-empty and taken); returns the launch error, if any.
cudaError_t LaunchImageWindow(const ImageConvProblem& p, cudaStream_t stream);

// CTAs an SM holds of a kernel instance with `smem` bytes, on `device` (cached: the occupancy query was
// measurable in a launcher's host time at batch 1).
int CtasPerSm(const void* kernel, int threads, int smem, int device);

}  // namespace jaxbnn::cuda

#endif  // JAXBNN_XLA_FFI_CUDA_KERNELS_IMAGE_WINDOW_H_

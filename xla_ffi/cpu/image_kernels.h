// CPU first layer: int8 image levels times an int8 HWIO kernel, exact in int32, with the fused max-pool and
// the int32 (shift) or threshold-bits epilogue of docs/ops.md.
#ifndef JAXBNN_XLA_FFI_CPU_IMAGE_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_IMAGE_KERNELS_H_

#include <cstdint>

#include "cpu/image_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {

// levels: int8 (batch, height, width, c); kernel: int8 (kh, kw, c, n). threshold: int32 (planes, n) and flip:
// uint8 (planes, n) for the bits output, null for the int32 one. Output: int32 (batch, out_h, out_w, n) or
// uint32 (batch, out_h, out_w, planes, ceil(n/32)).
void RunImageConv2d(const ImageConv2dProblem& problem, const int8_t* levels, const int8_t* kernel,
                    const int32_t* threshold, const uint8_t* flip, void* out, ffi::ThreadPool* pool);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_IMAGE_KERNELS_H_

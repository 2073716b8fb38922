// CPU first layer: int8 image levels times an int8 HWIO kernel, exact in int32, with the fused max-pool and
// the int32 (shift) or threshold-bits epilogue of docs/ops.md.
#ifndef JAXBNN_XLA_FFI_CPU_IMAGE_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_IMAGE_KERNELS_H_

#include <cstdint>

#include "cpu/image_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {

// The outputs of a call, each null where not written: the stream (batch, out_h, out_w, n), int32 or, where the
// problem is narrow, int16; the bits uint32 (batch, out_h, out_w, planes, ceil(n/32)).
struct ImageOutputs {
  void* stream = nullptr;
  uint32_t* bits = nullptr;
};

// A kernel of -1, 0 and +1 as its sign masks (`formats.image_kernel_masks`), which the AVX-512 VNNI tier reads
// instead of the kernel in a call of few gathered rows: per reduction quad g (ceil(kh kw c / 4) of them) `words`
// = ceil(n / 16) 64-bit words, each two uint32 (low, high), bit 4 (col % 16) + e of word col / 16 set where
// the weight (4 g + e, col) is +1 (`plus`) / -1 (`minus`, null for a binary kernel: every weight +1 or -1);
// plus_count / minus_count: per column the number of +1 / -1 weights. `plus` null: no masks.
struct ImageKernelMasks {
  const uint32_t* plus = nullptr;
  const uint32_t* minus = nullptr;
  const int32_t* plus_count = nullptr;
  const int32_t* minus_count = nullptr;
  int64_t words = 0;
};

// levels: int8 (batch, height, width, c); kernel: int8 (kh, kw, c, n); masks: the kernel's, or none.
// threshold: int32 (planes, n) and flip: uint8 (planes, n) for the bits output, null without one.
void RunImageConv2d(const ImageConv2dProblem& problem, const int8_t* levels, const int8_t* kernel,
                    const ImageKernelMasks& masks, const int32_t* threshold, const uint8_t* flip,
                    const ImageOutputs& out, ffi::ThreadPool* pool);

// Whether this CPU has AMX-INT8 and the OS grants this process its tile state (asked once, at the first call).
bool AmxUsable();
// Whether the AVX-512 tier runs calls of enough rows on the AMX tiles (by default where AmxUsable).
bool FirstLayerUsesAmx();
// Turns that on or off (for tests and benchmarks that compare the tiers); false (nothing changed) when
// turning it on where AMX is not usable.
bool SetFirstLayerAmx(bool enabled);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_IMAGE_KERNELS_H_

// CPU bmm and direct bconv2d on packed bits (docs/formats.md), with fused epilogues and max-pool.
#ifndef JAXBNN_XLA_FFI_CPU_BIT_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_BIT_KERNELS_H_

#include <cstdint>

#include "common/checks.h"
#include "cpu/popcount_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {

// Output: int32 or float32 (rows, n), or packed uint32 (rows, ceil(n/32)) for the threshold epilogue.
void RunBmm(const BmmProblem& problem, const uint32_t* a, const uint32_t* b_tiles, const EpilogueData& epilogue,
            void* out, ffi::ThreadPool* pool);

// w_tap_popcount: int32 (kh * kw, o), the "zero" padding correction (docs/formats.md).
void RunBconv2d(const Bconv2dProblem& problem, const uint32_t* x, const uint32_t* w_tiles,
                const int32_t* w_tap_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_BIT_KERNELS_H_

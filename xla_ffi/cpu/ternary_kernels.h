// CPU ternary and mixed bmm / conv2d (TNN, TBN, BTN) on packed bit planes, with fused epilogues and max-pool,
// on the implicit GEMM driver of the binary kernels (gemm_driver.h) and the kernels of ternary_dots.h.
#ifndef JAXBNN_XLA_FFI_CPU_TERNARY_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_TERNARY_KERNELS_H_

#include <cstdint>

#include "common/checks.h"
#include "cpu/epilogue.h"
#include "cpu/ternary_dots.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {

// The activations, rows (or pixels) of the binary kernels' layout: ternary ones (TNN, TBN) with both packed
// planes of a row side by side (its nonneg words, then its pos words: a two-plane threshold epilogue's output),
// binary ones (BTN) as their bits.
struct ActivationPlanes {
  const uint32_t* words;
};

// Weights: FSB tiles of ternary weights (TNN, BTN) as 2 * n rows, the nonneg plane's then the pos plane's;
// of binary weights (TBN) as n rows. BTN's `popcount`: the 2 * n row popcounts (real bits); null otherwise.
// Output: int32 or float32 (rows, n), or packed uint32 (rows, ceil(n/32)) for the threshold epilogue.
void RunMixedBmm(Mix mix, const BmmProblem& problem, const ActivationPlanes& a, const uint32_t* w_tiles,
                 const int32_t* w_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool);

// As RunMixedBmm, the convolution's weights of problem.o output channels; BTN's `tap_popcount`:
// (kh * kw, 2 * o).
void RunMixedConv2d(Mix mix, const Bconv2dProblem& problem, const ActivationPlanes& x, const uint32_t* w_tiles,
                    const int32_t* w_tap_popcount, const EpilogueData& epilogue, void* out, ffi::ThreadPool* pool);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_TERNARY_KERNELS_H_

// The dense-tap kernel (DenseTapKernel): what the planner needs of it.
#pragma once

#include "cuda/binary_gemm.h"
#include "cuda/device/common.cuh"
#include "cuda/device/mma_sync_engine.cuh"
#include "cuda/kernels/classic.h"

namespace jaxbnn::cuda {

// Dense taps: convolutions of at most 32 channels, one channel word a tap. Below 32 channels (a binarized
// image's first layer) a tap's C real bits fill one word, so the word layout's reduction is 32 / C times the
// real one (7x7 at C = 3: 49 words for 147 bits, 7 k256 steps, 49 four-byte copies a row). The dense-tap
// kernel instead gathers every row's and every column's real bits, tap after tap, into ceil(kh kw C / 32)
// words of one K block. Dot products, row and column popcounts and the padding corrections are those of the
// same bits in another order, and an out-of-frame tap gathers as zeros, as the word layout's zero fill. At
// C = 32 the gather is the word layout itself; the kernel still runs it, since the word-layout kernels take
// such a layer by 4-byte copies into one-tile CTAs (MNIST conv's 64C3 at 28 x 28 x 32: their set-up was most
// of each tile's time).
inline bool UsesDenseTaps(const BinaryGemmProblem& p) {
  return p.cw == 1 && p.kh * p.kw > 1 && p.kh * p.kw * p.c <= kKBlockWords * 32;
}

// The dense-tap kernel's shared memory: ClassicKernel's regions (two stages, origins, popc_a, the columns,
// the row classes), the gathered K block in stage 1 (A rows, then the column tile's weights, which stay
// there over all of a CTA's tiles), the epilogue's scratch from byte 0 (over stage 0 and A, which are free by
// then), and in place of the barriers the border prefix sums of DenseBorderRowBounds (int16: every sum is
// within +-kh kw C <= +-1024), (kh + 1) (kw + 1) <= kPrefixCorners a column: filters up to 7x7.
template <class Engine>
struct DenseTapSmem {
  static constexpr int kStage = (Engine::kRows + Engine::kCols) * 128;
  static constexpr int kWeights = kStage + Engine::kRows * 128;
  static constexpr int kPrefix = ClassicBarrierOffset<Engine>();
  static constexpr int kPrefixCorners = 64;
  static constexpr int kBytes = kPrefix + kPrefixCorners * Engine::kCols * 2;
  static_assert(Engine::kRows * (Engine::kCols + 4) * 4 <= kWeights, "the epilogues' scratch ends before the weights");
  static_assert(kWeights + Engine::kCols * 128 <= 2 * kStage, "the K block lies in stage 1");
};
// Where the border rows' bounds come from DenseBorderRowBounds: unpooled threshold epilogues of "zero"-padded
// problems without the class table. Other problems keep StoreDirectBits' own path, whose per-warp loop over
// its border rows left AlexNet's 11x11 conv1 2.7x slower than with "one" padding: with 56-pixel image rows,
// 31% of the warps' row steps held a border row, the other warps waited at the next barrier (ncu).
__host__ __device__ __forceinline__ bool DenseBorderBounds(const BinaryGemmProblem& p) {
  return p.pool_h * p.pool_w == 1 && p.epilogue == Epilogue::kBits && !p.pad_one && !p.correction_table;
}
// Whether DenseBorderRowBounds reads prefix sums (filters up to 7x7); where not, the kernel's instance with the
// edge-table form (DenseTapKernel's kEdgeBorders, the launcher's choice) runs the problem.
template <class Engine>
__host__ __device__ __forceinline__ bool DensePrefixSums(const BinaryGemmProblem& p) {
  return DenseBorderBounds(p) && (p.kh + 1) * (p.kw + 1) <= DenseTapSmem<Engine>::kPrefixCorners;
}

// CTAs an SM that the dense-tap kernel's registers are sized for (PlanDenseTaps also asks the shared memory).
inline constexpr int kDenseTapCtasPerSm = 3;

// DenseTapKernel<MmaSyncDenseTaps, edge_borders>, or its residual epilogue's instance (no edge borders: those
// are the threshold epilogue's).
const void* DenseTapKernelInstance(bool edge_borders, bool residual);

}  // namespace jaxbnn::cuda

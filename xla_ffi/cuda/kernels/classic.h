// The classic kernel (ClassicKernel: an mma.sync or CUDA-core engine over a multistage cp.async pipeline, all
// threads loading and computing, one tile a CTA): its shared memory and its instances, for the planner.
#pragma once

#include "cuda/device/mma_sync_engine.cuh"
#include "cuda/device/simt_engine.cuh"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

template <class Engine>
__host__ __device__ constexpr int ClassicBarrierOffset() {
  constexpr int stage = (Engine::kRows + Engine::kCols) * 128;
  // the stages, origins, popc_a, cols, and (StoreDirect) row_class
  constexpr int bytes = Engine::kStages * stage + Engine::kRows * 16 + Engine::kRows * 4 +
                        sizeof(TileColumns<Engine::kCols>) + (Engine::kDirectStore ? Engine::kRows : 0);
  return (bytes + 7) / 8 * 8;
}
template <class Engine>
constexpr int ClassicSmemBytes() {
  return ClassicBarrierOffset<Engine>() + 2 * Engine::kStages * 8;
}
static_assert(ClassicSmemBytes<MmaSyncNarrow>() <= 163 * 1024, "the narrow mma.sync engine runs on an A100");

// ClassicKernel<Engine, 4> (16-byte activation copies: every tap's words 16-byte aligned) or <Engine, 1>.
// residual: an instance with the residual epilogue (Epilogue::kResidual), which the others do not run; doubled:
// one that doubles its accumulators after BinaryGemmProblem::doubled_k_blocks K blocks (not residual).
template <class Engine>
const void* ClassicKernelInstance(bool aligned, bool residual, bool doubled);

}  // namespace jaxbnn::cuda

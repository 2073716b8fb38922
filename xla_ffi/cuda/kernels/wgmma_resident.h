// The resident-weight wgmma kernel (ResidentWgmmaKernel): its shared memory and its instances, for the planner.
#pragma once

#include "cuda/device/epilogue.cuh"
#include "cuda/device/tile_columns.cuh"
#include "cuda/device/loaders.cuh"
#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

constexpr int kResidentStageBytes = 64 * 128;  // 64 rows x one K block
// per warpgroup: deeper rings measured slower (C = 256: 3 stages +8% against main, 7 stages -3%)
constexpr int kResidentStages = 3;
// Everything but the weights: alignment slack, the rings, the column table, popc_a, the barriers, the row
// corrections, and (16-byte aligned) the all-ones B of the popc(a) wgmmas.
constexpr int kResidentRingBytes = 2 * kResidentStages * kResidentStageBytes;
constexpr int kResidentFixedBytes = 1024 + kResidentRingBytes + static_cast<int>(sizeof(TileColumns<kWgCols>)) +
                                    kWgRows * 4 + (4 * kResidentStages + 1) * 8 + kWgRows + 16 + 256;
__host__ __device__ __forceinline__ int ResidentWeightBytes(int w_k_tiles, int cols) { return cols / 8 * w_k_tiles * 128; }
// The cp.async instance's receptive-field origins of a tile's rows (RowOrigin), after the all-ones B.
constexpr int kResidentOriginBytes = kWgRows * 16;

// The residual instances' shared memory after the origins' place (taken whether or not they copy): the tile's
// columns' StreamColumns (16-byte multiples) and a shortcut stage per consumer warp (StageShortcut).
__host__ __device__ constexpr int ResidentStagedBytes(int cols) {
  constexpr int kConsumerWarps = (kWgThreads - 128) / 32;
  static_assert(sizeof(StreamColumns<kWgCols>) % 16 == 0 && sizeof(StreamColumns<kWgCols / 2>) % 16 == 0,
                "the stages after the stream columns stay 16-byte aligned");
  return kResidentOriginBytes +
         static_cast<int>(cols == kWgCols ? sizeof(StreamColumns<kWgCols>) : sizeof(StreamColumns<kWgCols / 2>)) +
         kConsumerWarps * (cols == kWgCols ? kStagedWarpBytes<kWgCols> : kStagedWarpBytes<kWgCols / 2>);
}

// ResidentWgmmaKernel<layout, cols> (cols: kWgCols or kWgCols / 2).
// residual: an instance with the narrow stream's residual epilogue (Epilogue::kResidualInt16, its shortcut
// staged), which the others do not run.
const void* ResidentWgmmaKernelInstance(ALayout layout, int cols, bool residual);

}  // namespace jaxbnn::cuda

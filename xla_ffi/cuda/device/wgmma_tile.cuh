// The wgmma kernels' tile: 128 rows x 256 columns, a producer warpgroup and two consumer warpgroups, a
// 4-stage ring, clusters of two CTAs along M (the persistent kernel).
#pragma once

#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

constexpr int kWgRows = 128, kWgCols = 256, kWgStages = 4, kWgThreads = 384;
constexpr int kWgCluster = 2;
[[maybe_unused]] constexpr int kWgConsumerWarps = 8;
[[maybe_unused]] constexpr int kWgStageA = kWgRows * 128;
constexpr int kWgStageBytes = (kWgRows + kWgCols) * 128;
constexpr int kWgLd = kWgCols + 4;
// 1024 bytes of slack: swizzled TMA destinations must be 1024-byte aligned.
constexpr int kWgSmemBytes = 1024 + kWgStages * kWgStageBytes + kWgRows * 16 + kWgRows * 4 +
                             static_cast<int>(sizeof(TileColumns<kWgCols>)) + 2 * kWgStages * 8 + kWgRows;
static_assert(kWgRows * kWgLd * 4 <= kWgStages * kWgStageBytes, "the staged epilogue tile reuses the stages");

}  // namespace jaxbnn::cuda

// The column parameters of a tile, staged in shared memory for the epilogues, and a column's threshold.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/geometry.cuh"

namespace jaxbnn::cuda {

// What the epilogue needs of each column of a tile, staged in shared memory once per tile so that the
// epilogue reads no global memory: popc(b) (summed over taps), the border-class corrections and the
// epilogue parameters.
template <int kCols>
struct TileColumns {
  // [BorderClass][column], when p.correction_table; in the unpooled threshold epilogues (wgmma kernels,
  // mma.sync StoreDirectBits), the class's bound instead (bound + correction). Where PairsBounds, each even
  // column's slot holds the PairedBounds of it and the next column: of the class bounds, or without the
  // table, of the plain bounds in row 0 (no other reader then; the persistent kernel has no room for another
  // row). StoreDirectBits also reads the plain bounds unpaired from row 0 of a problem without the table.
  // Without the table, rows 1 .. may hold the edge table (p.edge_table, FillEdgeTable). In the narrow residual
  // epilogue of the band and resident kernels (StoreStagedResidualRows) every entry holds 2 popc(b) too, and row 0
  // holds 2 popc(b) alone, with or without the table.
  int correction[kTableClasses][kCols];
  int popc_b[kCols];
  int threshold[kCols];
  int flip[kCols];
  // The accumulator epilogues' form of the threshold: bit = (4 acc + k_real - 2 popc_a >= bound) XOR flip,
  // bound = threshold + 2 popc_b, plus 1 where flipped (dot <= t is the negation of dot >= t + 1).
  int bound[kCols];
  uint32_t flip_word[kCols / 32];  // the flip flags of 32 columns, bit c % 32 for column c
  // The affine epilogue's terms, or the threshold epilogue's second plane (BinaryGemmProblem::planes == 2), in
  // the same bytes: the tile's shared memory stays as it is for every epilogue.
  union {
    struct {
      float scale[kCols];
      float bias[kCols];
    };
    struct {
      // plane 1's bound less plane 0's (0 past N: both unreachable), so that every row's bounds of plane 1,
      // border classes included, are plane 0's plus these
      int second_delta[kCols];
      // where PairsBounds: the deltas of columns 2 i, 2 i + 1 as PairedBounds subtracts them (lo + hi 2^16)
      uint32_t second_paired_delta[kCols / 2];
      uint32_t second_flip_word[kCols / 32];  // plane 1's flip flags, as flip_word
    };
  };
};

// The threshold epilogue's bound of column `col` (TileColumns::bound) from its threshold, flip and popc(b).
// The threshold is clamped to [-k_real - 1, k_real + 1], which changes no bit (every dot lies in [-k_real,
// k_real]) and keeps the bounds, the class bounds and the epilogue's differences far inside int32 (a
// threshold near INT32_MAX overflowed threshold + 2 popc_b before): below 2^25 in magnitude, as
// StoreBitsRows needs, for reductions of at most kMaxReductionWords words. Columns past N get
// kUnreachableBound, above every value: their bits stay 0 (the padding bits of the last word).
inline constexpr int kUnreachableBound = 1 << 24;
static_assert(kUnreachableBound > 5 * 32 * kMaxReductionWords, "above every 4 acc + k_real - 2 popc_a");
__device__ __forceinline__ int ColumnBound(const BinaryGemmProblem& p, int col, int threshold, int flip, int popc_b) {
  const int clamped = min(max(threshold, -p.k_real - 1), p.k_real + 1);
  return col < p.n ? clamped + 2 * popc_b + (flip ? 1 : 0) : kUnreachableBound;
}

// A column's threshold and flip (0 past N or for other epilogues).
struct ColumnThreshold {
  int threshold, flip;
};
__device__ __forceinline__ ColumnThreshold LoadColumnThreshold(const BinaryGemmProblem& p, int col) {
  const bool real = p.epilogue == Epilogue::kBits && col < p.n;
  return {real ? p.threshold[col] : 0, real ? p.flip[col] : 0};
}

}  // namespace jaxbnn::cuda

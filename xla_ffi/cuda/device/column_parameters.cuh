// Filling a tile's column parameters (TileColumns) from the problem: popcounts, thresholds, affine terms and
// the border tables.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/border.cuh"
#include "cuda/device/threshold_bits.cuh"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

// The second threshold plane's parameters of local column `lc` (TileColumns::second_delta ...), plane 0's bound
// `bound` filled. Called by whole warps for 32 consecutive columns (pairs are shuffled, flip words ballots).
template <int kCols>
__device__ __forceinline__ void FillSecondPlane(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col, int lc,
                                                int bound, int popc_b) {
  const bool real = col < p.n;
  const int threshold = real ? p.threshold[p.n + col] : 0, flip = real ? p.flip[p.n + col] : 0;
  const int delta = ColumnBound(p, col, threshold, flip, popc_b) - bound;
  cols.second_delta[lc] = delta;
  const int next = __shfl_xor_sync(0xffffffffu, delta, 1);
  if (lc % 2 == 0) cols.second_paired_delta[lc / 2] = static_cast<uint32_t>(delta) + (static_cast<uint32_t>(next) << 16);
  const uint32_t flips = __ballot_sync(0xffffffffu, flip != 0);
  if (lc % 32 == 0) cols.second_flip_word[lc / 32] = flips;
}

// Fills the epilogue parameters of local column `lc` (all but the correction table) from its popc(b) summed
// over taps and its threshold. Called by whole warps for 32 consecutive columns (the flip words are ballots).
template <int kCols>
__device__ __forceinline__ void FillColumnParameters(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col0,
                                                     int lc, int popc_b, ColumnThreshold th) {
  const int col = col0 + lc;
  cols.popc_b[lc] = popc_b;
  if (p.epilogue == Epilogue::kBits) {
    cols.threshold[lc] = th.threshold;
    cols.flip[lc] = th.flip;
    const int bound = ColumnBound(p, col, th.threshold, th.flip, popc_b);
    cols.bound[lc] = bound;
    if (PairsBounds(p) && !p.correction_table) {
      StorePairedBounds(p, bound, lc, reinterpret_cast<uint32_t*>(&cols.correction[0][lc]));
    }
    const uint32_t flips = __ballot_sync(0xffffffffu, th.flip != 0);
    if (lc % 32 == 0) cols.flip_word[lc / 32] = flips;
    if (p.planes > 1) FillSecondPlane(p, cols, col, lc, bound, popc_b);
  } else if (p.epilogue == Epilogue::kAffine) {
    cols.scale[lc] = col < p.n ? p.scale[col] : 0.f;
    cols.bias[lc] = col < p.n ? p.bias[col] : 0.f;
  }
}
template <int kCols>
__device__ __forceinline__ void FillTileColumn(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col0, int lc) {
  const int col = col0 + lc, taps = p.kh * p.kw;
  int total = 0;
#pragma unroll 8
  for (int t = 0; t < taps; ++t) total += col < p.n ? p.tap_popc[t * p.n + col] : 0;
  FillColumnParameters(p, cols, col0, lc, total, LoadColumnThreshold(p, col));
}

// The columns' set-up of a tile (ClassicKernel, DenseTapKernel): their epilogue parameters and, where the
// problem keeps it, the border-class table. StoreDirectBits reads every row's bounds from the table's rows,
// class 0 holding the plain ones: the table's fill adds the bound to every class (class 0's correction is 0);
// without the table, FillColumnParameters puts the plain bounds into row 0 where they are paired, and here
// where not. edge_table: whether to fill the edge table (the dense kernel's prefix sums make it unused).
template <int kCols, int kThreads>
__device__ __forceinline__ void SetUpTileColumns(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col0,
                                                 int tid, bool direct_bits, bool edge_table) {
  static_assert(kThreads % kCols == 0, "whole parts of a column's classes");
  if (p.correction_table) {
    // every thread: kThreads / kCols parts share a column's classes (whole warps: the paired bounds are
    // shuffled, the flip words are ballots)
    const int c = tid % kCols, part = tid / kCols;
    const ColumnThreshold th = LoadColumnThreshold(p, col0 + c);
    const int popc_b = FillCorrectionTable<kCols>(p, cols, col0, c, part, kThreads / kCols, direct_bits, th);
    if (part == 0) FillColumnParameters<kCols>(p, cols, col0, c, popc_b, th);
  } else if (tid < kCols) {
    FillTileColumn<kCols>(p, cols, col0, tid);
    if (direct_bits && !PairsBounds(p)) cols.correction[0][tid] = cols.bound[tid];
    if (edge_table) FillEdgeTable<kCols>(p, cols, col0, tid);
  }
}

}  // namespace jaxbnn::cuda

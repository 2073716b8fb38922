// Epilogue pieces of the mma.sync / CUDA-core kernels: the fused epilogue over a tile staged in shared memory
// (pooling), a border row's bound class, and the int32 / affine stores of a pair of columns.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/border.cuh"
#include "cuda/device/geometry.cuh"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

// Max over the pool window (rows pr * window ...) of the exact ±1 dot products of local column lc.
template <int kLd, int kCols>
__device__ __forceinline__ int PooledDot(const BinaryGemmProblem& p, const int* acc, const int* popc_a,
                                         const TileColumns<kCols>& cols, const int4* origins, int window, int pr,
                                         int lc, int col) {
  int best = INT_MIN;
  for (int e = 0; e < window; ++e) {
    const int r = pr * window + e;
    int dot = p.k_real - 2 * popc_a[r] - 2 * cols.popc_b[lc] + 4 * acc[r * kLd + lc];
    if (!p.pad_one) dot -= ExcludedTaps(p, cols, origins[r], lc, col);
    best = max(best, dot);
  }
  return best;
}

// The fused epilogue over a finished tile in shared memory, run by kThreads threads (tid 0..kThreads-1).
template <int kRows, int kCols, int kLd, int kThreads>
__device__ void StoreTile(const BinaryGemmProblem& p, const int* acc, const int* popc_a,
                          const TileColumns<kCols>& cols, const int4* origins, int tile_m, int col0, int tid) {
  const int window = p.pool_h * p.pool_w;
  const int pooled_per_tile = kRows / window;
  const long long pooled0 = static_cast<long long>(tile_m) * pooled_per_tile;
  if (p.epilogue == Epilogue::kBits) {
    constexpr int kWordsPerRow = kCols / 32;
    const int out_words = (p.n + 31) / 32;
    const int lane = tid % 32;
    uint32_t* out = static_cast<uint32_t*>(p.out);
    for (int item = tid / 32; item < pooled_per_tile * kWordsPerRow; item += kThreads / 32) {
      const int pr = item / kWordsPerRow, word = item % kWordsPerRow;
      const long long pooled = pooled0 + pr;
      if (pooled >= p.pooled_rows || col0 + word * 32 >= p.n) continue;  // warp-uniform
      const int lc = word * 32 + lane, col = col0 + lc;
      bool bit = false;
      if (col < p.n) {
        const int dot = PooledDot<kLd, kCols>(p, acc, popc_a, cols, origins, window, pr, lc, col);
        bit = cols.flip[lc] ? dot <= cols.threshold[lc] : dot >= cols.threshold[lc];
      }
      const uint32_t bits = __ballot_sync(0xffffffffu, bit);
      if (lane == 0) out[pooled * out_words + col0 / 32 + word] = bits;
    }
    return;
  }
  for (int i = tid; i < pooled_per_tile * kCols; i += kThreads) {
    const int pr = i / kCols, lc = i % kCols, col = col0 + lc;
    const long long pooled = pooled0 + pr;
    if (pooled >= p.pooled_rows || col >= p.n) continue;
    const int dot = PooledDot<kLd, kCols>(p, acc, popc_a, cols, origins, window, pr, lc, col);
    if (p.epilogue == Epilogue::kInt32) {
      static_cast<int32_t*>(p.out)[pooled * p.n + col] = dot;
    } else {  // no contraction into an FMA: the same two roundings as the reference
      static_cast<float*>(p.out)[pooled * p.n + col] =
          __fadd_rn(__fmul_rn(static_cast<float>(dot), cols.scale[lc]), cols.bias[lc]);
    }
  }
}

// The row of bounds that the mma.sync threshold epilogue compares tile row `origin` (RowOrigin) with:
// 0 (the plain bounds: inside the frame, "one" padding, or no pixel), else the row's border class where the
// tile keeps the correction table (whose rows ClassicKernel fills with bounds), or 1 for a row of its own
// (BorderRowBounds).
__device__ __forceinline__ int8_t EpilogueRowClass(const BinaryGemmProblem& p, const int4& origin) {
  if (!BorderRow(p, origin)) return 0;
  return static_cast<int8_t>(p.correction_table ? BorderClass(p, ExcessOf(p, origin.y, origin.z)) : 1);
}

// Stores the int32 / affine values of two adjacent columns (col, col + 1) of one output row.
__device__ __forceinline__ void StorePair(const BinaryGemmProblem& p, long long row, int col, int d0, int d1, float s0,
                                          float b0, float s1, float b1) {
  const bool pairs = p.n % 2 == 0;  // 8-byte stores keep their alignment when rows have an even length
  if (p.epilogue == Epilogue::kInt32) {
    int32_t* out = static_cast<int32_t*>(p.out) + row * p.n + col;
    if (pairs) {
      *reinterpret_cast<int2*>(out) = make_int2(d0, d1);
    } else {
      out[0] = d0;
      if (col + 1 < p.n) out[1] = d1;
    }
  } else {
    const float f0 = __fadd_rn(__fmul_rn(static_cast<float>(d0), s0), b0);
    const float f1 = __fadd_rn(__fmul_rn(static_cast<float>(d1), s1), b1);
    float* out = static_cast<float*>(p.out) + row * p.n + col;
    if (pairs) {
      *reinterpret_cast<float2*>(out) = make_float2(f0, f1);
    } else {
      out[0] = f0;
      if (col + 1 < p.n) out[1] = f1;
    }
  }
}

}  // namespace jaxbnn::cuda

// The mma.sync engine (sm_80+): BMMA m16n8k256 AND-popc over a stage, and its epilogues straight from the
// fragments.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/border.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/epilogue.cuh"
#include "cuda/device/loaders.cuh"
#include "cuda/device/threshold_bits.cuh"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

template <int kColsT, int kStagesT, int kWarpsT>
struct MmaSyncEngine {
  static constexpr int kRows = 128, kCols = kColsT, kStages = kStagesT, kThreads = 32 * kWarpsT;
  // 2 x kColWarps warps, each 64 rows x kWarpCols. 64 x 64 warp tiles load 8 ldmatrix.x4 per k256 step for
  // 32 mma (128 shared-memory bytes per mma), 64 x 32 tiles 6 for 16 (192 bytes) but need half the
  // accumulator registers, so a CTA can have twice the warps to hide the ldmatrix and mma latencies.
  static constexpr int kColWarps = kWarpsT / 2;
  static constexpr int kWarpCols = kCols / kColWarps, kFrags = kWarpCols / 8, kWarpWords = kWarpCols / 32;
  static_assert(kWarpCols % 32 == 0, "a warp's columns make whole output words");
  static constexpr bool kDirectStore = true;  // StoreDirect: the epilogue without the shared int32 tile
  // The int16 epilogue's 8-byte stores of four values from the quad's exchange (StoreInt16Fragments), except in
  // the dense-tap engine (64 columns), whose kernel they made spill (14-16 bytes, ptxas) and its threshold
  // epilogue 1-3% slower (harness, H200): there the pairs are stored as they lie (StoreInt16Pair).
  static constexpr bool kQuadInt16Stores = kCols > 64;
  // A's stages in 128-byte rows (the weights' in core matrices): LoadActivationStage can then copy a row's
  // K block by one quarter-warp
  static constexpr ALayout kALayout = ALayout::kSwizzledRows;
  struct Accumulators {
    int v[4][kFrags][4];  // [16-row fragment][8-column fragment][register]
    __device__ void Double() {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < kFrags; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) v[i][j][r] *= 2;
    }
  };

  // stage: the stage (A rows, then B rows) as a generic pointer and as a shared-window address.
  // after_step(ks) runs once step ks's mma are issued: the caller's share of the next stage's copies.
  // steps: the k256 steps of the stage that hold K (the dense-tap kernel's; the pipelines' stages all 4).
  template <class AfterStep>
  __device__ static void Compute(Accumulators& acc, const uint8_t*, uint32_t stage_addr, int tid,
                                 AfterStep&& after_step, int steps = 4) {
#if __CUDA_ARCH__ >= 800
    const uint32_t stage_a = stage_addr, stage_b = stage_addr + kRows * 128;
    const int warp = tid / 32, lane = tid % 32;
    const int warp_row = (warp / kColWarps) * 64, warp_col = (warp % kColWarps) * kWarpCols;
    // A (kSwizzledRows): chunk c of row r at r * 128 + ((c ^ r % 8) * 16). This lane's row has r % 8 = lane % 8
    // and step ks's chunk is 2 ks + lane / 16, so its offset is the lane's step-0 offset XOR ks * 32.
    static_assert(kALayout == ALayout::kSwizzledRows, "A's rows are 128-byte lines");
    const uint32_t a_lane = (warp_row + (lane % 8) + ((lane / 8) % 2) * 8) * 128 + (((lane / 16) ^ (lane % 8)) << 4);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks == steps) break;
      uint32_t a[4][4], b[kFrags][2];
      const uint32_t a_step = stage_a + (a_lane ^ (ks << 5));
#pragma unroll
      for (int mf = 0; mf < 4; ++mf) {
        const uint32_t addr = a_step + mf * 16 * 128;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(a[mf][0]), "=r"(a[mf][1]), "=r"(a[mf][2]), "=r"(a[mf][3])
                     : "r"(addr));
      }
#pragma unroll
      for (int np = 0; np < kFrags / 2; ++np) {
        const int m = lane / 8;
        const int col = warp_col + (2 * np + m / 2) * 8 + lane % 8;
        const uint32_t addr = stage_b + StageOffset(col, 2 * ks + m % 2);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b[2 * np][0]), "=r"(b[2 * np][1]), "=r"(b[2 * np + 1][0]), "=r"(b[2 * np + 1][1])
                     : "r"(addr));
      }
#pragma unroll
      for (int mf = 0; mf < 4; ++mf) {
#pragma unroll
        for (int nf = 0; nf < kFrags; ++nf) {
          int* d = acc.v[mf][nf];
          asm volatile(
              "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
              "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
              : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
              : "r"(a[mf][0]), "r"(a[mf][1]), "r"(a[mf][2]), "r"(a[mf][3]), "r"(b[nf][0]), "r"(b[nf][1]));
        }
      }
      after_step(ks);
    }
#endif
  }

  // The epilogue straight from the fragments (no pool): lane (g, t) holds rows g, g + 8 of each 16-row
  // fragment and columns 2 t, 2 t + 1 of each 8-column fragment; four fragments (32 columns) make one
  // output word. One branch on the epilogue's form per tile: each form's rows are one straight block of
  // code (a tile's epilogue is fetched cold: ncu put a third of its stalls on instruction fetch).
  // row_class: EpilogueRowClass of every tile row; scratch: the stages, free once every warp left the k loop.
  // kBorderBoundsReady: the border rows' bounds of a problem without the table are in scratch already
  // (DenseBorderRowBounds).
  template <bool kBorderBoundsReady = false>
  __device__ static void StoreDirect(const Accumulators& acc, const BinaryGemmProblem& p, const int* popc_a,
                                     const int4* origins, const int8_t* row_class, int* scratch,
                                     const TileColumns<kCols>& cols, int tile_m, int col0, int tid) {
    if (p.epilogue == Epilogue::kInt16) {
      StoreDirectValues<true>(acc, p, popc_a, origins, cols, tile_m, col0, tid);
    } else if (p.epilogue != Epilogue::kBits) {
      StoreDirectValues<false>(acc, p, popc_a, origins, cols, tile_m, col0, tid);
    } else if (PairsBounds(p)) {
      StoreDirectBitsOfPlanes<true, kBorderBoundsReady>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
    } else {
      StoreDirectBitsOfPlanes<false, kBorderBoundsReady>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
    }
  }

  // StoreDirectBits of the problem's threshold planes.
  template <bool kPaired, bool kBorderBoundsReady>
  __device__ static void StoreDirectBitsOfPlanes(const Accumulators& acc, const BinaryGemmProblem& p, const int* popc_a,
                                                 const int4* origins, const int8_t* row_class, int* scratch,
                                                 const TileColumns<kCols>& cols, int tile_m, int col0, int tid) {
    if (p.planes > 1) {
      StoreDirectBits<kPaired, kBorderBoundsReady, 2>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
    } else {
      StoreDirectBits<kPaired, kBorderBoundsReady, 1>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
    }
  }

  // The threshold epilogue. A thread's rows warp_row + 8 i + g (i = 2 mf + h) each compare with one row of
  // bounds: cols.correction[class] (class 0: the plain bounds), or for a border row of a problem without
  // the table, its own row in `scratch`. The quad's words are completed by a reduce-scatter, after which
  // lane t stores rows 4 q + t: 6 shuffles and 2 stores a thread for 8 rows, not 16 and 8. kPlanes: the
  // threshold planes (BinaryGemmProblem::planes), the second one's bounds plane 0's plus TileColumns'
  // second-plane deltas, from the same accumulators.
  template <bool kPaired, bool kBorderBoundsReady, int kPlanes>
  __device__ static void StoreDirectBits(const Accumulators& acc, const BinaryGemmProblem& p, const int* popc_a,
                                         const int4* origins, const int8_t* row_class, int* scratch,
                                         const TileColumns<kCols>& cols, int tile_m, int col0, int tid) {
    static_assert(kWarpWords == 1, "a warp's columns make one output word per row");
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int warp_row = (warp / kColWarps) * 64, warp_col = (warp % kColWarps) * kWarpCols;
    const int first_lc = warp_col + 2 * t;
    if (!kBorderBoundsReady && !p.pad_one && !p.correction_table) {
#pragma unroll 1
      for (int i = 0; i < 8; ++i) {
        const int r = warp_row + 8 * i + g;
        if (row_class[r] != 0) BorderRowBounds(p, cols, origins[r], col0, first_lc, scratch + r * kCols);
      }
    }
    // row i's word of this thread's pairs of columns
    auto row_word = [&](int i, int plane) {
      const int r = warp_row + 8 * i + g, mf = i / 2, h = i % 2;
      const int cls = row_class[r];
      const int* bounds = (cls != 0 && !p.correction_table ? scratch + r * kCols : cols.correction[cls]) + first_lc;
      int a[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        a[j][0] = acc.v[mf][j][2 * h];
        a[j][1] = acc.v[mf][j][2 * h + 1];
      }
      const int v0 = p.k_real - 2 * popc_a[r];
      if (plane == 0) {
        return (kPaired ? ThresholdBitsPaired(a, v0, bounds) : ThresholdBitsUnpaired(a, v0, bounds)) << (2 * t);
      }
      return (kPaired ? ThresholdBitsPaired(a, v0, bounds, &cols.second_paired_delta[first_lc / 2])
                      : ThresholdBitsUnpaired(a, v0, bounds, &cols.second_delta[first_lc]))
             << (2 * t);
    };
    const long long row0 = static_cast<long long>(tile_m) * kRows + warp_row + g;
    const int out_words = (p.n + 31) / 32;
    const long long row_words = static_cast<long long>(p.planes) * out_words;
    const bool inside = col0 + warp_col < p.n;
    uint32_t* out = static_cast<uint32_t*>(p.out) + (col0 + warp_col) / 32;
    // The quad's words of rows 4 q .. 4 q + 3 in, lane t's row 4 q + t out. Lanes 0, 1 first keep rows 4 q + j,
    // lanes 2, 3 rows 4 q + 2 + j. Four words a call, not an array of eight indexed by q: with the array,
    // nvcc kept all eight in local memory as dead stores (8 STL a thread and tile; ncu at 16384^3).
    auto store_rows = [&](int q, int plane, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
      const uint32_t half0 = ((t & 2) ? w2 : w0) | __shfl_xor_sync(0xffffffffu, (t & 2) ? w0 : w2, 2);
      const uint32_t half1 = ((t & 2) ? w3 : w1) | __shfl_xor_sync(0xffffffffu, (t & 2) ? w1 : w3, 2);
      const uint32_t mine = ((t & 1) ? half1 : half0) | __shfl_xor_sync(0xffffffffu, (t & 1) ? half0 : half1, 1);
      const long long row = row0 + 8 * (4 * q + t);
      const uint32_t flip = (plane == 0 ? cols.flip_word : cols.second_flip_word)[warp_col / 32];
      if (inside && row < p.pooled_rows) out[row * row_words + plane * out_words] = mine ^ flip;
    };
    // every plane of four rows from their accumulators together (a pass per plane would keep them all live)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint32_t w[kPlanes][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int plane = 0; plane < kPlanes; ++plane) w[plane][i] = row_word(4 * q + i, plane);
      }
#pragma unroll
      for (int plane = 0; plane < kPlanes; ++plane) store_rows(q, plane, w[plane][0], w[plane][1], w[plane][2], w[plane][3]);
    }
  }

  // The int32 / affine epilogues, or (kInt16) the int16 one.
  template <bool kInt16>
  __device__ static void StoreDirectValues(const Accumulators& acc, const BinaryGemmProblem& p, const int* popc_a,
                                           const int4* origins, const TileColumns<kCols>& cols, int tile_m,
                                           int col0, int tid) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int warp_row = (warp / kColWarps) * 64, warp_col = (warp % kColWarps) * kWarpCols;
#pragma unroll
    for (int mf = 0; mf < 4; ++mf) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row + mf * 16 + g + 8 * h;
        const long long row = static_cast<long long>(tile_m) * kRows + r;
        if (row >= p.pooled_rows) continue;
        // the row's origin as the prologue computed it: RowOrigin's runtime divisions for each of a thread's
        // eight rows took 3.6 us of a C = 512 tile's 8.3 us epilogue (clock64 trace)
        const int4 origin = origins[r];
        const bool border = BorderRow(p, origin);
        const int v0 = p.k_real - 2 * popc_a[r];
        int excl[2 * kFrags];
        if (border) BorderCorrections(p, cols, origin, col0, warp_col + 2 * t, excl);
        if constexpr (kInt16) {
          static_assert(!kQuadInt16Stores || kFrags % 2 == 0, "fragments in pairs");
          auto value = [&](int nf, int e) {
            const int lc = warp_col + nf * 8 + 2 * t + e;
            return 4 * acc.v[mf][nf][2 * h + e] + v0 - 2 * cols.popc_b[lc] - (border ? excl[2 * nf + e] : 0);
          };
          if constexpr (kQuadInt16Stores) {
#pragma unroll
            for (int nf = 0; nf < kFrags; nf += 2) {
              const int col_f = col0 + warp_col + nf * 8;
              if (col_f >= p.n) break;  // the same for the whole quad
              StoreInt16Fragments(p, row, true, col_f, t, value(nf, 0), value(nf, 1), value(nf + 1, 0), value(nf + 1, 1),
                                  QuadLanes());
            }
          } else {
#pragma unroll
            for (int nf = 0; nf < kFrags; ++nf) {
              if (col0 + warp_col + nf * 8 >= p.n) break;  // the same for the whole warp
              const int col = col0 + warp_col + nf * 8 + 2 * t;
              if (col < p.n) StoreInt16Pair(p, row, col, value(nf, 0), value(nf, 1));
            }
          }
        } else {
#pragma unroll
          for (int nf = 0; nf < kFrags; ++nf) {
            if (col0 + warp_col + nf * 8 >= p.n) break;  // the same for the whole warp (as StoreValueRows)
            const int lc = warp_col + nf * 8 + 2 * t, col = col0 + lc;
            if (col >= p.n) continue;
            int d0 = 4 * acc.v[mf][nf][2 * h] + v0 - 2 * cols.popc_b[lc];
            int d1 = 4 * acc.v[mf][nf][2 * h + 1] + v0 - 2 * cols.popc_b[lc + 1];
            if (border) {
              d0 -= excl[2 * nf];
              d1 -= excl[2 * nf + 1];
            }
            StorePair(p, row, col, d0, d1, cols.scale[lc], cols.bias[lc], cols.scale[lc + 1], cols.bias[lc + 1]);
          }
        }
      }
    }
  }

  // The residual epilogue: stream values, and a warp's one word of stream bits per row (StoreStreamWord).
  // kNarrow: the int16 stream (kResidualInt16).
  template <bool kNarrow>
  __device__ static void StoreDirectResidual(const Accumulators& acc, const BinaryGemmProblem& p,
                                             const ResidualOperands& residual, const int* popc_a, const int4* origins,
                                             const TileColumns<kCols>& cols, int tile_m, int col0, int tid) {
    static_assert(kFrags == 4, "a warp's columns make one output word per row");
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int warp_row = (warp / kColWarps) * 64, warp_col = (warp % kColWarps) * kWarpCols;
#pragma unroll
    for (int mf = 0; mf < 4; ++mf) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row + mf * 16 + g + 8 * h;
        const long long row = static_cast<long long>(tile_m) * kRows + r;
        const bool valid = row < p.pooled_rows;
        const int4 origin = origins[r];
        const bool border = valid && BorderRow(p, origin);
        const int v0 = p.k_real - 2 * popc_a[r];
        const long long shortcut = valid ? ShortcutOffset(p, residual, row) : 0;
        int excl[2 * kFrags];
        if (border) BorderCorrections(p, cols, origin, col0, warp_col + 2 * t, excl);
        int2 added[kFrags];  // loaded together, ahead of the row's stores
#pragma unroll
        for (int nf = 0; nf < kFrags; ++nf) {
          added[nf] = valid ? ShortcutPair<kNarrow>(residual, shortcut, col0 + warp_col + nf * 8 + 2 * t) : make_int2(0, 0);
        }
        uint32_t bits = 0;
#pragma unroll
        for (int nf = 0; nf < kFrags; ++nf) {
          const int lc = warp_col + nf * 8 + 2 * t;
          int d0 = 4 * acc.v[mf][nf][2 * h] + v0 - 2 * cols.popc_b[lc];
          int d1 = 4 * acc.v[mf][nf][2 * h + 1] + v0 - 2 * cols.popc_b[lc + 1];
          if (border) {
            d0 -= excl[2 * nf];
            d1 -= excl[2 * nf + 1];
          }
          bits |= StoreResidualPair<kNarrow>(p, residual, added[nf], row, valid, col0 + lc, d0, d1) << (8 * nf);
        }
        if (residual.bits != nullptr) StoreStreamWord(p, residual, row, valid, col0 + warp_col, bits, t, QuadLanes());
      }
    }
  }

  __device__ static void Store(const Accumulators& acc, int* tile, int ld, int tid) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int warp_row = (warp / kColWarps) * 64, warp_col = (warp % kColWarps) * kWarpCols;
#pragma unroll
    for (int mf = 0; mf < 4; ++mf) {
#pragma unroll
      for (int nf = 0; nf < kFrags; ++nf) {
        const int row = warp_row + mf * 16 + g, col = warp_col + nf * 8 + 2 * t;
        tile[row * ld + col] = acc.v[mf][nf][0];
        tile[row * ld + col + 1] = acc.v[mf][nf][1];
        tile[(row + 8) * ld + col] = acc.v[mf][nf][2];
        tile[(row + 8) * ld + col + 1] = acc.v[mf][nf][3];
      }
    }
  }
};
// 128 x 128 tiles in 4 stages fit an A100's 163 KB of shared memory; 128 x 256 tiles in 3 stages (178 KB)
// need an H100's (LaunchBinaryGemm picks by the device's opt-in limit).
using MmaSyncNarrow = MmaSyncEngine<128, 4, 8>;
using MmaSyncWide = MmaSyncEngine<256, 3, 16>;
// The dense-tap kernel's engine (DenseTapKernel: one gathered K block, no pipeline): 128 x 64 tiles of 4 warps,
// whose two stages hold the K block and the epilogues' scratch.
using MmaSyncDenseTaps = MmaSyncEngine<64, 2, 4>;

}  // namespace jaxbnn::cuda

// The wgmma kernels' epilogue straight from the accumulators: row corrections, class bounds, threshold bits,
// int32 / affine values.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/border.cuh"
#include "cuda/device/epilogue.cuh"
#include "cuda/device/geometry.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/threshold_bits.cuh"
#include "cuda/device/tile_columns.cuh"
#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// What the accumulator epilogues subtract from tile row `r`: 0 for nothing (a pixel whose receptive field
// stays inside the frame, "one" padding, or no pixel), else the row's border class (p.correction_table
// problems: never 0 for a border row) or 1 (others, whose epilogue sums the excluded taps per value).
// Computed once per row and tile, while the tensor cores run, instead of in every thread of the epilogue
// (RowOrigin's divisions were a fifth of the instructions of a 3x3 C=128 convolution). Unpooled problems
// only (one output pixel per row), with the launch's divisors: RowOrigin's four runtime divisions took
// ~200 instructions in the k loop of two warps per warpgroup (ncu, C = 128).
__device__ __forceinline__ int8_t RowCorrection(const BinaryGemmProblem& p, const LaunchDivisors& div, int tile_m,
                                                int r) {
  const int pixel = tile_m * kWgRows + r;
  if (pixel >= p.pooled_rows) return 0;
  const int image = Quotient(pixel, div.image_pixels), in_image = pixel - image * div.image_pixels.divisor;
  const int oh = Quotient(in_image, div.out_w), ow = in_image - oh * div.out_w.divisor;
  const int ih0 = oh * p.stride_h - p.pad_top, iw0 = ow * p.stride_w - p.pad_left;
  if (ih0 >= 0 && ih0 + p.kh <= p.in_h && iw0 >= 0 && iw0 + p.kw <= p.in_w) return 0;
  return static_cast<int8_t>(p.correction_table ? BorderClass(p, ExcessOf(p, ih0, iw0)) : 1);
}

// Turns the border-class corrections of local column `lc` into the class's bounds (bound + correction),
// so that the threshold epilogue compares every row with one table row (StoreBitsRows<true, ...>). For the
// unpooled threshold epilogue only: every other reader of the table wants corrections (ExcludedTaps).
// Called by whole warps, each thread for the column `lc` it filled of both the table and cols.bound.
__device__ __forceinline__ void AddBoundsToClasses(const BinaryGemmProblem& p, TileColumns<kWgCols>& cols, int lc) {
  const int classes = BorderClasses(p);
  // columns past N keep their unreachable bound
  auto class_bound = [](int bound, int correction) { return bound == kUnreachableBound ? bound : correction + bound; };
  if (!PairsBounds(p)) {
    const int bound = cols.bound[lc];
    for (int c = 0; c < classes; ++c) cols.correction[c][lc] = class_bound(bound, cols.correction[c][lc]);
    return;
  }
  // The even column's thread reads both columns' corrections and stores their PairedBounds: a shuffle
  // between each class's load and store, in turn, held the first tiles of every resident CTA back ~1 us
  // (clock64 trace).
  __syncwarp();  // the odd column's entries, written by its own thread
  if (lc % 2 == 0) {
    const int2 bound = *reinterpret_cast<const int2*>(&cols.bound[lc]);
    for (int c = 0; c < classes; ++c) {
      const int2 correction = *reinterpret_cast<const int2*>(&cols.correction[c][lc]);
      cols.correction[c][lc] =
          static_cast<int>(PairedBounds(p, class_bound(bound.x, correction.x), class_bound(bound.y, correction.y)));
    }
  }
}

// Threshold bits of a thread's two accumulator rows (h = 0, 1). Bits of columns 8 j + 2 t + e land at
// bit 8 (j % 4) + e of word j / 4; the quad's lanes (t) fill the other positions after a shift by 2 t, then
// an OR over the quad completes each 32-column word. bounds[h]: the bounds row h compares with: cols.bound,
// or the row of its border class in the class-bound table (kClassBounds: then the two rows' bounds are
// loaded separately); kPaired: their PairedBounds (in the even slots of a table row, TileColumns). kWords:
// output words per row (8: a 256-column tile; 4: a narrow tile of at most 128 columns, whose accumulators
// are the first 64; 2: at most 64 columns, the first 32). kAcc: the accumulators a thread holds (128 for
// m64n256, 64 for m64n128). kPlanes: the threshold planes (BinaryGemmProblem::planes), the second one's bounds
// plane 0's plus TileColumns' second-plane deltas.
template <bool kClassBounds, bool kPaired, int kWords, int kPlanes, int kAcc>
__device__ __forceinline__ void StoreBitsRows(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                              const TileColumns<kWgCols>& cols, const int (&v0)[2],
                                              const long long (&row)[2], const bool (&row_valid)[2],
                                              const int* const (&bounds)[2], int col0, int t) {
  static_assert(16 * kWords <= kAcc, "a word of 32 columns takes 16 accumulators of each thread");
  uint32_t words[kPlanes][2][kWords];
  // the values of fragments 4 wd .. 4 wd + 3 of row h, and that row's bounds from the word's first column
  auto word_bits = [&](int plane, int h, int wd) {
    int a[4][2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      a[q][0] = acc[4 * (4 * wd + q) + 2 * h];
      a[q][1] = acc[4 * (4 * wd + q) + 2 * h + 1];
    }
    const int lc = 32 * wd + 2 * t;
    const int* row_bounds = &bounds[kClassBounds ? h : 0][lc];
    if (plane == 0) {
      return kPaired ? ThresholdBitsPaired(a, v0[h], row_bounds) : ThresholdBitsUnpaired(a, v0[h], row_bounds);
    }
    return kPaired ? ThresholdBitsPaired(a, v0[h], row_bounds, &cols.second_paired_delta[lc / 2])
                   : ThresholdBitsUnpaired(a, v0[h], row_bounds, &cols.second_delta[lc]);
  };
  // word by word, both rows (the paired form went row by row: BandWgmmaKernel<0> spilled 8 bytes that way),
  // every plane from the same values (a pass per plane kept every accumulator live through the first: ptxas
  // spilled hundreds of bytes)
#pragma unroll
  for (int wd = 0; wd < kWords; ++wd) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int plane = 0; plane < kPlanes; ++plane) words[plane][h][wd] = word_bits(plane, h, wd);
    }
  }
  const int out_words = (p.n + 31) / 32;
  const long long row_words = static_cast<long long>(p.planes) * out_words;  // rows of p.planes planes' words
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane) {
    uint32_t* out = static_cast<uint32_t*>(p.out) + plane * out_words;
    const uint32_t* flip_words = plane == 0 ? cols.flip_word : cols.second_flip_word;
    if constexpr (kWords == 2) {
      // two words a row: lanes 0, 1 gather word 0 and lanes 2, 3 word 1, then lanes 0 and 2 store them
      const int wd = t / 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t lo = words[plane][h][0] << (2 * t), hi = words[plane][h][1] << (2 * t);
        uint32_t word = ((t & 2) ? hi : lo) | __shfl_xor_sync(QuadLanes(), (t & 2) ? lo : hi, 2);
        word |= __shfl_xor_sync(QuadLanes(), word, 1);
        if (row_valid[h] && t % 2 == 0 && col0 + 32 * wd < p.n) {
          out[row[h] * row_words + col0 / 32 + wd] = word ^ flip_words[wd];
        }
      }
    } else {
      // The OR over the quad as a reduce-scatter: after two exchanges lane t holds the finished words
      // kPerLane t .. kPerLane t + kPerLane - 1 of each row (3 shuffles per row and 8 words, not 16), which
      // it stores together (one 8-byte store where the rows are 8-byte aligned; stores were 3-8% of the
      // resident kernel's time).
      constexpr int kPerLane = kWords / 4;
      const int first = kPerLane * t;
      const bool pairs = kPerLane == 2 && out_words % 2 == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t half[kWords / 2], mine[kPerLane];
#pragma unroll
        for (int i = 0; i < kWords / 2; ++i) {  // lanes 0, 1 keep the first half, lanes 2, 3 the second
          const uint32_t lo = words[plane][h][i] << (2 * t), hi = words[plane][h][kWords / 2 + i] << (2 * t);
          half[i] = ((t & 2) ? hi : lo) | __shfl_xor_sync(QuadLanes(), (t & 2) ? lo : hi, 2);
        }
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {  // then lanes 0, 2 the first quarter, lanes 1, 3 the second
          const uint32_t lo = half[i], hi = half[kPerLane + i];
          mine[i] = ((t & 1) ? hi : lo) | __shfl_xor_sync(QuadLanes(), (t & 1) ? lo : hi, 1);
          mine[i] ^= flip_words[first + i];
        }
        if (!row_valid[h]) continue;
        uint32_t* dst = out + row[h] * row_words + col0 / 32 + first;
        if (pairs && col0 + 32 * (first + 1) < p.n) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(mine[0], mine[kPerLane - 1]);
        } else {
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) {
            if (col0 + 32 * (first + i) < p.n) dst[i] = mine[i];
          }
        }
      }
    }
  }
}

// RowOrigin of output pixel `pixel` of an unpooled problem.
__device__ __forceinline__ int4 PixelOrigin(const BinaryGemmProblem& p, long long pixel) {
  return RowOrigin(p, static_cast<int>(pixel), 1, 0);
}

// The same for one row (h) whose receptive field may leave the frame, for problems without the
// border-class table: corrections summed per value.
template <int kPlanes, int kAcc>
__device__ __forceinline__ void StoreBitsBorderRow(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                                   const TileColumns<kWgCols>& cols, int v0, long long row,
                                                   bool row_valid, bool border, int h, int col0, int t) {
  constexpr int kWords = kAcc / 16;
  int excl[kAcc / 2];
  if (border) {
    BorderCorrections(p, cols, PixelOrigin(p, row), col0, 2 * t, excl);
  } else {
#pragma unroll 1
    for (int k = 0; k < kAcc / 2; ++k) excl[k] = 0;
  }
  uint32_t words[kPlanes][kWords] = {};
#pragma unroll
  for (int j = 0; j < 4 * kWords; ++j) {
    int2 bound = *reinterpret_cast<const int2*>(&cols.bound[8 * j + 2 * t]);
    const int x0 = 4 * acc[4 * j + 2 * h] + v0 - excl[2 * j], x1 = 4 * acc[4 * j + 2 * h + 1] + v0 - excl[2 * j + 1];
#pragma unroll
    for (int plane = 0; plane < kPlanes; ++plane) {
      if (plane == 1) {
        const int2 d = *reinterpret_cast<const int2*>(&cols.second_delta[8 * j + 2 * t]);
        bound.x += d.x;
        bound.y += d.y;
      }
      words[plane][j / 4] |= static_cast<uint32_t>(x0 >= bound.x) << (8 * (j % 4)) |
                             static_cast<uint32_t>(x1 >= bound.y) << (8 * (j % 4) + 1);
    }
  }
  const int out_words = (p.n + 31) / 32;
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane) {
    uint32_t* out = static_cast<uint32_t*>(p.out) + (row * p.planes + plane) * out_words;
    const uint32_t* flip_words = plane == 0 ? cols.flip_word : cols.second_flip_word;
#pragma unroll
    for (int wd = 0; wd < kWords; ++wd) {
      uint32_t v = words[plane][wd] << (2 * t);
      v |= __shfl_xor_sync(QuadLanes(), v, 1);
      v |= __shfl_xor_sync(QuadLanes(), v, 2);
      if (t == (wd & 3) && row_valid && col0 + 32 * wd < p.n) out[col0 / 32 + wd] = v ^ flip_words[wd];
    }
  }
}

// StoreBitsRows in the form of the problem: paired bounds or not (PairsBounds), the tile's 256 columns or
// (narrow, or m64n128 accumulators) its first 128, or (kQuarter) its first 64; kPlanes threshold planes.
template <bool kClassBounds, bool kQuarter, int kPlanes, int kAcc>
__device__ __forceinline__ void StoreBitsRowsOfProblem(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                                       const TileColumns<kWgCols>& cols, const int (&v0)[2],
                                                       const long long (&row)[2], const bool (&row_valid)[2],
                                                       const int* const (&bounds)[2], int col0, int t, bool paired,
                                                       bool narrow) {
  if constexpr (kQuarter) {
    if (paired) {
      StoreBitsRows<kClassBounds, true, 2, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    } else {
      StoreBitsRows<kClassBounds, false, 2, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    }
  } else if (kAcc == 64 || narrow) {
    if (paired) {
      StoreBitsRows<kClassBounds, true, 4, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    } else {
      StoreBitsRows<kClassBounds, false, 4, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    }
  } else if (paired) {
    StoreBitsRows<kClassBounds, true, kAcc / 16, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
  } else {
    StoreBitsRows<kClassBounds, false, kAcc / 16, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
  }
}

// The two output rows (h = 0, 1) of an accumulator thread: the output pixel, whether it is real, k_real -
// 2 popc(a), and its RowCorrection (0: no "zero"-padding correction).
struct AccumulatorRows {
  long long row[2];
  bool valid[2];
  int v0[2];
  int correction[2];
};

// The excluded taps of a border row's columns lc, lc + 1 (fragment j of its accumulators): its border class's
// row of the table (class_corrections) where the problem keeps one, else its own sums (excl, BorderCorrections).
// The table's row is read in place: summing it per value into a local array (BorderCorrections' form) took
// most of the int32 epilogue's time at 16 x 16 (a 3x3 filter: every warp holds border rows; ncu).
template <int kValues>
__device__ __forceinline__ int2 ExcludedPair(const BinaryGemmProblem& p, const int* class_corrections,
                                             const int (&excl)[kValues], int lc, int j) {
  if (p.correction_table) return *reinterpret_cast<const int2*>(class_corrections + lc);  // lc even: aligned
  return make_int2(excl[2 * j], excl[2 * j + 1]);
}

// The exact ±1 dot products of fragment j (columns lc = 8 j + 2 t and lc + 1 of the tile) of a thread's
// accumulator row h: k_real - 2 popc(a) - 2 popc(b) + 4 popc(a AND b), less a border row's excluded taps
// (ExcludedPair).
template <int kAcc, int kValues>
__device__ __forceinline__ int2 FragmentDots(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                             const AccumulatorRows& rows, const TileColumns<kWgCols>& cols,
                                             const int* class_corrections, const int (&excl)[kValues], bool border,
                                             int h, int j, int t) {
  const int lc = 8 * j + 2 * t;
  int2 d = make_int2(rows.v0[h] - 2 * cols.popc_b[lc] + 4 * acc[4 * j + 2 * h],
                     rows.v0[h] - 2 * cols.popc_b[lc + 1] + 4 * acc[4 * j + 2 * h + 1]);
  if (border) {
    const int2 c = ExcludedPair(p, class_corrections, excl, lc, j);
    d.x -= c.x;
    d.y -= c.y;
  }
  return d;
}

// The int32 stream's residual epilogue (Epilogue::kResidual) of a thread's two accumulator rows
// (StoreAccumulatorRows' layout): stream values, and their bits word by word (a word's 32 columns are fragments
// 4 wd .. 4 wd + 3 of the quad's four lanes); the band kernel's kResidual instances call it in place of
// StoreAccumulatorRows. The shortcut is loaded from global memory, two pairs together ahead of their stores
// (four made the band kernel's generic instances spill; ptxas).
template <int kAcc>
__device__ __forceinline__ void StoreResidualRows(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                  const int (&acc)[kAcc], const AccumulatorRows& rows,
                                                  const TileColumns<kWgCols>& cols, int col0, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!rows.valid[h]) continue;  // the same for the whole quad
    const bool border = rows.correction[h] != 0;
    int excl[kAcc / 2];
    if (border && !p.correction_table) BorderCorrections(p, cols, PixelOrigin(p, rows.row[h]), col0, 2 * t, excl);
    const int* class_corrections = cols.correction[p.correction_table ? rows.correction[h] : 0];
    const long long shortcut = ShortcutOffset(p, r, rows.row[h]);
#pragma unroll
    for (int wd = 0; wd < kAcc / 16; ++wd) {
      if (col0 + 32 * wd >= p.n) break;  // the same for the whole quad
      constexpr int kLoads = 2;
      uint32_t bits = 0;
      int2 added[kLoads];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int j = 4 * wd + q, lc = 8 * j + 2 * t;
        if (q % kLoads == 0) {
#pragma unroll
          for (int i = 0; i < kLoads; ++i) added[i] = ShortcutPair<false>(r, shortcut, col0 + lc + 8 * i);
        }
        // FragmentDots written out, as measured: through it, ptxas scheduled 10-23 instructions of a residual
        // kernel differently (cubin .text)
        int d0 = rows.v0[h] - 2 * cols.popc_b[lc] + 4 * acc[4 * j + 2 * h];
        int d1 = rows.v0[h] - 2 * cols.popc_b[lc + 1] + 4 * acc[4 * j + 2 * h + 1];
        if (border) {
          const int2 c = ExcludedPair(p, class_corrections, excl, lc, j);
          d0 -= c.x;
          d1 -= c.y;
        }
        bits |= StoreResidualPair<false>(p, r, added[q % kLoads], rows.row[h], true, col0 + lc, d0, d1) << (8 * q);
      }
      if (r.bits != nullptr) StoreStreamWord(p, r, rows.row[h], true, col0 + 32 * wd, bits, t, QuadLanes());
    }
  }
}

// One word of the narrow residual epilogue (StoreStagedResidualRows) in row h: the stream values of fragments 4 wd
// .. 4 wd + 3 (columns col0 + 32 wd ..) and their bits. The value of column lc is (4 acc + v0 - table[lc] - its
// own correction) >> shift plus the staged shortcut, wrapped to int16: `table` is the row's border class's row of
// the table, whose entries hold 2 popc(b) too (FillCorrectionTable's with_popcount; row 0: 2 popc(b) alone), and
// kOwnCorrections adds the row's own sums (excl, for border rows of problems without the table). The shortcut pair
// is added to the low value in one word and to the high value shifted up by 16 in another (the low sum's carry
// falls out of its 16 bits; the high sum has the low shortcut below it), so each word holds a value's int16: the
// stored pair is their halves, and the bits compare the high one, and the low one shifted up, with StreamColumns'
// scaled bounds as they are (no sign extension). kQuadStores: rows of a multiple of 4
// columns and an 8-byte-aligned output, whose four values a lane and its neighbour exchange for one 8-byte store
// at `dst` (this lane's first column of the row, + 8 per fragment); else StoreInt16Fragments per pair. kPlanes:
// the stream bits' threshold planes (1 or 2), plane q's word at bits_row[q words + wd]. kShifted: the dots are
// shifted (r.shift, which is 0 in the binary blocks: without it, no shift per value, and the high value's
// shift and add fold into one multiply-add).
template <bool kQuadStores, bool kOwnCorrections, int kPlanes, bool kShifted, int kAcc>
__device__ __forceinline__ void StoreStagedResidualWord(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                        const int (&acc)[kAcc], const AccumulatorRows& rows,
                                                        const int* table, const int (&excl)[kAcc / 2],
                                                        const uint8_t* staged, const StreamColumns<2 * kAcc>& stream,
                                                        int16_t* dst, uint32_t* bits_row, int words, int col0,
                                                        int h, int wd, int t) {
  const int v0 = rows.v0[h];
  const bool odd = t & 1;
  uint32_t bits[kPlanes] = {};
#pragma unroll
  for (int q = 0; q < 4; q += 2) {
    uint32_t packed[2];
    int v[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // fragments j and j + 1: the four values of one 8-byte store
      const int j = 4 * wd + q + e, lc = 8 * j + 2 * t;
      const int2 subtracted = *reinterpret_cast<const int2*>(table + lc);  // lc even: aligned
      const int2 bound = *reinterpret_cast<const int2*>(stream.scaled_bound + lc);
      const uint32_t shortcut = *reinterpret_cast<const uint32_t*>(staged + 16 * j);
      int d0 = 4 * acc[4 * j + 2 * h] + v0 - subtracted.x, d1 = 4 * acc[4 * j + 2 * h + 1] + v0 - subtracted.y;
      if constexpr (kOwnCorrections) {
        d0 -= excl[2 * j];
        d1 -= excl[2 * j + 1];
      }
      const int shift = kShifted ? r.shift : 0;
      const uint32_t lo = static_cast<uint32_t>(d0 >> shift) + shortcut;
      const uint32_t hi = (static_cast<uint32_t>(d1 >> shift) << 16) + shortcut;
      v[2 * e] = static_cast<int16_t>(lo);  // (the general form's stores)
      v[2 * e + 1] = static_cast<int>(hi) >> 16;
      packed[e] = __byte_perm(lo, hi, 0x7610);  // lo's low half, hi's high half
      const int lo_up = static_cast<int>(lo << 16), hi_up = static_cast<int>(hi);
      const uint32_t at = 1u << (8 * (q + e));  // the pair's bits, at and 2 at
      bits[0] |= (lo_up >= bound.x ? at : 0u) | (hi_up >= bound.y ? 2 * at : 0u);
      if constexpr (kPlanes == 2) {
        const int2 second = *reinterpret_cast<const int2*>(stream.second_scaled_bound + lc);
        bits[1] |= (lo_up >= second.x ? at : 0u) | (hi_up >= second.y ? 2 * at : 0u);
      }
    }
    if constexpr (kQuadStores) {
      const uint32_t other = __shfl_xor_sync(kWarpLanes, odd ? packed[0] : packed[1], 1);
      const int col = col0 + 8 * (4 * wd + q) + (odd ? 6 + 2 * t : 2 * t);  // a multiple of 4
      if (rows.valid[h] && col < p.n) {
        *reinterpret_cast<uint2*>(dst + 8 * (4 * wd + q)) = odd ? make_uint2(other, packed[1]) : make_uint2(packed[0], other);
      }
    } else {
      StoreInt16Fragments(p, rows.row[h], rows.valid[h], col0 + 8 * (4 * wd + q), t, v[0], v[1], v[2], v[3],
                          kWarpLanes);
    }
  }
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane) {
    uint32_t word = bits[plane] << (2 * t);
    word |= __shfl_xor_sync(kWarpLanes, word, 1);
    word |= __shfl_xor_sync(kWarpLanes, word, 2);
    if (r.bits != nullptr && rows.valid[h] && t == (col0 / 32 + wd) % 4) {
      bits_row[plane * words + wd] = word ^ stream.flip_word[plane][wd];
    }
  }
}

// StoreStagedResidualRows in one form (StoreStagedResidualWord's kQuadStores, kOwnCorrections, kPlanes, kShifted):
// own[h], whether row h takes its own corrections (kOwnCorrections only).
template <bool kQuadStores, bool kOwnCorrections, int kPlanes, bool kShifted, int kAcc>
__device__ __forceinline__ void StoreStagedResidualRowsAs(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                          const int (&acc)[kAcc], const AccumulatorRows& rows,
                                                          const TileColumns<kWgCols>& cols, const uint8_t* stage,
                                                          const StreamColumns<2 * kAcc>& stream, const bool (&own)[2],
                                                          int col0, int g, int t) {
  const int words = (p.n + 31) / 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int* table = cols.correction[p.correction_table ? rows.correction[h] : 0];
    const uint8_t* staged = stage + (g + 8 * h) * kStagedRowBytes<2 * kAcc> + 4 * t;
    const long long row = rows.row[h];
    int16_t* dst = static_cast<int16_t*>(p.out) + row * p.n + col0 + ((t & 1) ? 6 + 2 * t : 2 * t);
    uint32_t* bits_row = r.bits + row * kPlanes * words + col0 / 32;
    int excl[kAcc / 2];
    if constexpr (kOwnCorrections) {
      if (own[h]) {
        BorderCorrections(p, cols, PixelOrigin(p, row), col0, 2 * t, excl);
      } else {
#pragma unroll 1
        for (int k = 0; k < kAcc / 2; ++k) excl[k] = 0;
      }
    }
#pragma unroll
    for (int wd = 0; wd < kAcc / 16; ++wd) {
      if (col0 + 32 * wd >= p.n) break;  // the same for the whole warp
      StoreStagedResidualWord<kQuadStores, kOwnCorrections, kPlanes, kShifted>(p, r, acc, rows, table, excl, staged,
                                                                               stream, dst, bits_row, words, col0, h,
                                                                               wd, t);
    }
  }
}

// The narrow residual epilogue (kResidualInt16) of a thread's two accumulator rows of a tile whose columns start at
// col0 (kAcc / 4 fragments of 8 columns: 128 columns of m64n128 accumulators, or 256 of m64n256), their shortcut
// staged (StageShortcut<2 kAcc>: the warp's stage, this thread's rows at g and g + 8): the stream's int16 values in
// 8-byte stores of four, and their bits word by word against the tile's StreamColumns. Called by every lane of the
// warp (its rows past the output computed but not stored: the shuffles span the warp). Each row's addresses are
// formed once, and each pair of values takes its class's entries and its bounds in two shared loads: the form
// that loaded popc(b), the bounds and the class corrections apart, tested for a border row per fragment and formed
// each store's 64-bit address ran about 26 instructions a value (ncu, the band kernel at C = 64). Warps with a
// border row of a problem without the table (rows with corrections of their own), and outputs that take no 8-byte
// stores, run the general form. Two threshold planes (a ternary conv1's input) take forms of their own, and the
// 8-byte-store forms of 128-column tiles one without the dots' shift (r.shift == 0: the binary blocks) where
// kUnshiftedForms (the band kernel's runtime-length instance leaves them out: the zoo's blocks that take it are
// ternary, always shifted, and with them it spilled 4 bytes).
template <bool kUnshiftedForms = true, int kAcc>
__device__ __forceinline__ void StoreStagedResidualRows(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                        const int (&acc)[kAcc], const AccumulatorRows& rows,
                                                        const TileColumns<kWgCols>& cols, const uint8_t* stage,
                                                        const StreamColumns<2 * kAcc>& stream, int col0, int g, int t) {
  static_assert(kAcc == 64 || kAcc == 128, "the m64n128 or m64n256 accumulators");
  bool own[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) own[h] = !p.correction_table && rows.valid[h] && rows.correction[h] != 0;
  const bool quads = p.n % 4 == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
  const bool general = !quads || __any_sync(kWarpLanes, own[0] || own[1]);
  // the unshifted forms for m64n128 accumulators only: with them, the 256-column resident instances spilled
  // 20-28 bytes (ptxas)
  const bool shifted = !kUnshiftedForms || kAcc != 64 || r.shift != 0;
  if (r.planes == 1) {
    if (!general) {
      if (shifted) {
        StoreStagedResidualRowsAs<true, false, 1, true>(p, r, acc, rows, cols, stage, stream, own, col0, g, t);
      } else {
        StoreStagedResidualRowsAs<true, false, 1, false>(p, r, acc, rows, cols, stage, stream, own, col0, g, t);
      }
    } else {
      StoreStagedResidualRowsAs<false, true, 1, true>(p, r, acc, rows, cols, stage, stream, own, col0, g, t);
    }
  } else if (!general) {
    if (shifted) {
      StoreStagedResidualRowsAs<true, false, 2, true>(p, r, acc, rows, cols, stage, stream, own, col0, g, t);
    } else {
      StoreStagedResidualRowsAs<true, false, 2, false>(p, r, acc, rows, cols, stage, stream, own, col0, g, t);
    }
  } else {
    StoreStagedResidualRowsAs<false, true, 2, true>(p, r, acc, rows, cols, stage, stream, own, col0, g, t);
  }
}

// The int32 / affine values of a thread's two accumulator rows (StoreAccumulatorRows' layout), or with kInt16
// the int16 ones (StoreInt16Fragments: lanes exchange values, so every lane of the warp calls it, its rows past
// the output computed but not stored). border[h]: row h is real and takes "zero"-padding corrections.
template <bool kInt16, int kAcc>
__device__ __forceinline__ void StoreValueRows(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                               const AccumulatorRows& rows, const bool (&border)[2],
                                               const TileColumns<kWgCols>& cols, int col0, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!kInt16 && !rows.valid[h]) continue;
    int excl[kAcc / 2];
    if (border[h] && !p.correction_table) BorderCorrections(p, cols, PixelOrigin(p, rows.row[h]), col0, 2 * t, excl);
    const int* class_corrections = cols.correction[p.correction_table ? rows.correction[h] : 0];
    auto values = [&](int j) { return FragmentDots(p, acc, rows, cols, class_corrections, excl, border[h], h, j, t); };
    if constexpr (kInt16) {
#pragma unroll
      for (int j = 0; j < kAcc / 4; j += 2) {
        if (col0 + 8 * j >= p.n) break;  // the same for the whole quad
        const int2 lo = values(j), hi = values(j + 1);
        StoreInt16Fragments(p, rows.row[h], rows.valid[h], col0 + 8 * j, t, lo.x, lo.y, hi.x, hi.y, kWarpLanes);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kAcc / 4; ++j) {
        // Leaving at the first fragment past N (the same for the whole quad) skips the rest of the unrolled
        // fragments' code; stepping through it, a 10-column classifier's one-tile CTAs fetched all of it cold
        // (ncu: "no instruction" stalls).
        if (col0 + 8 * j >= p.n) break;
        const int lc = 8 * j + 2 * t, col = col0 + lc;
        if (col >= p.n) continue;
        const int2 d = values(j);
        StorePair(p, rows.row[h], col, d.x, d.y, cols.scale[lc], cols.bias[lc], cols.scale[lc + 1], cols.bias[lc + 1]);
      }
    }
  }
}

// The threshold bits of kPlanes planes of a thread's two accumulator rows (StoreAccumulatorRows' kBits form).
// border[h]: row h is real and takes "zero"-padding corrections.
template <int kPlanes, bool kQuarter, int kAcc>
__device__ __forceinline__ void StoreBitsPlanes(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                               const AccumulatorRows& rows, const bool (&border)[2],
                                               const TileColumns<kWgCols>& cols, int col0, int t, bool narrow) {
  const int(&v0)[2] = rows.v0;
  const int(&correction)[2] = rows.correction;
  const long long(&row)[2] = rows.row;
  const bool(&row_valid)[2] = rows.valid;
  // One code path per problem where possible: the epilogue is fetch-bound (ncu: "no instruction" was
  // the first stall reason), and warps of one CTA in two variants fetch twice the code.
  // (a problem takes one of the paired and unpaired forms in all its tiles)
  const bool paired = PairsBounds(p);
  if (p.correction_table) {
    // every row compares with its border class's bounds; class 0 (inside the frame) holds the plain ones
    const int* const bounds[2] = {cols.correction[border[0] ? correction[0] : 0],
                                  cols.correction[border[1] ? correction[1] : 0]};
    StoreBitsRowsOfProblem<true, kQuarter, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t, paired, narrow);
  } else if (!__any_sync(0xffffffffu, border[0] || border[1])) {
    // one path per warp: a warp whose quads took both paths would run both
    const int* const plain = paired ? cols.correction[0] : cols.bound;
    const int* const bounds[2] = {plain, plain};
    StoreBitsRowsOfProblem<false, kQuarter, kPlanes>(p, acc, cols, v0, row, row_valid, bounds, col0, t, paired, narrow);
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      StoreBitsBorderRow<kPlanes>(p, acc, cols, v0[h], row[h], row_valid[h], border[h], h, col0, t);
    }
  }
}

// The epilogue straight from the wgmma accumulators (no pool) of thread (warp w, lane g*4+t) of a consumer
// warpgroup, which holds rows 16 w + g (+8) of the warpgroup's 64 and columns 8 j + 2 t (+1).
// narrow: the tile has at most 128 columns, so only the first 64 accumulators hold real columns (an m64n256
// wgmma still computes all 256). kAcc: 128 (m64n256 accumulators) or 64 (m64n128: always narrow).
// kQuarter: at most 64 columns (the threshold bits of the first 32 accumulators only).
template <int kAcc, bool kQuarter = false>
__device__ __forceinline__ void StoreAccumulatorRows(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                                     const AccumulatorRows& rows, const TileColumns<kWgCols>& cols,
                                                     int col0, int t, bool narrow) {
  bool border[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) border[h] = rows.valid[h] && rows.correction[h] != 0;
  if (p.epilogue == Epilogue::kBits) {
    if (p.planes > 1) {
      StoreBitsPlanes<2, kQuarter>(p, acc, rows, border, cols, col0, t, narrow);
    } else {
      StoreBitsPlanes<1, kQuarter>(p, acc, rows, border, cols, col0, t, narrow);
    }
    return;
  }
  if (p.epilogue == Epilogue::kInt16) {
    StoreValueRows<true>(p, acc, rows, border, cols, col0, t);
  } else {
    StoreValueRows<false>(p, acc, rows, border, cols, col0, t);
  }
}

// StoreAccumulatorRows for consumer half `half` of a 128-row tile of consecutive output pixels: rows
// 64 half + 16 w + g (+8). row_correction: RowCorrection of every tile row.
template <int kAcc>
__device__ __forceinline__ void StoreAccumulators(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                                  const int* popc_a, const int8_t* row_correction,
                                                  const TileColumns<kWgCols>& cols, int tile_m, int col0, int half,
                                                  int wtid, bool narrow) {
  const int w = wtid / 32, lane = wtid % 32, g = lane / 4, t = lane % 4;
  AccumulatorRows rows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 64 * half + 16 * w + g + 8 * h;
    rows.row[h] = static_cast<long long>(tile_m) * kWgRows + r;
    rows.valid[h] = rows.row[h] < p.pooled_rows;
    rows.v0[h] = p.k_real - 2 * popc_a[r];
    rows.correction[h] = p.pad_one ? 0 : row_correction[r];  // filled for "zero" padding only
  }
  StoreAccumulatorRows(p, acc, rows, cols, col0, t, narrow);
}

// StageShortcut of a wgmma kernel's consumer warp: the 16 rows of warp wtid / 32 of warpgroup `half` in row tile
// tile_m, each row's shortcut element found with the launch's divisors (ShortcutOffset's divisions per copy: 10-20%
// of the kernel's time).
template <int kCols>
__device__ __forceinline__ void StageWarpShortcut(const BinaryGemmProblem& p, const ResidualOperands& residual,
                                                  const LaunchDivisors& div, uint8_t* stage, int tile_m, int col0,
                                                  int half, int wtid) {
  const long long warp_row = static_cast<long long>(tile_m) * kWgRows + 64 * half + 16 * (wtid / 32);
  auto shortcut_of = [&](int i, long long& at) {
    const long long row = warp_row + i;
    if (row >= p.pooled_rows) return false;
    if (residual.stride == 1) {
      at = row * residual.channels;
    } else {
      const int pixel = static_cast<int>(row), b = Quotient(pixel, div.image_pixels);
      const int in_image = pixel - b * div.image_pixels.divisor, oh = Quotient(in_image, div.out_w);
      at = ShortcutOffsetAt(residual, b, oh, in_image - oh * div.out_w.divisor);
    }
    return true;
  };
  StageShortcut<kCols, false>(p, residual, stage, shortcut_of, col0, min(kCols, p.n - col0), wtid % 32);
}

// StoreAccumulators with the narrow stream's residual epilogue (the resident kernel's kResidual instances), the
// shortcut of this thread's warp staged at `stage` (StageShortcut<2 kAcc>) and the tile's StreamColumns; the rows
// as StoreAccumulators sets them up.
template <int kAcc>
__device__ __forceinline__ void StoreStagedResidualAccumulators(const BinaryGemmProblem& p,
                                                                const ResidualOperands& residual,
                                                                const int (&acc)[kAcc], const int* popc_a,
                                                                const int8_t* row_correction,
                                                                const TileColumns<kWgCols>& cols, const uint8_t* stage,
                                                                const StreamColumns<2 * kAcc>& stream, int tile_m, int col0,
                                                                int half, int wtid) {
  const int w = wtid / 32, lane = wtid % 32, g = lane / 4, t = lane % 4;
  AccumulatorRows rows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 64 * half + 16 * w + g + 8 * h;
    rows.row[h] = static_cast<long long>(tile_m) * kWgRows + r;
    rows.valid[h] = rows.row[h] < p.pooled_rows;
    rows.v0[h] = p.k_real - 2 * popc_a[r];
    rows.correction[h] = p.pad_one ? 0 : row_correction[r];
  }
  StoreStagedResidualRows(p, residual, acc, rows, cols, stage, stream, col0, g, t);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace jaxbnn::cuda

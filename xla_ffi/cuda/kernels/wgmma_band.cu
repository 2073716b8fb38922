// Image-band wgmma kernel (sm_90a): stride-1 convolutions of at most 128 output channels whose taps are
// whole 16-byte chunks of channels (C a multiple of 128, one chunk per tap or an even number of them) or
// 8-byte halves of one (C = 64: pixel pairs, below), unpooled.
//
// A CTA keeps its column tile's weights and a band of input rows of one image in shared memory. In the
// band, the zero-padded frame (the TMA unit fills out-of-frame pixels with zeros) lies row after row,
// Wp = out_w + kw - 1 positions per row, 16 bytes per position in each of the P = cw / 4 channel planes (a
// pixel that each tap reads twice, x_cw = cw / 2: its P / 2 stored planes, each read for two chunks).
// Output position q = oy Wp + ox takes tap (i, j) of chunk c from position q + i Wp + j of plane c: 64
// consecutive positions are 64 rows of 16 contiguous bytes, a no-swizzle wgmma operand (8-row groups 128
// bytes apart) whatever the tap. So each k256 step's A operand is the band itself at a shifted start, and
// the implicit GEMM runs without a gather, a ring of stages or a producer: the resident kernel's k loop of
// then (barriers, TMA boxes per K block, row-popcount loads) is gone, and C = 128 was bound by exactly that. A k256 step takes two consecutive chunks of K, as the FSB weights hold
// them; their distance in the band (the descriptor's LBO) is positive where P = 1 (taps t and t + 1) or P
// is even (planes 2c and 2c + 1 of one tap). Positions with ox >= out_w are computed and dropped: (kw - 1)
// / Wp of the rows. popc(a) comes from the tensor cores: 16 columns of all ones after B's 128 (an m64n144
// wgmma per step), whose AND-popc with a row is its receptive field's popcount (out-of-frame positions are
// zeros, as for the other kernels; "zero" padding takes its correction in the epilogue).
//
// Pixel pairs (C = 64, 8 bytes a position): a 16-byte chunk is two neighbouring positions, so a k256 step
// takes four positions of one filter row, and the weights of a position outside the filter are zeros (the
// all-ones columns' too: AND-popc then counts nothing there, and popc(a) covers the real taps only; 3x3:
// 768 bits of K a filter row for 576 real). A tile's 64 rows are every other position (q0, q0 + 2, ...,
// q0 + 126; the two tiles of a 128-position block start at its positions 0 and 1), 16 bytes apart as the
// wgmma operand wants them. A chunk must start 16-byte aligned, so the tiles whose rows start at an even
// band position take the filter row's columns 0 .. 3, 4 .. 7, ..., the others -1 .. 2, 3 .. 6, ...: two sets
// of weights (and all-ones columns), one per parity, over the same band. The TMA unit reads boxes whose first
// pixel is 16-byte aligned in global memory only, so the band starts at an even input column: one column left
// of the padded frame where the left padding is odd (that column is never a real tap). Wp, the band's row,
// is even and at least out_w + kw - 1 (+ 1 for that column); its spare positions are dropped columns. Tiles
// come in pairs, so the bands, items and segments of 64-position tiles hold unchanged.
//
// m64n128 wgmmas over four consumer warpgroups of 64 accumulators (the register file holds no more): where
// the tile's columns were 256 wide (two warpgroups of m64n256) or N > 128 (column tiles of 128), the band
// lost to the resident kernel.
//
// A work item is a run of consecutive 64-position tiles; its band is every input row those tiles read. The
// tiles of image b are b * image_tiles .. + tiles_per_image - 1 (image_tiles >= tiles_per_image: the slots
// past an image's tiles are empty). Where image_tiles is a multiple of tiles_per_item, items stay within
// an image; else an item may run from the end of one image into the start of the next, and its band is
// two segments, one per image, each in its own slot of the band buffer: so that every SM takes an equal
// share where images do not divide evenly (16 images of 66 tiles: 8 tiles on each of 132 SMs, not 9 on
// 128: two rounds of tiles over the four warpgroups instead of three).
// CTA b takes items b, b + ctas, ... into two band buffers (the next item's band loads while the current
// one's tiles run); its warpgroups take the tiles of its items in turn, counted across items, and go on to
// the next item without waiting for each other: the last warpgroup done with a buffer loads the item after
// next into it. Five tiles an item (16 x 16 images) over four warpgroups took two tile times a round when
// every item started at warpgroup 0 and the CTA synchronized after each item.
#include "cuda/kernels/wgmma_band.h"

#include <cstdint>
#include <cuda.h>

#include "cuda/binary_gemm.h"
#include "cuda/device/column_parameters.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/geometry.cuh"
#include "cuda/device/pipeline.cuh"
#include "cuda/device/sm90.cuh"
#include "cuda/device/tile_columns.cuh"
#include "cuda/device/wgmma_b1.cuh"
#include "cuda/device/wgmma_epilogue.cuh"
#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The filter column of half `half` of chunk k in weight set `set` (0: from column 0, 1: from column -1).
__device__ __forceinline__ int PixelPairColumn(const BinaryGemmProblem& p, int k, int half, int set) {
  return 4 * (k / 2 % PixelPairStepsPerRow(p.kw)) + 2 * (k % 2) + half - set;
}

// Pixel pairs: both weight sets in shared memory as the steps read them (the FSB tiles hold K tap after tap,
// 2 words each; chunk k holds the taps of PixelPairColumn), zeros outside the filter and past N. A gather
// by every thread of the CTA (2 x kBandCols x k_tiles x 2 loads of 8 bytes).
__device__ __forceinline__ void LoadPixelPairWeights(const BinaryGemmProblem& p, const BandLayout& b,
                                                     uint8_t* weights, int tid) {
  for (int i = tid; i < 2 * kBandCols * b.k_tiles * 2; i += kBandThreads) {
    const int set = i / (kBandCols * b.k_tiles * 2), col = i / (2 * b.k_tiles) % kBandCols;
    const int k = i / 2 % b.k_tiles, half = i % 2;
    const int dy = k / 2 / PixelPairStepsPerRow(p.kw), dx = PixelPairColumn(p, k, half, set);
    uint2 v = make_uint2(0, 0);
    if (col < p.n && dx >= 0 && dx < p.kw) {
      const int word = 2 * (dy * p.kw + dx);  // the tap's first K word: even, so 8-byte aligned in its tile
      const size_t tile = static_cast<size_t>(col / 8) * p.w_k_tiles + word / 4;
      v = __ldg(reinterpret_cast<const uint2*>(p.w + tile * 32 + col % 8 * 4 + word % 4));
    }
    *reinterpret_cast<uint2*>(weights + set * WeightSetBytes(b) + (col / 8 * b.k_tiles + k) * 128 + col % 8 * 16 +
                              half * 8) = v;
  }
}
// The first output row of segment s of item `it`'s band (the second segment starts its image).
__device__ __forceinline__ int BandFirstRow(const BandLayout& band, const BandItem& it, int s) {
  return s == 0 ? Quotient(64 * it.first_tile, band.padded_w) : 0;
}

// One thread copies item `it`'s band into buffer `buffer` (at dst), arriving on its barrier `full`: one 3-D
// box of whole padded rows per segment (pixel pairs: from the even column at or left of the frame's first;
// one plane of C = 128), else one 4-D box per stored channel plane and segment.
template <bool kPixelPairs>
__device__ __forceinline__ void CopyBand(const BinaryGemmProblem& p, const BandLayout& band, const CUtensorMap& band_map,
                                         const BandItem& it, uint32_t dst, uint32_t full) {
  const int segments = it.tiles[1] > 0 ? 2 : 1, planes = StoredBandPlanes(p);
  const int position_bytes = kPixelPairs ? 8 : 16, odd_pad = kPixelPairs ? p.pad_left & 1 : 0;
  BarrierArriveExpectBytes(full, segments * planes * band.band_rows * band.padded_w.divisor * position_bytes);
  for (int s = 0; s < segments; ++s) {
    if (kPixelPairs) {
      TensorCopy3d(dst + s * band.slot_positions * 8, band_map, -p.pad_left - odd_pad,
                   BandFirstRow(band, it, s) - p.pad_top, it.image + s, full);
      continue;
    }
    if (band.whole_rows) {
      TensorCopy3d(dst + s * band.slot_positions * 16, band_map, -2 * p.pad_left, BandFirstRow(band, it, s) - p.pad_top,
                   it.image + s, full);
      continue;
    }
    for (int c = 0; c < planes; ++c) {
      TensorCopy4d(dst + c * band.plane_bytes + s * band.slot_positions * 16, band_map, 16 * c, -p.pad_left,
                   BandFirstRow(band, it, s) - p.pad_top, it.image + s, full);
    }
  }
}

// The set-up that depends on the parameters only, before `griddepcontrol.wait`: the odd last chunk's zero
// partner, the all-ones row groups and the steps' A descriptors. `from_last` counts the CTA's threads from its
// last, so that these small jobs go to the warps that do not issue the copies: each piece was one thread's
// dependent chain of ~0.5-0.7 us, however few its instructions (clock64 trace).
//
// The odd last chunk's partner (P = 1, an odd number of taps): zero weights, so its A bytes count nothing.
// The all-ones row groups: ones over the real chunks, zeros over the odd partner. AND-popc with them is
// popc(A) of the row's receptive field, computed with the tile's dot products by the same wgmma as the
// weights' columns (the position popcounts of each band, a pass over it before its first tile, and their
// window sums per row took ~0.4 us of the first tile's start; an m64n128 and an m64n8 wgmma per step before).
// Pixel pairs: ones over the halves of real taps, in both sets.
// Step s takes chunks 2s, 2s + 1 of K: chunk k is plane k % P of tap k / P, at plane_bytes (k % P) + 16 (i Wp
// + j) from the band's start for tile position 0 (a repeated pixel's plane k % P read from stored plane
// k % P % (x_cw / 4)) (the partner of an odd last chunk: 16 bytes on). Pixel pairs:
// step s of filter row dy reads four positions from dy Wp + 4 (s % steps per row) on, relative to the tile's
// first aligned one (the tile adds it); its two 16-byte chunks lie 16 bytes apart.
template <bool kPixelPairs>
__device__ __forceinline__ void PrepareBandOperands(const BinaryGemmProblem& p, const BandLayout& band,
                                                    const BandSmem& at, uint8_t* smem, uint64_t* step_desc,
                                                    uint32_t base, int from_last) {
  const int wp = band.padded_w.divisor, planes = band.planes.divisor, chunks = p.kh * p.kw * planes;
  if (!kPixelPairs && band.k_tiles > chunks) {
    for (int i = from_last; i < kBandCols / 8 * 8; i += kBandThreads) {
      *reinterpret_cast<uint4*>(smem + at.weights + (i / 8 * band.k_tiles + chunks) * 128 + i % 8 * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }
  const int ones_per_set = kOnesGroups * band.k_tiles * 8;  // 16-byte rows
  for (int i = from_last; i < (kPixelPairs ? 2 : 1) * ones_per_set; i += kBandThreads) {
    const int set = i / ones_per_set, k = i / 8 % band.k_tiles;
    uint32_t first = k < chunks ? 0xffffffffu : 0u, second = first;
    if (kPixelPairs) {
      const int dx = PixelPairColumn(p, k, 0, set);
      first = dx >= 0 && dx < p.kw ? 0xffffffffu : 0u;
      second = dx + 1 >= 0 && dx + 1 < p.kw ? 0xffffffffu : 0u;
    }
    *reinterpret_cast<uint4*>(smem + at.ones + set * WeightSetBytes(band) + 16 * (i % ones_per_set)) =
        make_uint4(first, first, second, second);
  }
  const int stored = StoredBandPlanes(p);
  auto chunk_offset = [&](int k) {
    const int tap = Quotient(k, band.planes), c = k - tap * planes;
    const int i = Quotient(tap, band.kw);  // tap (i, j) at i Wp + j
    // plane c of a tap that reads its pixel twice: stored plane c % stored (two chunks of one step may then
    // be the same bytes: a leading byte offset of 0)
    return (c < stored ? c : c - stored) * band.plane_bytes + 16 * (i * wp + tap - i * p.kw);
  };
  for (int s = from_last; s < band.steps; s += kBandThreads) {
    if (kPixelPairs) {
      const int dy = s / PixelPairStepsPerRow(p.kw);
      step_desc[s] = OperandDescriptor(base + 8 * (dy * wp + PixelPairColumn(p, 2 * s, 0, 0)), 16, 128);
    } else {
      const int first = chunk_offset(2 * s);
      const int along_k = 2 * s + 1 < chunks ? chunk_offset(2 * s + 1) - first : 16;
      step_desc[s] = OperandDescriptor(base + first, along_k, 128);
    }
  }
}

// Warp 1 copies the weights' row tiles as they lie in global memory, one bulk copy per row tile.
__device__ __forceinline__ void CopyBandWeights(const BinaryGemmProblem& p, const BandLayout& band, uint32_t weights,
                                                uint32_t weights_full, int lane) {
  const int row_tiles = p.w_row_tiles;
  const uint32_t row_bytes = p.w_k_tiles * 128;
  if (lane == 0) BarrierArriveExpectBytes(weights_full, row_tiles * row_bytes);
  __syncwarp();
  for (int j = lane; j < row_tiles; j += 32) {
    BulkCopy(weights + j * band.k_tiles * 128, p.w + static_cast<size_t>(j) * p.w_k_tiles * 32, row_bytes,
             weights_full);
  }
}

// The column table, a column per thread of each warpgroup: the last one also fills the other parameters, and
// every one a quarter of the border classes (so that the classes' sums run 4 chains a column), each class
// already holding its bound (the thread computes the bound itself: no second barrier). A column's tap
// popcounts and threshold are loaded together, one round trip to L2. "Zero" padding's set-up, from the CTA's
// start: one warpgroup filling all, 4.2 us; the parameters by another warpgroup, 4.0; the table over four,
// 3.5; this form, 3.3 (the loads were not what "zero" spends over "one"). narrow_stream: the table (or without
// one, its row 0) as the narrow residual epilogue reads it, 2 popc(b) in every entry (StoreStagedResidualRows).
__device__ __forceinline__ void FillBandColumns(const BinaryGemmProblem& p, TileColumns<kWgCols>& cols, int wg,
                                                int wtid, bool narrow_stream) {
  static_assert(kBandCols == 128, "a column per thread of each warpgroup");
  constexpr int col0 = 0;  // N <= 128: one column tile
  if (p.correction_table) {
    const ColumnThreshold th = LoadColumnThreshold(p, col0 + wtid);
    const bool class_bounds = p.epilogue == Epilogue::kBits;
    const int popc_b =
        FillCorrectionTable<kWgCols>(p, cols, col0, wtid, wg, kBandWarpgroups, class_bounds, th, narrow_stream);
    if (wg == kBandWarpgroups - 1) FillColumnParameters<kWgCols>(p, cols, col0, wtid, popc_b, th);
  } else if (wg == kBandWarpgroups - 1) {
    FillTileColumn<kWgCols>(p, cols, col0, wtid);
    if (narrow_stream) cols.correction[0][wtid] = 2 * cols.popc_b[wtid];
  } else if (wg == 0 && p.edge_table) {
    FillEdgeTable<kWgCols>(p, cols, col0, wtid);
  }
}

// A tile's k256 steps (kUnrolledSteps, kExactSteps: below) and their commit: AND-popc of the band at a_shift
// (16-byte units from step_desc's addresses) against the weight set at b_set and its all-ones columns.
template <int kUnrolledSteps, bool kExactSteps>
__device__ __forceinline__ void IssueBandSteps(int (&acc)[kBandCols / 2], int (&popc_a)[8], const uint64_t* step_desc,
                                               uint32_t a_shift, uint32_t b_set, const BandLayout& band) {
  auto step = [&](int s) {
    wgmma_m64n144k256_and_popc(acc, popc_a, step_desc[s] + a_shift,
                               OperandDescriptor(b_set + s * 256, 128, band.k_tiles * 128), s != 0);
  };
  if constexpr (kExactSteps) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < kUnrolledSteps; ++s) step(s);
  } else if constexpr (kUnrolledSteps > 0) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < kUnrolledSteps; ++s) {
      if (s == band.steps) break;
      step(s);
    }
  } else {
    // a fence per step, as ptxas would inject one in a loop of runtime length (C7519)
#pragma unroll 1
    for (int s = 0; s < band.steps; ++s) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      step(s);
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Band position q of an image (q = oy Wp + ox): its output pixel (oy, ox), whether it is one, and its border
// correction (AccumulatorRows::correction: its class, 1 for corrections of its own, 0 for none).
struct BandPosition {
  int oy, ox, correction;
  bool valid;
};
__device__ __forceinline__ BandPosition BandPositionOf(const BinaryGemmProblem& p, const BandLayout& band, int q) {
  BandPosition pos;
  pos.oy = Quotient(q, band.padded_w);
  pos.ox = q - pos.oy * band.padded_w.divisor;
  pos.valid = pos.oy < p.out_h && pos.ox < p.out_w;
  const FrameExcess e = ExcessOf(p, pos.oy - p.pad_top, pos.ox - p.pad_left);
  const bool border = !p.pad_one && pos.valid && e.top + e.bottom + e.left + e.right > 0;
  pos.correction = border ? (p.correction_table ? BorderClass(p, e) : 1) : 0;
  return pos;
}
// Band position q from the tile rows' table (band.row_table) where there is one, else computed.
__device__ __forceinline__ BandPosition BandPositionAt(const BinaryGemmProblem& p, const BandLayout& band,
                                                       const int* row_table, int q) {
  if (band.row_table == 0) return BandPositionOf(p, band, q);
  const int entry = row_table[q];
  return {entry & 0xfff, entry >> 12 & 0xfff, entry >> 24 & 0x7f, entry >= 0};
}
// Fills the tile rows' table (where the layout has one), thread `tid` of the CTA every kBandThreads-th entry.
__device__ __forceinline__ void FillBandRowTable(const BinaryGemmProblem& p, const BandLayout& band, int* row_table,
                                                 int tid) {
  for (int q = tid; q < band.row_table; q += kBandThreads) {
    const BandPosition pos = BandPositionOf(p, band, q);
    row_table[q] = BandRowEntry(pos.oy, pos.ox, pos.correction, pos.valid);
  }
}

// The output rows of this thread (rows g and g + 8 of warp w's 16) in a tile whose row r is band position
// q0 + row_step r of `image`: their output pixel, whether it is one, and their border correction.
__device__ __forceinline__ AccumulatorRows BandTileRows(const BinaryGemmProblem& p, const BandLayout& band,
                                                        const int* row_table, int image, int q0, int row_step, int w,
                                                        int g) {
  AccumulatorRows rows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const BandPosition pos = BandPositionAt(p, band, row_table, q0 + row_step * (16 * w + g + 8 * h));
    rows.valid[h] = pos.valid;
    rows.row[h] = (static_cast<long long>(image) * p.out_h + pos.oy) * p.out_w + pos.ox;
    rows.correction[h] = pos.correction;
  }
  return rows;
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// kUnrolledSteps > 0: at most that many k256 steps, issued by a fully unrolled loop (kExactSteps: exactly
// that many, the 3x3 filters of C = 64 and 128); 0: any number, by a loop of runtime length. ptxas
// serializes the wgmmas of every runtime-length form it was given (remark C7520, "compiler-inserted WG.AR in
// divergent path": a fence per step, per pair, per block of 8 with or without a commit in the loop). The
// unrolled loop's exit after band.steps still costs a `warpgroup.arrive` before every wgmma and a dummy HGMMA
// per tile (remark C7519), which the exact instances do without. kPixelPairs: C = 64 (the file's head), its own
// instances so that the other channel counts keep their registers; kQuarter: N <= 64 (most C = 64 layers), the
// threshold bits of the first 64 columns only (a run-time choice between the two epilogues spilled).
//
// Set-up: the parameter-only operands (PrepareBandOperands) under the previous kernel's tail; after
// `griddepcontrol.wait`, three latency chains, each started at once in its own warps: the first band's copy
// (thread 0), the weights' copies (warp 1), the column table (every thread). Thread 0 issuing the copies and
// the small jobs in turn reached its share of the column table 1.9 us after the wait.
template <int kUnrolledSteps, bool kExactSteps, bool kPixelPairs, bool kQuarter, bool kResidual, bool kNarrowStream>
__global__ void __launch_bounds__(kBandThreads, 1)
    BandWgmmaKernel(const BinaryGemmProblem p, const __grid_constant__ CUtensorMap band_map, const BandLayout band,
                    const ResidualOperands residual) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  const BandSmem at = BandSmemOf(p, band);
  auto& cols = *reinterpret_cast<TileColumns<kWgCols>*>(smem + at.cols);
  uint64_t* step_desc = reinterpret_cast<uint64_t*>(smem + at.steps);
  const uint32_t base = SmemAddress(smem), weights = base + at.weights;
  const uint32_t band_full = base + at.barriers;  // [buffer]: the band landed
  const uint32_t weights_full = band_full + 16;
  // [buffer]: the warpgroups done with it, counted up through the kernel (the last of four loads the next band)
  const uint32_t buffer_done = band_full + 24;
  const int tid = threadIdx.x, wp = band.padded_w.divisor;
  const int odd_pad = kPixelPairs ? p.pad_left & 1 : 0;  // the band's extra first column
  const int wg = tid / 128, wtid = tid % 128, w = wtid / 32, lane = wtid % 32, g = lane / 4, t = lane % 4;
  if (tid == 0) {
    PrefetchTensorMap(band_map);
    asm volatile("st.shared.v2.u32 [%0], {%1, %1};\n" ::"r"(buffer_done), "r"(0) : "memory");
    BarrierInit(band_full, 1);
    BarrierInit(band_full + 8, 1);
    BarrierInit(weights_full, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  const BandItem first_item = BandItemOf(p, band, blockIdx.x);  // every CTA has an item
  PrepareBandOperands<kPixelPairs>(p, band, at, smem, step_desc, base, kBandThreads - 1 - tid);
  int* const row_table = reinterpret_cast<int*>(smem + at.row_table);
  FillBandRowTable(p, band, row_table, tid);
  __syncthreads();
  // a programmatic dependent launch, as the other wgmma kernels: no global access before this
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (tid == 0) {
    CopyBand<kPixelPairs>(p, band, band_map, first_item, base, band_full);
    const int second = blockIdx.x + band.ctas;
    if (second < band.items) {
      CopyBand<kPixelPairs>(p, band, band_map, BandItemOf(p, band, second), base + at.buffer_bytes, band_full + 8);
    }
  } else if (tid / 32 == 1 && !kPixelPairs) {
    CopyBandWeights(p, band, weights, weights_full, tid % 32);
  }
  FillBandColumns(p, cols, wg, wtid, kNarrowStream);
  auto& stream = *reinterpret_cast<StreamColumns<kBandCols>*>(smem + at.stream_columns);
  if constexpr (kNarrowStream) {
    if (tid < kBandCols) FillStreamColumn(p, stream, 0, tid, residual.planes);
  }
  if (kPixelPairs) LoadPixelPairWeights(p, band, smem + at.weights, tid);
  // the zeroed chunks, ones and pixel-pair weights, for the wgmmas
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (!kPixelPairs) BarrierWait(weights_full, 0);
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  int round = 0;
  for (int item = blockIdx.x; item < band.items; item += band.ctas, ++round) {
    const int buffer = round & 1;
    const BandItem item_tiles = BandItemOf(p, band, item);
    const int tiles = item_tiles.tiles[0] + item_tiles.tiles[1];
    BarrierWait(band_full + 8 * buffer, (round >> 1) & 1);  // every thread: no barrier needed after it
    // The first tiles in two halves: the second half of the warpgroups issues its wgmmas only once the first
    // half has issued its own, so that the tensor cores finish the first half's tiles first and their
    // epilogues run under the second half's wgmmas; the halves then stay apart. Issued all at once, the four
    // tiles finished together and four epilogues ran at once with the tensor cores idle.
    const bool leading_half = wg < kBandWarpgroups / 2;
    if (round == 0 && !leading_half) asm volatile("bar.sync 1, %0;\n" ::"n"(kBandThreads) : "memory");
    if (round == 0 && leading_half && wg >= tiles) asm volatile("bar.arrive 1, %0;\n" ::"n"(kBandThreads) : "memory");
    // The warpgroups' turns continue from the previous item's (exactly where the CTA's items have equal tile
    // counts; any common offset gives every tile to one warpgroup). & 3: the residue mod 4 of a negative too.
    static_assert(kBandWarpgroups == 4, "turns mod 4");
    const int first = (wg - round * tiles) & 3;
    for (int i = first; i < tiles; i += kBandWarpgroups) {
      // recomputed per tile (a fast division), not kept from `item_tiles`: ptxas reported the same
      // spills both ways, and no timing compared them
      const BandItem it = BandItemOf(p, band, item);
      const int seg = i >= it.tiles[0] ? 1 : 0;
      // the tile's first position in its image, and in the band buffer; pixel pairs: its rows every other
      // position
      const int tile = seg == 0 ? it.first_tile + i : i - it.tiles[0];
      const int q0 = kPixelPairs ? 128 * (tile >> 1) + (tile & 1) : 64 * tile;
      const int local0 = q0 - BandFirstRow(band, it, seg) * wp + seg * band.slot_positions;
      int acc[kBandCols / 2], popc_a[8];  // popc_a: rows g, g + 8 (each four times) against the all-ones B
      // step_desc is relative to buffer 0 at tile position 0: the start address field moves by 16 bytes per
      // position. Pixel pairs: the band holds position q at byte 8 (q + odd_pad); a tile whose rows start at
      // an odd byte offset / 8 reads from one position before, with the second weight set.
      const int parity = kPixelPairs ? (local0 + odd_pad) & 1 : 0;
      const uint32_t a_shift =
          (buffer * at.buffer_bytes >> 4) + (kPixelPairs ? (local0 + odd_pad - parity) >> 1 : local0);
      // The narrow stream's shortcut for the warp's rows 16 w + i (band positions q0 + row_step (16 w + i) of
      // the tile's image), copied while the wgmmas run; issued ahead of them, where the accumulators are not
      // yet live (issued after them, the exact instances spilled ~290 bytes; ptxas).
      [[maybe_unused]] uint8_t* stage = smem + at.stage + (tid / 32) * kStagedWarpBytes<kBandCols>;
      if constexpr (kNarrowStream) {
        {
          const int image = it.image + seg, row_step = kPixelPairs ? 2 : 1;
          auto shortcut_of = [&](int i, long long& offset) {
            const BandPosition pos = BandPositionAt(p, band, row_table, q0 + row_step * (16 * w + i));
            offset = ShortcutOffsetAt(residual, image, pos.oy, pos.ox);
            return pos.valid;
          };
          StageShortcut<kBandCols, true>(p, residual, stage, shortcut_of, 0, p.n, lane);
        }
      }
      IssueBandSteps<kUnrolledSteps, kExactSteps>(acc, popc_a, step_desc, a_shift,
                                                  weights + parity * WeightSetBytes(band), band);
      if (round == 0 && leading_half && i == wg) asm volatile("bar.arrive 1, %0;\n" ::"n"(kBandThreads) : "memory");
      // while the wgmmas run
      AccumulatorRows rows = BandTileRows(p, band, row_table, it.image + seg, q0, kPixelPairs ? 2 : 1, w, g);
      if constexpr (kResidual && !kNarrowStream) {
#pragma unroll
        for (int h = 0; h < 2; ++h) PrefetchShortcutRow(p, residual, rows.row[h], rows.valid[h], t);
      }
      // A warp whose 16 rows are all past its image's last output row (the tail of an image's last tile) stores
      // nothing and skips its epilogue: 2 of the 20 warp tiles of a 16 x 16 image.
      const bool warp_stores = __any_sync(0xffffffffu, rows.valid[0] || rows.valid[1]);
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
      for (int h = 0; h < 2; ++h) rows.v0[h] = p.k_real - 2 * popc_a[2 * h];
      if constexpr (kNarrowStream) {
        WaitStagedShortcut();
        if (warp_stores) StoreStagedResidualRows<kExactSteps>(p, residual, acc, rows, cols, stage, stream, 0, g, t);
      } else if constexpr (kResidual) {
        if (warp_stores) StoreResidualRows<kBandCols / 2>(p, residual, acc, rows, cols, 0, t);
      } else if (warp_stores) {
        StoreAccumulatorRows<kBandCols / 2, kQuarter>(p, acc, rows, cols, 0, t, true);
      }
    }
    // This warpgroup's wgmmas have read the buffer (each tile waited for them); the last of the four to get
    // here loads the item after next into it.
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
    if (wtid == 0) {
      __threadfence_block();
      uint32_t done_before;
      asm volatile("atom.shared.add.u32 %0, [%1], 1;\n" : "=r"(done_before) : "r"(buffer_done + 4 * buffer) : "memory");
      if (done_before % kBandWarpgroups == kBandWarpgroups - 1) {
        __threadfence_block();
        const int after_next = item + 2 * band.ctas;
        if (after_next < band.items) {
          CopyBand<kPixelPairs>(p, band, band_map, BandItemOf(p, band, after_next), base + buffer * at.buffer_bytes,
                                band_full + 8 * buffer);
        }
      }
    }
  }
#endif
}

template <bool kResidual>
const void* BandInstanceOf(int steps, bool pixel_pairs, bool quarter) {
  const bool unrolled = steps <= kBandUnrolledSteps;
  // the exact instances: 3 steps of pixel pairs (a 3x3 filter at C = 64) or 5 steps (3x3 at C = 128)
  const bool exact = BandStepsAreExact(steps, pixel_pairs);
  return reinterpret_cast<const void*>(
      !pixel_pairs ? (exact      ? BandWgmmaKernel<5, true, false, false, kResidual, false>
                      : unrolled ? BandWgmmaKernel<kBandUnrolledSteps, false, false, false, kResidual, false>
                                 : BandWgmmaKernel<0, false, false, false, kResidual, false>)
      : quarter    ? (exact      ? BandWgmmaKernel<3, true, true, true, kResidual, false>
                      : unrolled ? BandWgmmaKernel<kBandUnrolledSteps, false, true, true, kResidual, false>
                                 : BandWgmmaKernel<0, false, true, true, kResidual, false>)
                   : (exact      ? BandWgmmaKernel<3, true, true, false, kResidual, false>
                      : unrolled ? BandWgmmaKernel<kBandUnrolledSteps, false, true, false, kResidual, false>
                                 : BandWgmmaKernel<0, false, true, false, kResidual, false>));
}

// The narrow residual epilogue's instances (BandTakes): the exact ones, and without pixel pairs the one of a
// runtime number of steps.
const void* NarrowStreamBandInstance(int steps, bool pixel_pairs, bool quarter) {
  return reinterpret_cast<const void*>(
      !pixel_pairs ? (BandStepsAreExact(steps, pixel_pairs) ? BandWgmmaKernel<5, true, false, false, true, true>
                                                            : BandWgmmaKernel<0, false, false, false, true, true>)
      : quarter    ? BandWgmmaKernel<3, true, true, true, true, true>
                   : BandWgmmaKernel<3, true, true, false, true, true>);
}

const void* BandWgmmaKernelInstance(int steps, bool pixel_pairs, bool quarter, Epilogue epilogue) {
  if (epilogue == Epilogue::kResidualInt16) return NarrowStreamBandInstance(steps, pixel_pairs, quarter);
  return IsResidual(epilogue) ? BandInstanceOf<true>(steps, pixel_pairs, quarter)
                              : BandInstanceOf<false>(steps, pixel_pairs, quarter);
}

}  // namespace jaxbnn::cuda

// The image-band wgmma kernel (BandWgmmaKernel): its band layout, shared memory and instances, for the
// planner and the kernel.
#pragma once

#include "cuda/binary_gemm.h"
#include "cuda/device/common.cuh"
#include "cuda/device/epilogue.cuh"
#include "cuda/device/tile_columns.cuh"
#include "cuda/device/wgmma_tile.cuh"

namespace jaxbnn::cuda {

inline constexpr int kBandCols = 128, kBandWarpgroups = 4, kBandThreads = 128 * kBandWarpgroups;

// Its divisors are fast ones: the set-up's runtime divisions (the first item's, the steps' chunk offsets)
// were single-thread dependent chains on the way to the first tile (clock64 trace).
struct BandLayout {
  FastDivisor padded_w;  // Wp
  FastDivisor planes;    // P: the chunks of a tap (a band buffer holds StoredBandPlanes)
  FastDivisor kw;        // the filter's width
  int tiles_per_image;   // 64-position tiles: ceil(out_h Wp / 64)
  FastDivisor image_tiles;  // tile slots per image: tiles_per_image, or a multiple of tiles_per_item
  int tiles_per_item, items, ctas;
  int band_rows;         // input rows of a band segment (the TMA box's height)
  int slot_positions;    // positions of a segment's slot: band_rows Wp, rounded up to 128 bytes
  int slots;             // segments a band buffer holds: 2 where items cross images, else 1
  int plane_bytes;       // one channel plane of a band buffer: slots * slot_positions * 16 (pixel pairs: 8)
  int steps;             // k256 steps: ceil(chunks / 2)
  int k_tiles;           // K chunks of a weight row tile in shared memory: 2 steps (an odd last one's partner:
                         // zeros)
  bool whole_rows = false;  // pixel pairs, or one plane (C = 128) and 2 Wp <= 256: the band map's boxes are whole
                            // padded rows of 8-byte elements, not a box row of 16 bytes per position
  int row_table = 0;        // entries of the tile rows' table in shared memory (BandRowEntry): 64 tiles_per_image,
                            // or 0 where that passes kBandRowTableEntries (each tile computes its rows)
};

// The tile rows' table: per position q of an image's tiles (q = oy Wp + ox), its output pixel and border class,
// the same for every image, filled once per CTA under the previous kernel's tail. Without it each tile row takes
// a fast division, the frame excess and the class (in the band kernel's 16 x 16 x 128 threshold instance a fifth
// of its instructions; ncu). At most kBandRowTableEntries (16 KiB) of shared memory.
inline constexpr int kBandRowTableEntries = 4096;
// An entry: oy | ox << 12 | correction << 24 (AccumulatorRows::correction: 0 where the position is no output
// pixel, else below 128), and the sign bit set where the position is no output pixel (oy, ox < 4096: Wp <= 256
// and at most 4096 positions).
__host__ __device__ __forceinline__ int BandRowEntry(int oy, int ox, int correction, bool valid) {
  return static_cast<int>(static_cast<uint32_t>(oy | ox << 12 | correction << 24) | (valid ? 0u : 0x80000000u));
}

// Whether the band kernel takes `p` as pixel pairs (C = 64: 8 bytes a position, two sets of weights; above).
__host__ __device__ __forceinline__ bool PixelPairs(const BinaryGemmProblem& p) { return p.cw == 2; }

// The channel planes a band buffer holds: a pixel's stored 16-byte chunks (x_cw / 4; pixel pairs: 1), which a
// tap that reads its pixel twice takes twice.
__host__ __device__ __forceinline__ int StoredBandPlanes(const BinaryGemmProblem& p) {
  return PixelPairs(p) ? 1 : p.x_cw / 4;
}

// The segments of an item: tiles [first_tile, first_tile + tiles[0]) of `image`, then (where it runs past
// its image) tiles [0, tiles[1]) of image + 1.
struct BandItem {
  int image, first_tile, tiles[2];  // tiles[1] > 0: two segments
};
__host__ __device__ __forceinline__ BandItem BandItemOf(const BinaryGemmProblem& p, const BandLayout& b, int item) {
  const int g0 = item * b.tiles_per_item;
  BandItem it;
  it.image = Quotient(g0, b.image_tiles);
  it.first_tile = g0 - it.image * b.image_tiles.divisor;
  const int left_in_image = b.tiles_per_image - it.first_tile;
  it.tiles[0] = b.tiles_per_item < left_in_image ? b.tiles_per_item : left_in_image;
  // tiles_per_item <= tiles_per_image where items cross images
  const int into_next = b.tiles_per_item - (b.image_tiles.divisor - it.first_tile);
  it.tiles[1] = it.image + 1 < p.batch && into_next > 0 ? into_next : 0;
  return it;
}

// Shared memory of BandWgmmaKernel, from a 1024-aligned base: two band buffers of P planes, slack for the
// reads of dropped rows past the band, the weights, two all-ones row groups (B's columns 128-143 of the
// m64n144 wgmma: each row's popc(A)), the column table, the steps' A descriptors, three barriers, per band
// buffer a count of the warpgroups done with it, for the narrow residual epilogue the warps' shortcut stages, and
// the tile rows' table.
struct BandSmem {
  int buffer_bytes, weights, ones, cols, steps, barriers, stage, stream_columns, row_table, total;
};
// The all-ones row groups right after the weights' kBandCols rows, at the same row-group stride: the step's
// m64n144 wgmma reads them as B's columns 128-143 through the weights' descriptor.
inline constexpr int kOnesGroups = 2;
// One set of weights and all-ones row groups in shared memory.
__host__ __device__ __forceinline__ int WeightSetBytes(const BandLayout& b) {
  return (kBandCols / 8 + kOnesGroups) * b.k_tiles * 128;
}
__host__ __device__ __forceinline__ BandSmem BandSmemOf(const BinaryGemmProblem& p, const BandLayout& b) {
  BandSmem s;
  s.buffer_bytes = StoredBandPlanes(p) * b.plane_bytes;
  const int slack = (16 * (p.kw + 64) + 127) / 128 * 128;
  s.weights = 2 * s.buffer_bytes + slack;
  s.ones = s.weights + kBandCols / 8 * b.k_tiles * 128;
  s.cols = s.weights + (PixelPairs(p) ? 2 : 1) * WeightSetBytes(b);  // pixel pairs: a set per parity
  s.steps = (s.cols + static_cast<int>(sizeof(TileColumns<kWgCols>)) + 7) / 8 * 8;
  s.barriers = s.steps + 8 * b.steps;
  // the narrow residual epilogue's shortcut stages, one per warp (StageShortcut), 16-byte aligned, and its
  // columns' stream thresholds (StreamColumns)
  s.stage = (s.barriers + 3 * 8 + 2 * 4 + 15) / 16 * 16;
  const bool narrow = p.epilogue == Epilogue::kResidualInt16;
  s.stream_columns = s.stage + (narrow ? kBandThreads / 32 * kStagedWarpBytes<kBandCols> : 0);
  s.row_table = s.stream_columns + (narrow ? static_cast<int>(sizeof(StreamColumns<kBandCols>)) : 0);
  s.total = 1024 + s.row_table + 4 * b.row_table;
  return s;
}

// Pixel pairs: k256 steps per filter row, ceil((kw + 1) / 4): four columns each, from column 0 or -1.
__host__ __device__ __forceinline__ int PixelPairStepsPerRow(int kw) { return (kw + 4) / 4; }

inline constexpr int kBandUnrolledSteps = 16;

// Whether a band of `steps` k256 steps has exact instances: 3 steps of pixel pairs (a 3x3 filter at C = 64) or
// 5 steps (3x3 at C = 128).
__host__ __device__ __forceinline__ bool BandStepsAreExact(int steps, bool pixel_pairs) {
  return steps == (pixel_pairs ? 3 : 5);
}

// Whether the band kernel has an instance for `epilogue` at `steps`: the narrow residual epilogue
// (kResidualInt16) has the exact ones (the binary ResNets' 3x3 blocks) and, without pixel pairs, the one of a
// runtime number of steps (the ternary and mixed ResNets' 3x3 blocks: TNN's 9 and 18 steps at C = 64 and 128,
// TBN's and BTN's 9 at C = 128). An unrolled narrow instance spilled and ran TNN's C = 64 blocks slower than the
// resident kernel (docs/design/decisions.md).
__host__ __device__ __forceinline__ bool BandTakes(Epilogue epilogue, int steps, bool pixel_pairs) {
  return epilogue != Epilogue::kResidualInt16 || !pixel_pairs || BandStepsAreExact(steps, pixel_pairs);
}

// BandWgmmaKernel<steps, exact, pixel_pairs, quarter, residual, narrow stream> for a band of `steps` k256 steps
// and the problem's epilogue (BandTakes it): the residual instances run the residual epilogue (kResidual, or
// kResidualInt16 from the shortcut staged in shared memory), which the others do not run.
const void* BandWgmmaKernelInstance(int steps, bool pixel_pairs, bool quarter, Epilogue epilogue);

}  // namespace jaxbnn::cuda

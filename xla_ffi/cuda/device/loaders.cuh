// Loaders: how activation rows lie in a stage, the cp.async activation and weight stage loaders, and the
// row popcounts of a stage.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/common.cuh"
#include "cuda/device/pipeline.cuh"

namespace jaxbnn::cuda {

// How the activation rows of a stage lie in shared memory (chunk = 16 bytes = 128 bits of K):
//   kCoreMatrices: chunk c of row r at StageOffset(r, c) (the CUDA-core engine's cp.async, and every weight
//                  stage); as WgmmaKernel's parameter: activations by cp.async, into kSwizzledRows;
//   kSwizzledRows: rows of 128 bytes, the chunk index XORed with row % 8 (one 2-D TMA box, 128B swizzle;
//                  the mma.sync engine's and the wgmma kernel's cp.async);
//   kChunkSlabs:   chunk c of all rows in a slab of rows x 16 bytes, at c * kRows * 16 + r * 16
//                  (one 4-D TMA box per chunk: a convolution tap's channel words over a block of pixels);
//   kTapRows:      128 / W slabs of rows x W bytes, W = TapRowBytes (32, 64 or 128) with the W-byte swizzle:
//                  one 4-D TMA box per slab, a whole tap's channel words (or 128 bytes of them) per pixel,
//                  i.e. 2-4x fewer and wider boxes than kChunkSlabs and no half-used 32-byte sectors.
enum class ALayout : int { kCoreMatrices, kSwizzledRows, kChunkSlabs, kTapRows };

// The slab width of kTapRows for a convolution with `cw` channel words per tap, or 0 where a tap's bytes
// are not 32, 64 or a multiple of 128 (a box never straddles two taps).
__host__ __device__ __forceinline__ int TapRowBytes(int cw) {
  const int bytes = cw * 4;
  return bytes == 32 || bytes == 64 ? bytes : bytes % 128 == 0 ? 128 : 0;
}

// The bytes of a TMA box along K in the tap-row layout (kTapRows), or 0 where it does not apply: a tap's bytes as
// stored (TapRowBytes of x_cw); in a doubled convolution the shorter of a tap's two runs (doubled words, then the
// rest), which the box must not cross, and which divides the other (both multiples of 64 bytes).
__host__ __device__ __forceinline__ int ABoxTapBytes(const BinaryGemmProblem& p) {
  return TapRowBytes(p.doubled_k_blocks > 0 ? p.cw - DoubledTapWords(p) : p.x_cw);
}

// Where word `kword` of a doubled product's reduction comes from (BinaryGemmProblem::doubled_k_blocks): its tap and
// its word in the tap's channel words. The plain order is tap after tap; a doubled convolution's reduction is every
// tap's doubled words first, then every tap's other words, so that its doubled part ends on a K block (the kernels
// double the accumulators there, once). A BMM's (one tap) is the plain order.
__device__ __forceinline__ void DoubledReductionWord(const BinaryGemmProblem& p, int kword, int& tap, int& cword) {
  const int doubled_words = p.doubled_k_blocks * kKBlockWords, doubled = DoubledTapWords(p), rest = p.cw - doubled;
  if (kword < doubled_words) {
    tap = kword / doubled;
    cword = kword - tap * doubled;
  } else {
    const int r = kword - doubled_words;
    tap = r / rest;
    cword = doubled + r - tap * rest;
  }
}

// The byte of a pixel's stored words that byte `tap_byte` of a tap's channel bytes reads (BinaryGemmProblem::x_cw:
// the second reading of a repeated pixel starts again at its first byte).
__device__ __forceinline__ int StoredByte(const BinaryGemmProblem& p, int tap_byte) {
  return tap_byte < p.x_cw * 4 ? tap_byte : tap_byte - p.x_cw * 4;
}

// kTapRows: where k256 step ks of a K block (32 bytes of K) starts in a stage of kRows-row slabs of W =
// a_box_bytes = 1 << a_box_log2 bytes: in slab ks * 32 / W, ks * 32 % W bytes into a row.
template <int kRows>
__device__ __forceinline__ void TapRowSteps(int a_box_bytes, int a_box_log2, uint32_t (&step)[4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) step[ks] = ((ks * 32) >> a_box_log2) * kRows * a_box_bytes + ((ks * 32) & (a_box_bytes - 1));
}

// Where chunk `chunk` of row `row` lies (kTapRows: W = 1 << `row_bytes_log2`). In the swizzled layouts
// this is the physical chunk of that index: the swizzle permutes chunks within a row, so a row's chunks
// over all indices are its bytes, and 8 consecutive rows at one index hit 8 different bank groups.
// W is a runtime power of two: shifts and masks, since this runs in the consumers' k loop (the divisions
// it had were ~45% of a C = 2048 convolution's instructions).
template <ALayout kLayout, int kRows>
__device__ __forceinline__ uint32_t ChunkOffset(int row, int chunk, int row_bytes_log2) {
  if constexpr (kLayout == ALayout::kSwizzledRows) return row * 128 + ((chunk ^ (row % 8)) * 16);
  if constexpr (kLayout == ALayout::kChunkSlabs) return chunk * kRows * 16 + row * 16;
  if constexpr (kLayout == ALayout::kTapRows) {
    const int per_row_log2 = row_bytes_log2 - 4, per_row_mask = (1 << per_row_log2) - 1;
    const int slab = chunk >> per_row_log2, c = chunk & per_row_mask;
    const int swizzle = (row >> (3 - per_row_log2)) & per_row_mask;  // the W-byte swizzle's chunk XOR
    return ((slab * kRows + row) << row_bytes_log2) + ((c ^ swizzle) * 16);
  }
  return StageOffset(row, chunk);
}

// Copies K block `kb` of the activation rows of a tile into a stage. kVec words per copy (4 when every tap's words
// and every pixel's stored words are 16-byte aligned, else 1: a copy never crosses a repeat). Each thread keeps one
// word position, so the tap division runs once per stage, and copies the same compile-time number of rows, kThreads /
// kCopiesPerRow apart: an unrolled loop with constant stage offsets. Which copies share a quarter-warp (8 lanes, one
// request):
//   along rows: 8 consecutive rows at one word position. For a tap of 16 bytes (C <= 128) these are 8
//     consecutive pixels, 128 contiguous bytes; in the core-matrix layout their shared-memory writes fill one
//     128-byte row block. Where a tap has more bytes (and in a bmm) the 8 rows lie apart: 8 half-used 32-byte
//     sectors per quarter, twice the bytes' L2 sectors (ncu, mma.sync bmm 16384^3 in the core-matrix layout:
//     27% of its L2 sectors excess, and 8-way conflicting shared-memory writes).
//   along a row (kSwizzledRows, where a tap has >= 32 bytes): one row's 128 contiguous bytes of the K block,
//     which that layout keeps in one 128-byte line of shared memory: no excess sectors, no conflicts.
// kSkipPastK: the stage's words past K are zeros already (WgmmaKernel's short-K instances), so those copies
// are left out.
// kDoubled: a doubled product's order of the reduction (DoubledReductionWord).
template <int kRows, int kVec, int kThreads, ALayout kLayout = ALayout::kCoreMatrices, bool kSkipPastK = false,
          bool kDoubled = false>
__device__ __forceinline__ void LoadActivationStage(const BinaryGemmProblem& p, const LaunchDivisors& div,
                                                    const int4* origins, uint32_t stage, int kb, int tid) {
  static_assert(kLayout == ALayout::kCoreMatrices || kLayout == ALayout::kSwizzledRows, "a cp.async layout");
  constexpr int kCopiesPerRow = kKBlockWords / kVec;
  constexpr int kRowStep = kThreads / kCopiesPerRow;  // rows between a thread's copies
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "a thread must keep its word position and row % 8");
  constexpr int kRowsPerThread = kRows / kRowStep;
  const bool along_row = kLayout == ALayout::kSwizzledRows && p.cw >= 8;
  const int part = along_row ? tid % kCopiesPerRow : (tid / 8) % kCopiesPerRow;
  const int row0 = along_row ? tid / kCopiesPerRow : tid % 8 + 8 * (tid / (8 * kCopiesPerRow));
  const int kword = kb * kKBlockWords + part * kVec;
  const bool k_valid = kword < p.k_words;
  if (kSkipPastK && !k_valid) return;
  int tap = Quotient(kword, div.cw);
  int cword = kword - tap * p.cw;
  if constexpr (kDoubled) DoubledReductionWord(p, kword, tap, cword);
  const int fkh = Quotient(tap, div.kw), fkw = tap - fkh * p.kw;
  // the stored word of the tap's word cword (a repeated pixel's second reading: x_cw words back)
  const int tap_offset = (fkh * p.in_w + fkw) * p.x_cw + (cword < p.x_cw ? cword : cword - p.x_cw);
  // row0 + kRowStep i lies kRowStep i 128-byte rows further in either layout (kRowStep is a multiple of 8)
  const uint32_t dst0 = stage + ChunkOffset<kLayout, kRows>(row0, part * kVec / 4, 7) + (part * kVec % 4) * 4;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int4 o = origins[row0 + kRowStep * i];
    const int ih = o.y + fkh, iw = o.z + fkw;
    const bool valid = k_valid && o.w && static_cast<unsigned>(ih) < static_cast<unsigned>(p.in_h) &&
                       static_cast<unsigned>(iw) < static_cast<unsigned>(p.in_w);
    // a valid copy's word ((b * in_h + ih) * in_w + iw) * cw + cword is >= 0: unsigned, no sign extension;
    // the zero-filled copies point at p.x
    const uint32_t word = valid ? static_cast<uint32_t>(o.x + tap_offset) : 0u;
    CopyAsync<kVec * 4>(dst0 + kRowStep * i * 128, p.x + word, valid);
  }
}

// Copies K blocks of `kCols` weight rows (FSB tiles, 128 contiguous bytes each) into stages. Thread t
// always copies piece t % 8 of K tile (t / 8) % 8 of the same row tiles (t / 64 + j * kThreads / 64); only
// the K block moves, so the sources are made once per tile and Load adds the K block's offset (no
// divisions or 64-bit products per copy).
template <int kCols, int kThreads>
struct WeightStageLoader {
  static constexpr int kCopies = kCols * 8 / kThreads;  // 16-byte copies per thread and K block
  static constexpr int kTileStep = kThreads / 64;       // row tiles between a thread's copies
  static_assert(kThreads % 64 == 0 && kCols * 8 % kThreads == 0, "a thread must keep its piece and K tile");
  // The copies' sources in K block 0, or p.w where the row tile is past N or the K tile past K (see Load).
  const uint32_t* src[kCopies];
  bool row_valid[kCopies];
  int k_tile, w_k_tiles;
  uint32_t dst;  // the first copy's offset in a stage

  __device__ WeightStageLoader(const BinaryGemmProblem& p, int row_tile0, int tid)
      : k_tile((tid / 8) % 8), w_k_tiles(p.w_k_tiles) {
    const int piece = tid % 8, local_tile = tid / 64;
    dst = local_tile * kRowGroupBytes + k_tile * 128 + piece * 16;
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const int nt = row_tile0 + local_tile + j * kTileStep;
      row_valid[j] = nt < p.w_row_tiles;
      src[j] = row_valid[j] && k_tile < p.w_k_tiles
                   ? p.w + (static_cast<size_t>(nt) * p.w_k_tiles + k_tile) * 32 + piece * 4
                   : p.w;
    }
  }

  // Copies K block `kb` into `stage`. The zero-filled copies read nothing, but their addresses stay inside
  // the weights: where K tile kb * 8 + k_tile is past K, K block 0's sources; else a row tile past N reads
  // at K tile kb * 8 of row tile 0, which exists.
  __device__ __forceinline__ void Load(uint32_t stage, int kb) const {
    const bool k_valid = kb * 8 + k_tile < w_k_tiles;
    const size_t k_offset = static_cast<uint32_t>(k_valid ? kb : 0) * size_t{8 * 32};  // words
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      CopyAsync<16>(stage + dst + j * kTileStep * kRowGroupBytes, src[j] + k_offset, k_valid && row_valid[j]);
    }
  }
};

// popc of `kRows` activation rows of a stage (rows `kStageRows` apart in the slab layout; the mma.sync engine's
// and the persistent wgmma kernel's): this thread's part, kThreads / kRows threads per row. Thread t reads row
// (t / (8 * parts)) * 8 + t % 8: 8 consecutive threads, 8 rows of one chunk (in the swizzled layout: 8
// different physical chunks), so no bank conflicts; the parts of a row sit 8 lanes apart in one warp.
template <int kRows, int kThreads, ALayout kLayout = ALayout::kCoreMatrices, int kStageRows = kRows>
__device__ __forceinline__ int StageRowPopcount(const uint8_t* stage, int tid, int row_bytes_log2 = 7) {
  constexpr int kParts = kThreads / kRows;
  constexpr int kChunks = 8 / kParts;
  static_assert(8 * kParts <= 32, "the parts of a row must share a warp");
  const int row = (tid / (8 * kParts)) * 8 + tid % 8, part = (tid / 8) % kParts;
  uint4 words[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int chunk = part * kChunks + i;
    words[i] = *reinterpret_cast<const uint4*>(stage + ChunkOffset<kLayout, kStageRows>(row, chunk, row_bytes_log2));
  }
  int total = 0;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) total += __popc(words[i].x) + __popc(words[i].y) + __popc(words[i].z) + __popc(words[i].w);
  return total;
}

// Sums the parts of StageRowPopcount; returns the row's popcount in every part's thread.
template <int kRows, int kThreads>
__device__ __forceinline__ int CombineRowPopcount(int part) {
  constexpr int kParts = kThreads / kRows;
#pragma unroll
  for (int s = 8; s < 8 * kParts; s *= 2) part += __shfl_xor_sync(0xffffffffu, part, s);
  return part;
}

// The row whose popcount thread `tid` holds after CombineRowPopcount, or -1 for the duplicate parts.
template <int kRows, int kThreads>
__device__ __forceinline__ int RowOfPopcount(int tid) {
  constexpr int kParts = kThreads / kRows;
  return (tid / 8) % kParts == 0 ? (tid / (8 * kParts)) * 8 + tid % 8 : -1;
}

}  // namespace jaxbnn::cuda

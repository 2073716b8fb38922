// Epilogue pieces of the mma.sync / CUDA-core kernels: the fused epilogue over a tile staged in shared memory
// (pooling), a border row's bound class, the int32 / affine stores of a pair of columns, and the residual
// stream's values and bits (the residual epilogues) shared with the wgmma epilogue.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/border.cuh"
#include "cuda/device/common.cuh"
#include "cuda/device/geometry.cuh"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

// ---- the residual epilogues (IsResidual: Epilogue::kResidual, kResidualInt16) ----

// Whether the problem's stream (shortcut and output) is int16 (Epilogue::kResidualInt16), else int32.
__device__ __forceinline__ bool NarrowStream(const BinaryGemmProblem& p) {
  return p.epilogue == Epilogue::kResidualInt16;
}

// The first element of the shortcut's channels at output pixel (b, oh, ow): the pixel (b, s oh, s ow) of the
// block's input.
__device__ __forceinline__ long long ShortcutOffsetAt(const ResidualOperands& r, int b, int oh, int ow) {
  const long long at = (static_cast<long long>(b) * r.height + static_cast<long long>(oh) * r.stride) * r.width +
                       static_cast<long long>(ow) * r.stride;
  return at * r.channels;
}
// The same at output pixel `row` (a real one): its own pixel of a stride-1 shortcut.
__device__ __forceinline__ long long ShortcutOffset(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                    long long row) {
  if (r.stride == 1) return row * r.channels;
  const int pixel = static_cast<int>(row), image_pixels = p.out_h * p.out_w;
  const int b = pixel / image_pixels, in_image = pixel - b * image_pixels;
  const int oh = in_image / p.out_w, ow = in_image - oh * p.out_w;
  return ShortcutOffsetAt(r, b, oh, ow);
}

// The stream value of dot product `dot` with the shortcut's value `added`: (dot >> shift) + added, wrapping
// on overflow as the stream's integer type does in XLA (int32, or int16 for a narrow stream: kNarrow). The
// stream's type is a template argument in these pieces, chosen once per tile by their callers: tested per
// value, it made the band kernel's int32 residual instances spill 240-340 bytes (ptxas).
template <bool kNarrow>
__device__ __forceinline__ int StreamValue(const ResidualOperands& r, int dot, int added) {
  const uint32_t sum = static_cast<uint32_t>(dot >> r.shift) + static_cast<uint32_t>(added);
  return kNarrow ? static_cast<int>(static_cast<int16_t>(sum)) : static_cast<int>(sum);
}

// The two int16 values of a 4-byte pair, sign-extended.
__device__ __forceinline__ int2 Int16Pair(uint32_t v) {
  return make_int2(static_cast<int16_t>(v & 0xffffu), static_cast<int16_t>(v >> 16));
}

// The shortcut's values in columns col (even) and col + 1 of the pixel whose channels start at element `at`
// (ShortcutOffset), 0 past its channels. The epilogues load a few pairs together before their stores: a load
// placed between the stream's stores waits for them in program order (they might alias), which exposed each
// load's latency (the epilogue took twice the int32 one's time); through the read-only cache instead, the
// compiler hoisted the whole tile's loads and spilled.
template <bool kNarrow>
__device__ __forceinline__ int2 ShortcutPair(const ResidualOperands& r, long long at, int col) {
  if constexpr (kNarrow) {
    const int16_t* shortcut = static_cast<const int16_t*>(r.shortcut) + at;
    const bool pairs = r.channels % 2 == 0 && reinterpret_cast<uintptr_t>(r.shortcut) % 4 == 0;  // 4-byte aligned
    if (pairs && col + 1 < r.channels) return Int16Pair(*reinterpret_cast<const uint32_t*>(shortcut + col));
    return make_int2(col < r.channels ? shortcut[col] : 0, col + 1 < r.channels ? shortcut[col + 1] : 0);
  }
  const int32_t* shortcut = static_cast<const int32_t*>(r.shortcut) + at;
  const bool pairs = r.channels % 2 == 0 && reinterpret_cast<uintptr_t>(r.shortcut) % 8 == 0;  // 8-byte aligned
  if (pairs && col + 1 < r.channels) return *reinterpret_cast<const int2*>(shortcut + col);
  return make_int2(col < r.channels ? shortcut[col] : 0, col + 1 < r.channels ? shortcut[col + 1] : 0);
}

// The shortcut's value in column `col` (< N) of the pixel whose channels start at element `at`.
template <bool kNarrow>
__device__ __forceinline__ int ShortcutValue(const ResidualOperands& r, long long at, int col) {
  if (col >= r.channels) return 0;
  if constexpr (kNarrow) return static_cast<const int16_t*>(r.shortcut)[at + col];
  return static_cast<const int32_t*>(r.shortcut)[at + col];
}

__device__ __forceinline__ bool StreamBit(int value, int threshold, int flip) {
  return flip ? value <= threshold : value >= threshold;
}

// The int16 epilogue's values of columns col (even) and col + 1 (where below N) of one output row, as a 4-byte pair.
__device__ __forceinline__ void StoreInt16Pair(const BinaryGemmProblem& p, long long row, int col, int d0, int d1) {
  int16_t* out = static_cast<int16_t*>(p.out) + row * p.n + col;
  if (p.n % 2 == 0) {  // 4-byte stores keep their alignment when rows have an even length
    *reinterpret_cast<uint32_t*>(out) = static_cast<uint16_t>(d0) | static_cast<uint32_t>(static_cast<uint16_t>(d1)) << 16;
  } else {
    out[0] = static_cast<int16_t>(d0);
    if (col + 1 < p.n) out[1] = static_cast<int16_t>(d1);
  }
}

// Stores the stream values of two adjacent columns (col, col + 1 where below N) of one output row: StorePair's
// int32 form (or StoreInt16Pair's for a narrow stream), apart so that the kernels without the residual epilogue
// compile as they did.
template <bool kNarrow>
__device__ __forceinline__ void StoreStreamPair(const BinaryGemmProblem& p, long long row, int col, int d0, int d1) {
  if constexpr (kNarrow) {
    StoreInt16Pair(p, row, col, d0, d1);
    return;
  }
  int32_t* out = static_cast<int32_t*>(p.out) + row * p.n + col;
  if (p.n % 2 == 0) {  // 8-byte stores keep their alignment when rows have an even length
    *reinterpret_cast<int2*>(out) = make_int2(d0, d1);
  } else {
    out[0] = d0;
    if (col + 1 < p.n) out[1] = d1;
  }
}

// The stream's threshold bit of `value` in column `col` (< N). The thresholds are read from global memory (a
// few hundred bytes, cached), not staged with the tile's columns: staging them changed the column set-up of
// every kernel, residual or not.
__device__ __forceinline__ bool StreamBitOf(const BinaryGemmProblem& p, int value, int col) {
  return StreamBit(value, __ldg(p.threshold + col), __ldg(p.flip + col));
}

// Prefetches the shortcut's channels of output pixel `row` (if `valid`) into L2, lane t of the row's quad every
// fourth 128-byte line, while the tile's MMAs run: the epilogue's loads then wait for L2, not for HBM.
__device__ __forceinline__ void PrefetchShortcutRow(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                    long long row, bool valid, int t) {
  if (!valid) return;
  const int element_bytes = NarrowStream(p) ? 2 : 4;
  const char* base = static_cast<const char*>(r.shortcut) + ShortcutOffset(p, r, row) * element_bytes;
  for (int offset = 128 * t; offset < element_bytes * r.channels; offset += 512) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(base + offset));
  }
}

// ---- the narrow stream's shortcut staged in shared memory (kResidualInt16) ----

// A staged row of a tile of kCols columns (128: the band kernel's, the resident kernel's narrow tiles; 256: its
// wide ones): its int16 values and 16 bytes of skew, so that an accumulator quad's reads of 8 rows (4 bytes at
// 2 (8 j + 2 t)) fall in 32 distinct banks.
template <int kCols>
inline constexpr int kStagedRowBytes = 2 * kCols + 16;
// The stage of one warp's 16 accumulator rows.
template <int kCols>
inline constexpr int kStagedWarpBytes = 16 * kStagedRowBytes<kCols>;

// StageShortcut's copies where each of the 16 rows is found once (kRowsOnce): 2^kChunkShift chunks a row, lane l
// copying chunk l % 2^kChunkShift of rows l >> kChunkShift, + 32 >> kChunkShift, ...; `own`, row lane % 16's
// shortcut element (-1: not a real row), handed to the copying lanes by a shuffle. The rows' loop is unrolled:
// as a loop, its branches and its 64-bit address arithmetic per turn were ~90 of the band kernel's ~870
// residual instructions a warp and tile at C = 64 (ncu).
template <int kCols, int kChunkShift>
__device__ __forceinline__ void CopyShortcutRows(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                 uint8_t* stage, long long own, int col0, int lane) {
  constexpr int kRowChunks = 1 << kChunkShift, kRowsAtOnce = 32 >> kChunkShift;
  const int chunk = lane & (kRowChunks - 1), col = col0 + 8 * chunk, first_row = lane >> kChunkShift;
  const bool copies = col < p.n && col < r.channels, zeros = col < p.n && col >= r.channels;
  const int16_t* src = static_cast<const int16_t*>(r.shortcut) + col;
  uint8_t* dst = stage + 16 * chunk + first_row * kStagedRowBytes<kCols>;
#pragma unroll
  for (int k = 0; k < 16 / kRowsAtOnce; ++k) {  // the same turns in every lane: the shuffles span the warp
    const long long at = __shfl_sync(0xffffffffu, own, first_row + k * kRowsAtOnce);
    uint8_t* to = dst + k * kRowsAtOnce * kStagedRowBytes<kCols>;
    if (at >= 0 && copies) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddress(to)), "l"(src + at) : "memory");
    } else if (at >= 0 && zeros) {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Copies the shortcut's values of a warp's 16 accumulator rows, the tile's columns col0 .. col0 + cols - 1 (cols =
// min(kCols, N - col0), the caller's), into `stage` (16-byte aligned): shortcut_of(i, at) says whether local row i
// is a real output pixel (the others are not copied) and where its shortcut's channels start (ShortcutOffset's
// element, found by the caller from what it knows of the row: a stride-2 shortcut's runtime divisions per copy made
// a downsampling block's conv2 take 10-20% longer than its stride-1 twin). Called by every lane of the warp. Issued
// before the tile's MMAs, so that the epilogue reads shared memory: loads from global memory in the epilogue
// waited on memory after the MMAs (docs/design/decisions.md, "The residual epilogue"). Where the shortcut's rows
// are whole 16-byte chunks (channels a multiple of 8, an aligned base), asynchronous copies of a chunk per lane and
// row, zeros past the shortcut's channels; else plain loads. The caller waits for them (WaitStagedShortcut) before
// its epilogue reads the stage.
// kRowsOnce (the band kernel, whose rows come from a division of band positions): the chunk path finds each of the
// 16 rows once (lane i % 16) and hands it to the copying lanes by a shuffle, and a tile of at most kCols / 2
// columns takes kCols / 16 chunks a row, so that every lane copies. With each row found per copy and the lanes
// past N idle, the copies were a quarter of the band kernel's residual instructions at C = 64 (ncu). Without it
// (the resident kernel, whose rows are consecutive): lane l copies chunk l % (kCols / 8) of rows l / (kCols / 8),
// + 32 / (kCols / 8), ..., shortcut_of per copy (the shuffle made its residual instances 1-3% slower).
template <int kCols, bool kRowsOnce, class ShortcutOf>
__device__ __forceinline__ void StageShortcut(const BinaryGemmProblem& p, const ResidualOperands& r, uint8_t* stage,
                                              ShortcutOf shortcut_of, int col0, int cols, int lane) {
  static_assert(kCols == 128 || kCols == 256, "16 or 32 chunks a row");
  __syncwarp();  // the warp's previous epilogue has read the stage
  const bool chunks = r.channels % 8 == 0 && reinterpret_cast<uintptr_t>(r.shortcut) % 16 == 0;
  if (chunks && kRowsOnce) {
    long long own = 0;  // row lane % 16's shortcut element, -1 for a row that is not real
    if (!shortcut_of(lane % 16, own)) own = -1;
    // kCols / 16 or kCols / 8 chunks a row, a power of two known at compile time (as a runtime divisor, its
    // division was ~35 of the band kernel's ~920 instructions a warp and tile at C = 64; ncu)
    constexpr int kQuarterShift = kCols == 128 ? 3 : 4;
    if (2 * cols <= kCols) {
      CopyShortcutRows<kCols, kQuarterShift>(p, r, stage, own, col0, lane);
    } else {
      CopyShortcutRows<kCols, kQuarterShift + 1>(p, r, stage, own, col0, lane);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    return;
  }
  if (chunks) {
    constexpr int kChunks = kCols / 8, kRowStep = 32 / kChunks;
    const int chunk = lane % kChunks, col = col0 + 8 * chunk;
    if (col < p.n) {
#pragma unroll 1
      for (int i = lane / kChunks; i < 16; i += kRowStep) {
        long long at;
        if (!shortcut_of(i, at)) continue;
        uint8_t* dst = stage + i * kStagedRowBytes<kCols> + 16 * chunk;
        if (col < r.channels) {
          const int16_t* src = static_cast<const int16_t*>(r.shortcut) + at + col;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddress(dst)), "l"(src) : "memory");
        } else {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    return;
  }
#pragma unroll 1
  for (int i = lane; i < 16 * cols; i += 32) {
    const int local = i / cols, col = i - local * cols;
    long long at;
    if (!shortcut_of(local, at)) continue;
    reinterpret_cast<int16_t*>(stage + local * kStagedRowBytes<kCols>)[col] =
        static_cast<int16_t>(ShortcutValue<true>(r, at, col0 + col));
  }
}

// The narrow stream's thresholds of a tile's columns, filled once per CTA (FillStreamColumn), in the form the
// epilogue compares them with an int16 value v held in the upper half of a word (v 2^16 plus any bits below it): a
// value's bit in plane q is (that word >= scaled_bound[lc]) XOR bit lc % 32 of flip_word[q][lc / 32], the bound of
// plane 0 in scaled_bound and of plane 1 in second_scaled_bound (ResidualOperands::planes == 2). The bound is the
// threshold, or with flip the threshold + 1 (value <= t is the negation of value >= t + 1), times 2^16: INT32_MIN
// where every int16 value reaches it, and where none does (past N, no thresholds, a bound above 32767) INT32_MIN
// with the column's flip toggled, so that every bound is a whole multiple of 2^16 within the int32 range. Kept in
// shared memory for the tile epilogues: read from global memory per value (StreamBitOf), the thresholds took a
// quarter of the band kernel's residual epilogue (harness, H200); as a (bound, sign) pair per column, a multiply
// per value.
template <int kCols>
struct StreamColumns {
  int scaled_bound[kCols];
  int second_scaled_bound[kCols];
  uint32_t flip_word[kMaxBitsPlanes][kCols / 32];
};

// Fills local column lc (global col0 + lc) of `columns` for `planes` threshold planes (1 or 2). Called by whole
// warps for 32 consecutive columns (the flip words are ballots).
template <int kCols>
__device__ __forceinline__ void FillStreamColumn(const BinaryGemmProblem& p, StreamColumns<kCols>& columns, int col0,
                                                 int lc, int planes) {
  const int col = col0 + lc;
  for (int plane = 0; plane < planes; ++plane) {
    bool flip = false;
    int bound = INT16_MAX + 1;  // never
    if (col < p.n && p.threshold != nullptr) {
      const int t = min(max(p.threshold[plane * p.n + col], INT16_MIN - 1), INT16_MAX + 1);
      flip = p.flip[plane * p.n + col] != 0;
      bound = flip ? t + 1 : t;
    }
    const bool never = bound > INT16_MAX;
    flip ^= never;
    (plane == 0 ? columns.scaled_bound : columns.second_scaled_bound)[lc] =
        never ? INT32_MIN : max(bound, INT16_MIN) * (1 << 16);
    const uint32_t flips = __ballot_sync(0xffffffffu, flip);
    if (lc % 32 == 0) columns.flip_word[plane][lc / 32] = flips;
  }
}

// Waits for this warp's StageShortcut: its copies landed and every lane's values are visible to the warp.
__device__ __forceinline__ void WaitStagedShortcut() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncwarp();
}

// The residual epilogue of the dot products d0, d1 of columns col and col + 1 of `row` (their shortcut values
// `added`, ShortcutPair): stores their stream values (nothing for a row that is not real or a column past N)
// and returns their threshold bits, at bits 0 and 1 (0 without a threshold or past N).
template <bool kNarrow>
__device__ __forceinline__ uint32_t StoreResidualPair(const BinaryGemmProblem& p, const ResidualOperands& r,
                                                      int2 added, long long row, bool valid, int col, int d0, int d1) {
  if (!valid || col >= p.n) return 0;
  const int v0 = StreamValue<kNarrow>(r, d0, added.x), v1 = StreamValue<kNarrow>(r, d1, added.y);
  StoreStreamPair<kNarrow>(p, row, col, v0, v1);
  if (r.bits == nullptr) return 0;
  const bool bit1 = col + 1 < p.n && StreamBitOf(p, v1, col + 1);
  return static_cast<uint32_t>(StreamBitOf(p, v0, col)) | static_cast<uint32_t>(bit1) << 1;
}

// The four lanes of this thread's quad. The quads of a warp hold different rows and may take different
// epilogue paths (border rows or not) with different numbers of shuffles, so the shuffles that assemble a
// quad's words name only the quad: a full-warp mask would pair shuffles of different paths, or wait forever.
__device__ __forceinline__ unsigned QuadLanes() { return 0xfu << (threadIdx.x % 32 & ~3u); }
// The whole warp, for the shuffles of epilogues whose quads take the same path.
inline constexpr unsigned kWarpLanes = 0xffffffffu;

// The int16 epilogue (Epilogue::kInt16): one output row's values in two 8-column fragments of an accumulator quad,
// whose lane t holds columns col_f + 2 t, + 1 of the first (lo0, lo1) and col_f + 8 + 2 t, + 1 of the second
// (hi0, hi1), of a real row where `valid`. Called by every lane of `lanes`: the quad (QuadLanes), or the whole warp
// (kWarpLanes) where every quad calls it together, real rows or not (a shuffle over a register mask took the
// wgmma kernels' int16 epilogue a warp-level match and branches; ncu). With rows of a multiple of 4 values, one
// exchange with the neighbouring lane gives each lane four adjacent values for one 8-byte store (even lanes the
// first fragment's, odd lanes the second's): 4-byte pairs stored as they lie made the band kernel's int16
// epilogue slower than its int32 one (harness, H200). Values past N are not stored.
__device__ __forceinline__ void StoreInt16Fragments(const BinaryGemmProblem& p, long long row, bool valid, int col_f,
                                                    int t, int lo0, int lo1, int hi0, int hi1, unsigned lanes) {
  auto pack = [](int a, int b) { return static_cast<uint32_t>(static_cast<uint16_t>(a)) | static_cast<uint32_t>(b) << 16; };
  const uint32_t lo = pack(lo0, lo1), hi = pack(hi0, hi1);
  int16_t* out_row = static_cast<int16_t*>(p.out) + row * p.n;
  if (p.n % 4 == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0) {
    const bool odd = t & 1;
    const uint32_t other = __shfl_xor_sync(lanes, odd ? lo : hi, 1);
    const int col = odd ? col_f + 8 + 2 * (t - 1) : col_f + 2 * t;  // a multiple of 4: all four below N, or none
    if (valid && col < p.n) *reinterpret_cast<uint2*>(out_row + col) = odd ? make_uint2(other, hi) : make_uint2(lo, other);
    return;
  }
  if (!valid) return;
  const int values[4] = {lo0, lo1, hi0, hi1};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int col = col_f + 8 * (i / 2) + 2 * t + i % 2;
    if (col < p.n) out_row[col] = static_cast<int16_t>(values[i]);
  }
}

// Completes a stream-bits word of one row held by an accumulator quad, whose lane t holds the bits of
// columns 8 q + 2 t + e of the word at bit 8 q + e, and stores it from lane (word index % 4) where `valid`.
// Called by every lane of `lanes` (as StoreInt16Fragments).
__device__ __forceinline__ void StoreStreamWord(const BinaryGemmProblem& p, const ResidualOperands& r, long long row,
                                                bool valid, int word_col0, uint32_t bits, int t, unsigned lanes) {
  uint32_t word = bits << (2 * t);
  word |= __shfl_xor_sync(lanes, word, 1);
  word |= __shfl_xor_sync(lanes, word, 2);
  if (valid && t == (word_col0 / 32) % 4 && word_col0 < p.n) {
    r.bits[row * ((p.n + 31) / 32) + word_col0 / 32] = word;
  }
}

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
      bool bit = false, second = false;
      if (col < p.n) {
        const int dot = PooledDot<kLd, kCols>(p, acc, popc_a, cols, origins, window, pr, lc, col);
        bit = cols.flip[lc] ? dot <= cols.threshold[lc] : dot >= cols.threshold[lc];
        if (p.planes > 1) {  // TileColumns' bound form: dot + 2 popc(b) >= bound, then the flip
          const bool flip = (cols.second_flip_word[word] >> lane) & 1u;
          second = (dot + 2 * cols.popc_b[lc] >= cols.bound[lc] + cols.second_delta[lc]) != flip;
        }
      }
      uint32_t* dst = out + pooled * p.planes * out_words + col0 / 32 + word;
      const uint32_t bits = __ballot_sync(0xffffffffu, bit);
      if (lane == 0) dst[0] = bits;
      if (p.planes > 1) {
        const uint32_t second_bits = __ballot_sync(0xffffffffu, second);
        if (lane == 0) dst[out_words] = second_bits;
      }
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
    } else if (p.epilogue == Epilogue::kInt16) {
      static_cast<int16_t*>(p.out)[pooled * p.n + col] = static_cast<int16_t>(dot);
    } else {  // no contraction into an FMA: the same two roundings as the reference
      static_cast<float*>(p.out)[pooled * p.n + col] =
          __fadd_rn(__fmul_rn(static_cast<float>(dot), cols.scale[lc]), cols.bias[lc]);
    }
  }
}

// The residual epilogue over a finished tile in shared memory (unpooled: the instances of the kernels that stage
// their tiles, kResidual), run by kThreads threads: a warp per (row, 32-column word), its lanes' stream values
// stored and their bits gathered by a ballot. kNarrow: the int16 stream (kResidualInt16).
template <int kRows, int kCols, int kLd, int kThreads, bool kNarrow>
__device__ void StoreResidualTile(const BinaryGemmProblem& p, const ResidualOperands& r, const int* acc,
                                  const int* popc_a, const TileColumns<kCols>& cols, const int4* origins, int tile_m,
                                  int col0, int tid) {
  constexpr int kWordsPerRow = kCols / 32;
  const int out_words = (p.n + 31) / 32;
  const int lane = tid % 32;
  const long long row0 = static_cast<long long>(tile_m) * kRows;
  for (int item = tid / 32; item < kRows * kWordsPerRow; item += kThreads / 32) {
    const int tr = item / kWordsPerRow, word = item % kWordsPerRow;
    const long long row = row0 + tr;
    if (row >= p.pooled_rows || col0 + word * 32 >= p.n) continue;  // warp-uniform
    const int lc = word * 32 + lane, col = col0 + lc;
    bool bit = false;
    if (col < p.n) {
      const int added = ShortcutValue<kNarrow>(r, ShortcutOffset(p, r, row), col);
      const int value = StreamValue<kNarrow>(r, PooledDot<kLd, kCols>(p, acc, popc_a, cols, origins, 1, tr, lc, col), added);
      if constexpr (kNarrow) {
        static_cast<int16_t*>(p.out)[row * p.n + col] = static_cast<int16_t>(value);
      } else {
        static_cast<int32_t*>(p.out)[row * p.n + col] = value;
      }
      bit = r.bits != nullptr && StreamBitOf(p, value, col);
    }
    const uint32_t bits = __ballot_sync(0xffffffffu, bit);
    if (lane == 0 && r.bits != nullptr) r.bits[row * out_words + col0 / 32 + word] = bits;
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

// Stores the int32 / affine values of two adjacent columns (col, col + 1) of one output row. (The int16 epilogue
// has stores of its own, StoreInt16Fragments, chosen once per tile: a third form tested here, inside the loops
// over the values, slowed the resident kernel's int32 epilogue by half; harness, H200.)
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

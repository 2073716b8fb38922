// The CUDA kernels of jaxbnn: one implicit-GEMM binary convolution (bmm = 1x1 convolution), three engines.
//   wgmma    (sm_90a): BGMMA m64n256k256 AND-popc, 128x256 CTA tile, a producer warpgroup filling a 4-stage
//            mbarrier pipeline, two consumer warpgroups; where a column tile's weights fit in shared memory
//            (K <= 4608 on H100), a variant that keeps them there and runs its consumer warpgroups apart;
//            stride-1 convolutions of at most 128 output channels (C = 64 or a multiple of 128): an image-band
//            kernel whose A operand is a band of input rows in shared memory (no gather).
//   mma.sync (sm_80+): BMMA m16n8k256 AND-popc, cp.async pipeline paced by "full" / "empty" mbarriers per
//            stage (no CTA barrier per K block): 128x128 CTA tiles of 8 warps in 4 stages,
//            or, where shared memory allows (H100), 128x256 tiles of 16 warps in 3 stages.
//   simt     (any):    CUDA-core AND + POPC, 64x64 CTA tile, 3-stage cp.async pipeline (fallback/baseline).
//
// Shared memory layout of every operand stage: K blocks of 1024 bits (32 words = 8 chunks of 16 bytes);
// chunk c of row r lies at (r / 8) * 1024 + c * 128 + (r % 8) * 16. Each 8-row x 16-byte block is one
// wgmma "core matrix" (LBO 128 along K, SBO 1024 between row groups), one ldmatrix 8x8 b16 matrix, and
// one FSB weight tile, so weights are copied as they lie in global memory. Activation stages may lie
// otherwise (ALayout: TMA boxes, and the mma.sync engine's rows of 128 bytes).
//
// Rows past the problem, words past K and out-of-frame taps are zero-filled by the loaders: zero bits
// add nothing to AND-popc, and an out-of-frame tap read as zeros is exactly a -1 input ("one" padding).
// "zero" padding subtracts, per excluded tap, its (C - 2 popc_tap) in the epilogue.
//
// Epilogue, fused: int32 / affine / threshold bits written as words of the next layer's packed layout.
// Unpooled tiles store straight from the accumulators, each row's threshold bits against one row of bounds
// (its border class's: the "zero"-padding correction folded into the bounds); pooled tiles go through a
// shared int32 tile and a max over each window's rows (warp ballots for the bits).
#include "binary_gemm.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "wgmma_b1.cuh"

namespace jaxbnn::cuda {
namespace {

constexpr int kKBlockWords = 32;  // one pipeline stage covers 1024 bits of K
constexpr int kRowGroupBytes = 1024;  // 8 rows x 128 bytes

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A divisor d >= 1 fixed at launch, for Quotient (n / d by a multiply-high and a shift: the round-up method
// of Granlund and Montgomery, magic = ceil(2^(31 + l) / d), l = ceil(log2 d), exact for 0 <= n < 2^31)
// instead of a ~20-instruction integer division. Built on the host; kernels take it as a parameter, so
// the magic number is a constant-bank operand.
struct FastDivisor {
  int divisor = 1;
  uint32_t magic = 0, shift = 0;
  FastDivisor() = default;
  explicit FastDivisor(int d) : divisor(d > 1 ? d : 1) {
    if (divisor == 1) return;
    int log2_ceil = 0;
    while ((1ll << log2_ceil) < divisor) ++log2_ceil;
    magic = static_cast<uint32_t>(((1ull << (31 + log2_ceil)) + divisor - 1) / divisor);
    shift = static_cast<uint32_t>(log2_ceil - 1);
  }
};
__host__ __device__ __forceinline__ int Quotient(int n, const FastDivisor& d) {
#ifdef __CUDA_ARCH__
  const uint32_t high = __umulhi(static_cast<uint32_t>(n), d.magic);
#else
  const uint32_t high = static_cast<uint32_t>(uint64_t{static_cast<uint32_t>(n)} * d.magic >> 32);
#endif
  return d.divisor == 1 ? n : static_cast<int>(high >> d.shift);
}

// The divisors of a problem that the loaders use once per K block, built once per launch (DivisorsOf).
struct LaunchDivisors {
  FastDivisor cw, kw, tap_bytes, image_pixels, out_w;
};

__device__ __forceinline__ uint32_t StageOffset(int row, int chunk) {
  return (row / 8) * kRowGroupBytes + chunk * 128 + (row % 8) * 16;
}

template <int kBytes>
__device__ __forceinline__ void CopyAsync(uint32_t dst, const void* src, bool valid) {
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
  } else if constexpr (kBytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
  }
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// Per tile row: where its output pixel's receptive field starts. x: word offset of tap (0, 0)
// (may point outside the image at borders), y/z: input row/column of tap (0, 0), w: 1 if the row is real.
__device__ __forceinline__ int4 RowOrigin(const BinaryGemmProblem& p, int tile_m, int rows_per_tile, int r) {
  const int window = p.pool_h * p.pool_w;
  const int pooled_per_tile = rows_per_tile / window;
  int4 origin = make_int4(0, 0, 0, 0);
  if (r >= pooled_per_tile * window) return origin;
  const long long pooled = static_cast<long long>(tile_m) * pooled_per_tile + r / window;
  if (pooled >= p.pooled_rows) return origin;
  const int e = r % window;
  const int pix = static_cast<int>(pooled);
  const int owp = pix % p.out_w, rest = pix / p.out_w;
  const int ohp = rest % p.out_h, b = rest / p.out_h;
  const int oh = ohp * p.pool_h + e / p.pool_w, ow = owp * p.pool_w + e % p.pool_w;
  const int ih0 = oh * p.stride_h - p.pad_top, iw0 = ow * p.stride_w - p.pad_left;
  origin.x = ((b * p.in_h + ih0) * p.in_w + iw0) * p.cw;
  origin.y = ih0;
  origin.z = iw0;
  origin.w = 1;
  return origin;
}

// "zero" padding: a pixel whose receptive field leaves the frame gets, per column, the correction
// sum over its out-of-frame taps of (C - 2 popc_tap). Which taps are out depends only on how far the field
// sticks out at each side (its FrameExcess), so a tile keeps one correction per column for every excess
// (a "border class") when the problem has few: at most kTableClasses classes (3x3 with padding 1 has 16)
// and filters of at most kTableSide x kTableSide taps, or 5x5 (their popcounts fit in registers). Other
// problems take the edge table or sum tap popcounts per value.
inline constexpr int kTableClasses = 25;
inline constexpr int kTableSide = 4;
inline constexpr int kExactTableSide = 5;  // the largest filter of an exact-size table fill (5x5: 25 taps)
static_assert(kTableClasses <= 127, "border classes are staged as int8 per tile row (RowCorrection)");

// The excess of a receptive field whose tap (0, 0) is at input row oy, column oz.
__host__ __device__ __forceinline__ FrameExcess ExcessOf(const BinaryGemmProblem& p, int oy, int oz) {
  return {min(p.kh, max(0, -oy)), min(p.kh, max(0, oy + p.kh - p.in_h)), min(p.kw, max(0, -oz)),
          min(p.kw, max(0, oz + p.kw - p.in_w))};
}
// The largest excess at each side (the launcher's BinaryGemmProblem::max_excess): the first computed output
// row / column sticks out most at the top / left, the last at the bottom / right.
FrameExcess MaxExcessOf(const BinaryGemmProblem& p) {
  const FrameExcess first = ExcessOf(p, -p.pad_top, -p.pad_left);
  const FrameExcess last = ExcessOf(p, (p.out_h * p.pool_h - 1) * p.stride_h - p.pad_top,
                                    (p.out_w * p.pool_w - 1) * p.stride_w - p.pad_left);
  return {first.top, last.bottom, first.left, last.right};
}
// A class is its excess at each side, numbered as the four-way product of the sides' ranges. Where that passes
// kTableClasses but no field sticks out at two opposite sides (kh <= in_h and kw <= in_w: a field above the
// frame ends inside it), a class is a (vertical, horizontal) pair instead, each the excess at its one side:
// 5x5 with padding 2 then has 5 x 5 classes instead of 81 (p.compact_classes).
__host__ __device__ __forceinline__ int BorderClasses(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  if (p.compact_classes) return (m.top + m.bottom + 1) * (m.left + m.right + 1);
  return (m.top + 1) * (m.bottom + 1) * (m.left + 1) * (m.right + 1);
}
bool UsesCompactClasses(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  return !p.pad_one && (m.top + 1) * (m.bottom + 1) * (m.left + 1) * (m.right + 1) > kTableClasses &&
         p.kh <= p.in_h && p.kw <= p.in_w;
}
// Whether the tiles of `p` keep the per-class correction table (the launcher's
// BinaryGemmProblem::correction_table).
bool KeepsCorrectionTable(const BinaryGemmProblem& p) {
  const bool table_filter = (p.kh <= kTableSide && p.kw <= kTableSide) || (p.kh == kExactTableSide && p.kw == kExactTableSide);
  return !p.pad_one && table_filter && BorderClasses(p) <= kTableClasses;
}
// The launcher's BinaryGemmProblem::class_numbering: compact classes are (vertical class: top t is t, bottom b
// is top_max + b) x horizontal classes + horizontal class.
ClassNumbering ClassNumberingOf(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  if (p.compact_classes) {
    const int horizontal_classes = m.left + m.right + 1;
    return {horizontal_classes, horizontal_classes, 1, 1, m.top * horizontal_classes, m.left};
  }
  return {(m.bottom + 1) * (m.left + 1) * (m.right + 1), (m.left + 1) * (m.right + 1), m.right + 1, 1, 0, 0};
}
__device__ __forceinline__ int BorderClass(const BinaryGemmProblem& p, FrameExcess e) {
  const ClassNumbering& n = p.class_numbering;
  return e.top * n.top + e.bottom * n.bottom + e.left * n.left + e.right * n.right +
         (e.bottom > 0 ? n.bottom_offset : 0) + (e.right > 0 ? n.right_offset : 0);
}

// The edge table, for "zero"-padded problems without the class table (filters larger than 5x5, or more than
// 25 classes even when compact: 3x3 with padding 3, 7x7 with padding 3, AlexNet's 11x11 conv1 at stride 4):
// rows 1 .. EdgeRows of TileColumns::correction hold, per column, the sums of C - 2 popc_tap over
// the filter's first t rows (t = 1 .. the largest top excess), its last b rows, first l columns and last r
// columns, in that order; then, where they fit, the corner blocks (KeepsEdgeCorners). Where the filter is no
// taller than the frame (kh <= in_h), no receptive field sticks out at both the top and the bottom, and
// likewise for the sides, so a field's out-of-frame taps are one row strip, one column strip, or both less
// their overlap, the corner block. Summing every out-of-frame tap's popcount per value instead made AlexNet's
// 5x5 conv2 (28 x 28, a quarter of its rows at the border; compact classes now) 44x slower than with "one"
// padding, its 11x11 conv1 15x (session 38).
__host__ __device__ __forceinline__ int EdgeRows(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  return m.top + m.bottom + m.left + m.right;
}
bool KeepsEdgeTable(const BinaryGemmProblem& p) {
  return !p.pad_one && !p.correction_table && p.kh <= p.in_h && p.kw <= p.in_w && EdgeRows(p) < kTableClasses;
}
// Whether the edge table also holds the corner blocks (after the strips: (top + bottom) x (left + right)
// of them, 16 at 5x5 with padding 2); where not (7x7 with padding 3), a corner field sums its taps.
bool KeepsEdgeCorners(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  return p.edge_table && EdgeRows(p) + (m.top + m.bottom) * (m.left + m.right) < kTableClasses;
}

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
  // Without the table, rows 1 .. may hold the edge table (p.edge_table, FillEdgeTable).
  int correction[kTableClasses][kCols];
  int popc_b[kCols];
  int threshold[kCols];
  int flip[kCols];
  // The accumulator epilogues' form of the threshold: bit = (4 acc + k_real - 2 popc_a >= bound) XOR flip,
  // bound = threshold + 2 popc_b, plus 1 where flipped (dot <= t is the negation of dot >= t + 1).
  int bound[kCols];
  uint32_t flip_word[kCols / 32];  // the flip flags of 32 columns, bit c % 32 for column c
  float scale[kCols];
  float bias[kCols];
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

// The threshold epilogue compares two columns' values with their bounds in one 32-bit addition where
// k_real <= kPairedBoundsMaxK (PairsBounds): with y = 4 (acc_0 + 2^16 acc_1) + v0 (1 + 2^16) + PairedBounds,
// the 16-bit half of column e is x_e - bound_e + 2^15 (x = 4 acc + v0), whose bit 15 is the column's bit.
// Every x lies in [-k, 3k] and every bound (classes included; kUnreachableBound taken as 3k + 1) in
// [-2k - 1, 4k + 3], so the low half stays within [0, 2^16) and never carries into the high one.
inline constexpr int kPairedBoundsMaxK = 6400;
static_assert(5 * kPairedBoundsMaxK + 3 < (1 << 15), "a half's x - bound + 2^15 stays within 16 bits");
__device__ __forceinline__ bool PairsBounds(const BinaryGemmProblem& p) {
  return p.epilogue == Epilogue::kBits && p.k_real <= kPairedBoundsMaxK;
}
__device__ __forceinline__ uint32_t PairedBounds(const BinaryGemmProblem& p, int bound_0, int bound_1) {
  auto half = [&](int bound) { return 32768 - (bound == kUnreachableBound ? 3 * p.k_real + 1 : bound); };
  return static_cast<uint32_t>(half(bound_0)) + (static_cast<uint32_t>(half(bound_1)) << 16);
}
// prmt.b32: byte i of the result is byte (s >> 4 i) & 7 of (b:a), or where bit 3 of that nibble is set, that
// byte's top bit copied over all 8 bits (the sign mode, which __byte_perm does not offer).
__device__ __forceinline__ uint32_t BytePermute(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// The threshold bits of the 8 values of one output row that an accumulator thread (quad lane t) holds:
// columns 8 j + 2 t + e (j < 4, e < 2) of its fragments, at bit 8 j + e of the result; the quad's other
// lanes fill the bits in between once shifted by 2 t. a[j][e]: the values' AND-popcounts; v0: the row's
// k_real - 2 popc(a); bounds: the row's bounds from its first column 2 t on (bounds[8 j] ...).
// Paired (PairsBounds: PairedBounds in the even slots): two columns per 32-bit addition; bits 15 and 31 of
// y are their bits, gathered by byte permutes that copy a byte's top bit over the byte: 2.1 instructions a
// value against 3 unpaired.
__device__ __forceinline__ uint32_t ThresholdBitsPaired(const int (&a)[4][2], int v0, const int* bounds) {
  const uint32_t v0_pair = static_cast<uint32_t>(v0) * 0x10001u;
  uint32_t y[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t bound = static_cast<uint32_t>(bounds[8 * j]);
    const uint32_t pair = static_cast<uint32_t>(a[j][0]) + (static_cast<uint32_t>(a[j][1]) << 16);
    y[j] = (pair << 2) + v0_pair + bound;
  }
  // bytes (bit 15 of y[0], bit 31 of y[0], bit 15 of y[1], bit 31 of y[1]), each 0 or 0xff; then the
  // even columns' bytes and the odd columns' in the order of their pairs
  const uint32_t first = BytePermute(y[0], y[1], 0xFDB9), second = BytePermute(y[2], y[3], 0xFDB9);
  const uint32_t even = BytePermute(first, second, 0x6420), odd = BytePermute(first, second, 0x7531);
  return (even & 0x01010101u) | (odd & 0x02020202u);
}
// Unpaired: each value's bit is the sign of its difference from the bound (set: below it), shifted into the
// word by a funnel shift after a multiply-add and a subtraction: 5.4 warp instructions a value in the wgmma
// epilogue, 5.7 with a compare, a select and an OR per value instead (ncu, sessions 19-20). The values go in
// from the highest position down, even columns by 1 bit (their sign), odd ones by 7 (bits 25-31: the sign
// and, where |difference| < 2^25 (ColumnBound), six copies of it that fill the gap to the next pair).
__device__ __forceinline__ uint32_t ThresholdBitsUnpaired(const int (&a)[4][2], int v0, const int* bounds) {
  uint32_t below = 0;
#pragma unroll
  for (int j = 3; j >= 0; --j) {
    const int2 bound = *reinterpret_cast<const int2*>(&bounds[8 * j]);
    const int x0 = 4 * a[j][0] + v0, x1 = 4 * a[j][1] + v0;
    below = __funnelshift_l(static_cast<uint32_t>(x1 - bound.y), below, 7);
    below = __funnelshift_l(static_cast<uint32_t>(x0 - bound.x), below, 1);
  }
  return ~below & 0x03030303u;  // the bits themselves, the filler gone
}

// Where PairsBounds: `bound` of local column lc (each thread of a whole warp its column) paired with the next
// column's in `*pair` by the even column's thread.
__device__ __forceinline__ void StorePairedBounds(const BinaryGemmProblem& p, int bound, int lc, uint32_t* pair) {
  const int next = __shfl_xor_sync(0xffffffffu, bound, 1);
  if (lc % 2 == 0) *pair = PairedBounds(p, bound, next);
}

// A column's threshold and flip (0 past N or for other epilogues).
struct ColumnThreshold {
  int threshold, flip;
};
__device__ __forceinline__ ColumnThreshold LoadColumnThreshold(const BinaryGemmProblem& p, int col) {
  const bool real = p.epilogue == Epilogue::kBits && col < p.n;
  return {real ? p.threshold[col] : 0, real ? p.flip[col] : 0};
}

// Column `col`'s tap terms C - 2 popc_tap in registers, term[i][j] for the filter's taps (i < kh, j < kw; every
// one where `exact`, the filter being kSide x kSide), 0 elsewhere and their popcounts 0 past N; whole: their sum,
// total: the popcounts' sum (popc(b)). The class tables' fills start from them.
template <int kSide>
__device__ __forceinline__ void LoadTapTerms(const BinaryGemmProblem& p, int col, int kh, int kw, bool exact,
                                             int (&term)[kSide][kSide], int& whole, int& total) {
#pragma unroll
  for (int i = 0; i < kSide; ++i) {
#pragma unroll
    for (int j = 0; j < kSide; ++j) {
      const bool real = exact || (i < kh && j < kw);
      const int popc = real && col < p.n ? p.tap_popc[(i * kw + j) * p.n + col] : 0;
      term[i][j] = real ? p.c - 2 * popc : 0;
      whole += term[i][j];
      total += popc;
    }
  }
}

// Fills the border-class corrections of local column `lc` (p.correction_table): a class's
// correction is the sum of C - 2 popc over the filter's taps minus that over the rectangle of taps inside
// the frame. Every tap index is a compile-time one (kSide x kSide taps), so the taps' terms stay in
// registers: a prefix-sum array indexed by runtime bounds lived in local memory (ncu: its loads stalled the
// CTA at the start of every column tile). kSide < kTableSide: a kSide x kSide filter (FillCorrectionTable
// takes 3x3 filters so); kTableSide: any filter of at most that many taps a side, masked by runtime bounds,
// about four times the instructions (ncu, session 17: 516 a warp for a 3x3 filter in the band kernel,
// where all 16 warps fill the table before the first tile). Depends on the column tile only. `parts`
// threads may share a column: part `part` fills every parts-th (left, right) excess pair's classes (the
// band kernel's four warpgroups: its "zero"-padding set-up 4.0 -> 3.5 us, session 14). add_bounds: the
// column's ColumnBound (from `th`) is added to every class (AddBoundsToClasses' work, done by a thread that
// knows the bound without waiting for another's). kSideExcess > 0: no side's excess is larger, and the
// class loops run to it unrolled (their runtime form was 297 instructions a warp of the band kernel's 3x3
// "zero" set-up, much of it loop control: ncu, session 19). Returns the column's popc(b), summed over taps.
template <int kCols, int kSide, int kSideExcess>
__device__ __forceinline__ int FillCorrectionTableOf(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col0,
                                                     int lc, int part, int parts, bool add_bounds,
                                                     ColumnThreshold th) {
  static_assert(kSide <= kTableSide, "the table's filters");
  static_assert(kSideExcess == 0 || kSide < kTableSide, "unrolled classes of an exact filter size only");
  constexpr bool kExact = kSide < kTableSide;
  const int col = col0 + lc, kh = kExact ? kSide : p.kh, kw = kExact ? kSide : p.kw;
  int term[kSide][kSide];
  int whole = 0, total = 0;
  LoadTapTerms(p, col, kh, kw, kExact, term, whole, total);
  const int bound = add_bounds ? ColumnBound(p, col, th.threshold, th.flip, total) : 0;
  const FrameExcess m = p.max_excess;
  // BorderClass's strides (four-way product classes: compact ones take FillCorrectionTableByClass)
  const int right_stride = 1, left_stride = m.right + 1, bottom_stride = (m.left + 1) * left_stride,
            top_stride = (m.bottom + 1) * bottom_stride;
  // where the loops run to kSideExcess, the classes past the problem's excess are skipped
  constexpr FrameExcess kUnrolled = {kSideExcess, kSideExcess, kSideExcess, kSideExcess};
  const FrameExcess end = kSideExcess > 0 ? kUnrolled : m;
#pragma unroll
  for (int left = 0; left <= end.left; ++left) {
#pragma unroll
    for (int right = 0; right <= end.right; ++right) {
      if (left > m.left || right > m.right || (left * (m.right + 1) + right) % parts != part) continue;
      int row_inside[kSide];  // per filter row: the sum over its taps inside [left, kw - right)
#pragma unroll
      for (int i = 0; i < kSide; ++i) row_inside[i] = 0;
#pragma unroll
      for (int j = 0; j < kSide; ++j) {
        const bool inside_frame = j >= left && j < kw - right;
#pragma unroll
        for (int i = 0; i < kSide; ++i) row_inside[i] += inside_frame ? term[i][j] : 0;
      }
#pragma unroll
      for (int top = 0; top <= end.top; ++top) {
#pragma unroll
        for (int bottom = 0; bottom <= end.bottom; ++bottom) {
          if (top > m.top || bottom > m.bottom) continue;
          int inside = 0;
#pragma unroll
          for (int i = 0; i < kSide; ++i) inside += i >= top && i < kh - bottom ? row_inside[i] : 0;
          // columns past N keep their unreachable bound
          const int value = bound == kUnreachableBound ? bound : whole - inside + bound;
          const int cls = top * top_stride + bottom * bottom_stride + left * left_stride + right * right_stride;
          if (add_bounds && PairsBounds(p)) {
            StorePairedBounds(p, value, lc, reinterpret_cast<uint32_t*>(&cols.correction[cls][lc]));
          } else {
            cols.correction[cls][lc] = value;
          }
        }
      }
    }
  }
  return total;
}
// Fills local column `lc`'s edge table (p.edge_table): each strip's sum extends the previous one by a filter
// row or column. Columns past N get zeros (their bounds stay unreachable). Set-up code, once a column tile:
// its loops are not unrolled (unrolled, they moved the band kernel's registers into spills).
template <int kCols>
__device__ __forceinline__ void FillEdgeTable(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col0, int lc) {
  const int col = col0 + lc;
  const FrameExcess m = p.max_excess;
  auto term = [&](int i, int j) { return col < p.n ? p.c - 2 * p.tap_popc[(i * p.kw + j) * p.n + col] : 0; };
  // `count` strips from filter row (column) `first` on, one more row (column) each, into rows row0 + 1 ...
  auto row_strips = [&](int first, int step, int count, int row0) {
    int sum = 0;
#pragma unroll 1
    for (int s = 0; s < count; ++s) {
#pragma unroll 1
      for (int j = 0; j < p.kw; ++j) sum += term(first + s * step, j);
      cols.correction[row0 + 1 + s][lc] = sum;
    }
  };
  auto column_strips = [&](int first, int step, int count, int row0) {
    int sum = 0;
#pragma unroll 1
    for (int s = 0; s < count; ++s) {
#pragma unroll 1
      for (int i = 0; i < p.kh; ++i) sum += term(i, first + s * step);
      cols.correction[row0 + 1 + s][lc] = sum;
    }
  };
  row_strips(0, 1, m.top, 0);
  row_strips(p.kh - 1, -1, m.bottom, m.top);
  column_strips(0, 1, m.left, m.top + m.bottom);
  column_strips(p.kw - 1, -1, m.right, m.top + m.bottom + m.left);
  if (!p.edge_corners) return;
  // the corner blocks: row strip v (top v or bottom v - m.top rows) x column strip h, after the strips
  const int row_count = m.top + m.bottom, column_count = m.left + m.right;
#pragma unroll 1
  for (int v = 1; v <= row_count; ++v) {
    const int i0 = v <= m.top ? 0 : p.kh - (v - m.top), i1 = v <= m.top ? v : p.kh;
#pragma unroll 1
    for (int h = 1; h <= column_count; ++h) {
      const int j0 = h <= m.left ? 0 : p.kw - (h - m.left), j1 = h <= m.left ? h : p.kw;
      int sum = 0;
#pragma unroll 1
      for (int i = i0; i < i1; ++i) {
#pragma unroll 1
        for (int j = j0; j < j1; ++j) sum += term(i, j);
      }
      cols.correction[row_count + column_count + (v - 1) * column_count + h][lc] = sum;
    }
  }
}

// The next (first, second) excess pair of one direction in BorderClass's order: (top, bottom) for the vertical
// classes, (left, right) for the horizontal ones. A class is v H + h in both numberings (H horizontal classes).
// Compact: (0, 0), then first = 1 .. first_max, then second = 1 .. second_max; four-way: second counts fastest.
__device__ __forceinline__ void NextExcessPair(bool compact, int& first, int& second, int first_max, int second_max) {
  if (compact ? second == 0 && first < first_max : second == second_max) {
    ++first;
    if (!compact) second = 0;
  } else {
    if (compact) first = 0;
    ++second;
  }
}
// FillCorrectionTableOf's work for compact classes and 5x5 filters: the taps' terms in registers (up to 5 x 5,
// masked by the filter's size); per horizontal class the column-masked sums of the filter rows, then per vertical
// class the row-masked sum of those (loops that are not unrolled; part `part` of `parts` stores every parts-th
// class). FillCorrectionTableOf's unrolled pairs of excesses, at 5 x 5 taps, moved the band and dense kernels'
// registers into spills (ptxas); a loop over classes that decoded each class by a division and summed 25 masked
// terms took 27% of AlexNet's conv2 stall samples on wgmma, every CTA filling it before its first tile (ncu,
// session 39).
template <int kCols>
__device__ __forceinline__ int FillCorrectionTableByClass(const BinaryGemmProblem& p, TileColumns<kCols>& cols,
                                                          int col0, int lc, int part, int parts, bool add_bounds,
                                                          ColumnThreshold th) {
  constexpr int kSide = kExactTableSide;
  const int col = col0 + lc;
  int term[kSide][kSide];
  int whole = 0, total = 0;
  LoadTapTerms(p, col, p.kh, p.kw, false, term, whole, total);
  const int bound = add_bounds ? ColumnBound(p, col, th.threshold, th.flip, total) : 0;
  const FrameExcess m = p.max_excess;
  const bool compact = p.compact_classes;
  const int vertical = compact ? m.top + m.bottom + 1 : (m.top + 1) * (m.bottom + 1);
  const int horizontal = compact ? m.left + m.right + 1 : (m.left + 1) * (m.right + 1);
  int left = 0, right = 0;
#pragma unroll 1
  for (int h = 0; h < horizontal; ++h, NextExcessPair(compact, left, right, m.left, m.right)) {
    // per filter row: the sum over its taps inside [left, kw - right) (bit j of the mask: column j inside)
    const unsigned columns_inside = ((1u << (p.kw - right)) - 1) >> left << left;
    int row_inside[kSide];
#pragma unroll
    for (int i = 0; i < kSide; ++i) {
      row_inside[i] = 0;
#pragma unroll
      for (int j = 0; j < kSide; ++j) row_inside[i] += columns_inside >> j & 1 ? term[i][j] : 0;
    }
    int top = 0, bottom = 0;
#pragma unroll 1
    for (int v = 0; v < vertical; ++v, NextExcessPair(compact, top, bottom, m.top, m.bottom)) {
      const int cls = v * horizontal + h;
      if (cls % parts != part) continue;
      const unsigned rows_inside = ((1u << (p.kh - bottom)) - 1) >> top << top;
      int inside = 0;
#pragma unroll
      for (int i = 0; i < kSide; ++i) inside += rows_inside >> i & 1 ? row_inside[i] : 0;
      // columns past N keep their unreachable bound
      const int value = bound == kUnreachableBound ? bound : whole - inside + bound;
      if (add_bounds && PairsBounds(p)) {
        StorePairedBounds(p, value, lc, reinterpret_cast<uint32_t*>(&cols.correction[cls][lc]));
      } else {
        cols.correction[cls][lc] = value;
      }
    }
  }
  return total;
}

template <int kCols>
__device__ __forceinline__ int FillCorrectionTable(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col0,
                                                   int lc, int part = 0, int parts = 1, bool add_bounds = false,
                                                   ColumnThreshold th = {}) {
  if (p.compact_classes || p.kh > kTableSide || p.kw > kTableSide) {  // 5x5 filters, paddings past 1 at 3x3
    return FillCorrectionTableByClass<kCols>(p, cols, col0, lc, part, parts, add_bounds, th);
  }
  if (p.kh == 3 && p.kw == 3) {
    const FrameExcess m = p.max_excess;
    if (max(max(m.top, m.bottom), max(m.left, m.right)) <= 1) {  // padding of at most 1: 16 classes or fewer
      return FillCorrectionTableOf<kCols, 3, 1>(p, cols, col0, lc, part, parts, add_bounds, th);
    }
    return FillCorrectionTableOf<kCols, 3, 0>(p, cols, col0, lc, part, parts, add_bounds, th);
  }
  return FillCorrectionTableOf<kCols, kTableSide, 0>(p, cols, col0, lc, part, parts, add_bounds, th);
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
    cols.bound[lc] = ColumnBound(p, col, th.threshold, th.flip, popc_b);
    if (PairsBounds(p) && !p.correction_table) {
      StorePairedBounds(p, cols.bound[lc], lc, reinterpret_cast<uint32_t*>(&cols.correction[0][lc]));
    }
    const uint32_t flips = __ballot_sync(0xffffffffu, th.flip != 0);
    if (lc % 32 == 0) cols.flip_word[lc / 32] = flips;
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

// Copies K block `kb` of the activation rows of a tile into a stage. kVec words per copy (4 when every
// tap's words are 16-byte aligned, else 1). Each thread keeps one word position, so the tap division runs
// once per stage, and copies the same compile-time number of rows, kThreads / kCopiesPerRow apart: an
// unrolled loop with constant stage offsets. Which copies share a quarter-warp (8 lanes, one request):
//   along rows: 8 consecutive rows at one word position. For a tap of 16 bytes (C <= 128) these are 8
//     consecutive pixels, 128 contiguous bytes; in the core-matrix layout their shared-memory writes fill one
//     128-byte row block. Where a tap has more bytes (and in a bmm) the 8 rows lie apart: 8 half-used 32-byte
//     sectors per quarter, twice the bytes' L2 sectors (ncu, mma.sync bmm 16384^3 in the core-matrix layout:
//     27% of its L2 sectors excess, and 8-way conflicting shared-memory writes).
//   along a row (kSwizzledRows, where a tap has >= 32 bytes): one row's 128 contiguous bytes of the K block,
//     which that layout keeps in one 128-byte line of shared memory: no excess sectors, no conflicts.
// kSkipPastK: the stage's words past K are zeros already (WgmmaKernel's short-K instances), so those copies
// are left out.
template <int kRows, int kVec, int kThreads, ALayout kLayout = ALayout::kCoreMatrices, bool kSkipPastK = false>
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
  const int tap = Quotient(kword, div.cw);
  const int cword = kword - tap * p.cw;
  const int fkh = Quotient(tap, div.kw), fkw = tap - fkh * p.kw;
  const int tap_offset = (fkh * p.in_w + fkw) * p.cw + cword;
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

// The edge-table rows of a receptive field's out-of-frame taps: its row strip's, its column strip's and its
// corner block's (0: none); `usable` is false without the edge table, and for a corner field where the table
// holds no corner blocks.
struct EdgeRowsOfField {
  int row_strip = 0, column_strip = 0, corner = 0;
  bool usable = false;
};
__device__ __forceinline__ EdgeRowsOfField EdgeRowsOf(const BinaryGemmProblem& p, FrameExcess e) {
  EdgeRowsOfField r;
  const bool rows_out = e.top + e.bottom > 0, columns_out = e.left + e.right > 0;
  if (!p.edge_table || (rows_out && columns_out && !p.edge_corners)) return r;
  const FrameExcess m = p.max_excess;
  const int row_strips = m.top + m.bottom, column_strips = m.left + m.right;
  const int v = e.top > 0 ? e.top : m.top + e.bottom, h = e.left > 0 ? e.left : m.left + e.right;
  r.row_strip = rows_out ? v : 0;
  r.column_strip = columns_out ? row_strips + h : 0;
  r.corner = rows_out && columns_out ? row_strips + column_strips + (v - 1) * column_strips + h : 0;
  r.usable = true;
  return r;
}
// A field's out-of-frame sum from its edge-table rows: the corner block is in both strips.
template <int kCols>
__device__ __forceinline__ int EdgeCorrection(const TileColumns<kCols>& cols, const EdgeRowsOfField& r, int lc) {
  int correction = 0;
  if (r.row_strip != 0) correction += cols.correction[r.row_strip][lc];
  if (r.column_strip != 0) correction += cols.correction[r.column_strip][lc];
  if (r.corner != 0) correction -= cols.correction[r.corner][lc];
  return correction;
}

// What "zero" padding takes back from a "one"-padded dot of a field with excess e, from the class table or
// summed over the out-of-frame taps of C - 2 popc_tap (not from the edge table).
template <int kCols>
__device__ __forceinline__ int ExcludedTapsOf(const BinaryGemmProblem& p, const TileColumns<kCols>& cols,
                                              FrameExcess e, int lc, int col) {
  if (e.top + e.bottom + e.left + e.right == 0) return 0;
  if (p.correction_table) return cols.correction[BorderClass(p, e)][lc];
  int correction = 0;
  for (int i = 0; i < p.kh; ++i) {
    for (int j = 0; j < p.kw; ++j) {
      if (i < e.top || i >= p.kh - e.bottom || j < e.left || j >= p.kw - e.right) {
        correction += p.c - 2 * p.tap_popc[(i * p.kw + j) * p.n + col];
      }
    }
  }
  return correction;
}
// The same for the field at origin o, from whichever table the problem keeps.
template <int kCols>
__device__ __forceinline__ int ExcludedTaps(const BinaryGemmProblem& p, const TileColumns<kCols>& cols, int4 o,
                                            int lc, int col) {
  const FrameExcess e = ExcessOf(p, o.y, o.z);
  const EdgeRowsOfField edge = EdgeRowsOf(p, e);
  return edge.usable ? EdgeCorrection(cols, edge, lc) : ExcludedTapsOf(p, cols, e, lc, col);
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

// For the epilogues straight from accumulators: whether the row at `origin` (RowOrigin) needs the
// "zero"-padding correction (an output pixel whose receptive field leaves the frame).
__device__ __forceinline__ bool BorderRow(const BinaryGemmProblem& p, const int4& origin) {
  if (p.pad_one) return false;
  return origin.w && !(origin.y >= 0 && origin.y + p.kh <= p.in_h && origin.z >= 0 && origin.z + p.kw <= p.in_w);
}

// The "zero"-padding corrections of one border row for the columns an accumulator thread holds:
// value k at local column first_lc + 8 (k / 2) + k % 2. A runtime loop, so that the corrections are not
// inlined into every site of the unrolled epilogues (that once made the kernels ~700 KB of straight-line
// code, slow to fetch) and `excl` lives in local memory instead of competing with the accumulators for
// registers; it is touched only for border rows. Values of columns past N are not meaningful.
template <int kCols, int kValues>
__device__ __forceinline__ void BorderCorrections(const BinaryGemmProblem& p, const TileColumns<kCols>& cols,
                                                  int4 origin, int col0, int first_lc, int (&excl)[kValues]) {
  const FrameExcess e = ExcessOf(p, origin.y, origin.z);
  const EdgeRowsOfField edge = EdgeRowsOf(p, e);
  if (edge.usable) {  // a loop of its own: one loop over both forms kept both forms' values live (ptxas)
#pragma unroll 1
    for (int k = 0; k < kValues; ++k) excl[k] = EdgeCorrection(cols, edge, first_lc + 8 * (k >> 1) + (k & 1));
    return;
  }
#pragma unroll 1
  for (int k = 0; k < kValues; ++k) {
    const int lc = first_lc + 8 * (k >> 1) + (k & 1), col = col0 + lc;
    excl[k] = col < p.n ? ExcludedTapsOf(p, cols, e, lc, col) : 0;
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

// A border row's bounds of columns lc, lc + 1 in the form ThresholdBitsPaired / Unpaired read.
__device__ __forceinline__ void StoreRowBounds(const BinaryGemmProblem& p, int* row_bounds, int lc, int bound0, int bound1) {
  if (PairsBounds(p)) {
    row_bounds[lc] = static_cast<int>(PairedBounds(p, bound0, bound1));
  } else {
    row_bounds[lc] = bound0;
    row_bounds[lc + 1] = bound1;
  }
}

// A border row's own bounds, for problems without the table: bound + the row's excluded taps of each of an
// accumulator thread's columns first_lc + 8 j + e (j < 4, e < 2), at the same columns of `row_bounds` and in
// the form ThresholdBitsPaired / Unpaired read. A runtime loop: run for border rows only, its code once.
template <int kCols>
__device__ __forceinline__ void BorderRowBounds(const BinaryGemmProblem& p, const TileColumns<kCols>& cols,
                                                int4 origin, int col0, int first_lc, int* row_bounds) {
#pragma unroll 1
  for (int j = 0; j < 4; ++j) {
    const int lc = first_lc + 8 * j;
    int bound[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int plain = cols.bound[lc + e];  // columns past N keep their unreachable bound
      bound[e] = plain == kUnreachableBound ? plain : plain + ExcludedTaps(p, cols, origin, lc + e, col0 + lc + e);
    }
    StoreRowBounds(p, row_bounds, lc, bound[0], bound[1]);
  }
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

// mbarriers of the stage pipelines (sm_80 has them and cp.async arrivals; try_wait is sm_90's).
__device__ __forceinline__ void BarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void BarrierWait(uint32_t bar, int parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void BarrierArriveOnCopies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Grouped raster over (row tiles, column tiles): 8 row tiles share a band of column tiles for L2 reuse.
__device__ __forceinline__ void TileCoordinates(int pid, int m_tiles, int n_tiles, int& tile_m, int& tile_n) {
  constexpr int kGroup = 8;
  const int group = pid / (kGroup * n_tiles);
  const int first_m = group * kGroup;
  const int group_size = min(m_tiles - first_m, kGroup);
  const int in_group = pid % (kGroup * n_tiles);
  tile_m = first_m + in_group % group_size;
  tile_n = in_group / group_size;
}

// ---------------------------------------------------------------------------------------------------
// mma.sync and CUDA-core engines: classic multistage cp.async pipeline, all threads load and compute.

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
  // A's stages in 128-byte rows (the weights' in core matrices): LoadActivationStage can then copy a row's
  // K block by one quarter-warp
  static constexpr ALayout kALayout = ALayout::kSwizzledRows;
  struct Accumulators {
    int v[4][kFrags][4];  // [16-row fragment][8-column fragment][register]
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
  // code (a tile's epilogue is fetched cold: ncu put a third of its stalls on instruction fetch, session 29).
  // row_class: EpilogueRowClass of every tile row; scratch: the stages, free once every warp left the k loop.
  // kBorderBoundsReady: the border rows' bounds of a problem without the table are in scratch already
  // (DenseBorderRowBounds).
  template <bool kBorderBoundsReady = false>
  __device__ static void StoreDirect(const Accumulators& acc, const BinaryGemmProblem& p, const int* popc_a,
                                     const int4* origins, const int8_t* row_class, int* scratch,
                                     const TileColumns<kCols>& cols, int tile_m, int col0, int tid) {
    if (p.epilogue != Epilogue::kBits) {
      StoreDirectValues(acc, p, popc_a, origins, cols, tile_m, col0, tid);
    } else if (PairsBounds(p)) {
      StoreDirectBits<true, kBorderBoundsReady>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
    } else {
      StoreDirectBits<false, kBorderBoundsReady>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
    }
  }

  // The threshold epilogue. A thread's rows warp_row + 8 i + g (i = 2 mf + h) each compare with one row of
  // bounds: cols.correction[class] (class 0: the plain bounds), or for a border row of a problem without
  // the table, its own row in `scratch`. The quad's words are completed by a reduce-scatter, after which
  // lane t stores rows 4 q + t: 6 shuffles and 2 stores a thread for 8 rows, not 16 and 8.
  template <bool kPaired, bool kBorderBoundsReady>
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
    auto row_word = [&](int i) {
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
      return (kPaired ? ThresholdBitsPaired(a, v0, bounds) : ThresholdBitsUnpaired(a, v0, bounds)) << (2 * t);
    };
    const long long row0 = static_cast<long long>(tile_m) * kRows + warp_row + g;
    const int out_words = (p.n + 31) / 32;
    const bool inside = col0 + warp_col < p.n;
    uint32_t* out = static_cast<uint32_t*>(p.out) + (col0 + warp_col) / 32;
    const uint32_t flip = cols.flip_word[warp_col / 32];
    // The quad's words of rows 4 q .. 4 q + 3 in, lane t's row 4 q + t out. Lanes 0, 1 first keep rows 4 q + j,
    // lanes 2, 3 rows 4 q + 2 + j. Four words a call, not an array of eight indexed by q: with the array,
    // nvcc kept all eight in local memory as dead stores (8 STL a thread and tile; ncu at 16384^3, session 31).
    auto store_rows = [&](int q, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
      const uint32_t half0 = ((t & 2) ? w2 : w0) | __shfl_xor_sync(0xffffffffu, (t & 2) ? w0 : w2, 2);
      const uint32_t half1 = ((t & 2) ? w3 : w1) | __shfl_xor_sync(0xffffffffu, (t & 2) ? w1 : w3, 2);
      const uint32_t mine = ((t & 1) ? half1 : half0) | __shfl_xor_sync(0xffffffffu, (t & 1) ? half0 : half1, 1);
      const long long row = row0 + 8 * (4 * q + t);
      if (inside && row < p.pooled_rows) out[row * out_words] = mine ^ flip;
    };
    store_rows(0, row_word(0), row_word(1), row_word(2), row_word(3));
    store_rows(1, row_word(4), row_word(5), row_word(6), row_word(7));
  }

  // The int32 / affine epilogues.
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
        // eight rows took 3.6 us of a C = 512 tile's 8.3 us epilogue (clock64 trace, session 29)
        const int4 origin = origins[r];
        const bool border = BorderRow(p, origin);
        const int v0 = p.k_real - 2 * popc_a[r];
        int excl[2 * kFrags];
        if (border) BorderCorrections(p, cols, origin, col0, warp_col + 2 * t, excl);
#pragma unroll
        for (int nf = 0; nf < kFrags; ++nf) {
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

struct SimtEngine {
  static constexpr int kRows = 64, kCols = 64, kStages = 3, kThreads = 256;
  static constexpr bool kDirectStore = false;
  static constexpr ALayout kALayout = ALayout::kCoreMatrices;
  struct Accumulators {
    int v[4][4];  // rows ty + 16 i, columns tx + 16 j: conflict-free 16-byte shared loads
  };

  // after_step as in MmaSyncEngine, every step's call ahead of the popcounts: a CUDA-core k loop has no
  // tensor work to issue the copies behind.
  template <class AfterStep>
  __device__ static void Compute(Accumulators& acc, const uint8_t* stage, uint32_t, int tid, AfterStep&& after_step) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) after_step(ks);
    const int ty = tid / 16, tx = tid % 16;
    const uint8_t* sa = stage;
    const uint8_t* sb = stage + kRows * 128;
#pragma unroll 2
    for (int chunk = 0; chunk < 8; ++chunk) {
      uint4 a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const uint4*>(sa + StageOffset(ty + 16 * i, chunk));
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = *reinterpret_cast<const uint4*>(sb + StageOffset(tx + 16 * j, chunk));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc.v[i][j] += __popc(a[i].x & b[j].x) + __popc(a[i].y & b[j].y) + __popc(a[i].z & b[j].z) +
                         __popc(a[i].w & b[j].w);
        }
      }
    }
  }

  __device__ static void Store(const Accumulators& acc, int* tile, int ld, int tid) {
    const int ty = tid / 16, tx = tid % 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) tile[(ty + 16 * i) * ld + tx + 16 * j] = acc.v[i][j];
    }
  }
};

template <class Engine>
__host__ __device__ constexpr int ClassicBarrierOffset() {
  constexpr int stage = (Engine::kRows + Engine::kCols) * 128;
  // the stages, origins, popc_a, cols, and (StoreDirect) row_class
  constexpr int bytes = Engine::kStages * stage + Engine::kRows * 16 + Engine::kRows * 4 +
                        sizeof(TileColumns<Engine::kCols>) + (Engine::kDirectStore ? Engine::kRows : 0);
  return (bytes + 7) / 8 * 8;
}
template <class Engine>
constexpr int ClassicSmemBytes() {
  return ClassicBarrierOffset<Engine>() + 2 * Engine::kStages * 8;
}
static_assert(ClassicSmemBytes<MmaSyncNarrow>() <= 163 * 1024, "the narrow mma.sync engine runs on an A100");

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

template <class Engine, int kVec>
__global__ void __launch_bounds__(Engine::kThreads, 1) ClassicKernel(const BinaryGemmProblem p,
                                                                      const LaunchDivisors div, int m_tiles,
                                                                      int n_tiles) {
  constexpr int kRows = Engine::kRows, kCols = Engine::kCols, kStages = Engine::kStages;
  constexpr int kThreads = Engine::kThreads, kLd = kCols + 4;
  constexpr int kStageA = kRows * 128, kStageBytes = (kRows + kCols) * 128;
  static_assert(kRows * kLd * 4 <= kStages * kStageBytes, "the epilogue tile (StoreDirect: its scratch) reuses the stages");
  extern __shared__ __align__(1024) uint8_t smem[];
  int4* origins = reinterpret_cast<int4*>(smem + kStages * kStageBytes);
  int* popc_a = reinterpret_cast<int*>(origins + kRows);
  auto& cols = *reinterpret_cast<TileColumns<kCols>*>(popc_a + kRows);
  int8_t* row_class = reinterpret_cast<int8_t*>(&cols + 1);  // EpilogueRowClass (StoreDirect)
  const int tid = threadIdx.x;
  int tile_m, tile_n;
  TileCoordinates(blockIdx.x, m_tiles, n_tiles, tile_m, tile_n);
  const int col0 = tile_n * kCols;
  if (tid == 0) {
    const uint32_t bars = SmemAddress(smem) + ClassicBarrierOffset<Engine>();
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(bars + 8 * s, kThreads);                  // "full": every thread, once its copies landed
      BarrierInit(bars + 8 * (kStages + s), kThreads);  // "empty": every thread, once it read the stage
    }
  }
  const bool direct_bits = Engine::kDirectStore && p.pool_h * p.pool_w == 1 && p.epilogue == Epilogue::kBits;
  // The rows' set-up on the last threads, the columns' on the first, and a table's classes split over every
  // thread: on the same few warps, one after the other, they took 2.0 us of a C = 128 tile's 5.7 (1.3 us
  // split; 1.5 -> 1.05 us for BMM; clock64 trace, session 30).
  static_assert(kRows <= kThreads, "a thread per row of the set-up");
  if (const int r = tid - (kThreads - kRows); r >= 0) {
    const int4 origin = RowOrigin(p, tile_m, kRows, r);
    origins[r] = origin;
    if (direct_bits) row_class[r] = EpilogueRowClass(p, origin);
  }
  SetUpTileColumns<kCols, kThreads>(p, cols, col0, tid, direct_bits, p.edge_table);
  __syncthreads();

  const uint32_t base = SmemAddress(smem);
  const uint32_t full0 = base + ClassicBarrierOffset<Engine>(), empty0 = full0 + 8 * kStages;
  const int k_blocks = (p.k_words + kKBlockWords - 1) / kKBlockWords;
  const WeightStageLoader<kCols, kThreads> weights(p, col0 / 8, tid);
  auto load = [&](int kb) {
    const uint32_t stage = base + (kb % kStages) * kStageBytes;
    LoadActivationStage<kRows, kVec, kThreads, Engine::kALayout>(p, div, origins, stage, kb, tid);
    weights.Load(stage + kStageA, kb);
  };
  for (int s = 0; s < kStages - 1 && s < k_blocks; ++s) {
    load(s);
    BarrierArriveOnCopies(full0 + 8 * s);
  }
  typename Engine::Accumulators acc = {};
  int row_popc = 0;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int s = kb % kStages;
    BarrierWait(full0 + 8 * s, (kb / kStages) & 1);  // every thread's copies of stage kb landed
    // K block kb + kStages - 1's copies go into the stage that K block kb - 1 used, once every thread has
    // released it (its "empty" barrier): the activations behind step 1's mma, the weights behind step 3's.
    // A warp thus starts a block while others finish the last one. With a CTA barrier per K block instead
    // (and the copies behind steps 0-2), mma.sync at 16384^3 ran 14% slower; with these barriers, copies
    // behind steps 0-2 or 1-3 cost 7% and 5%, and all of them behind step 3 spilled registers.
    const bool loads = kb + kStages - 1 < k_blocks;
    const int ns = (kb + kStages - 1) % kStages;
    const uint32_t next = base + ns * kStageBytes;
    Engine::Compute(acc, smem + s * kStageBytes, base + s * kStageBytes, tid, [&](int ks) {
      if (!loads) return;
      if (ks == 1) {
        if (kb >= 1) BarrierWait(empty0 + 8 * ns, ((kb - 1) / kStages) & 1);
        LoadActivationStage<kRows, kVec, kThreads, Engine::kALayout>(p, div, origins, next, kb + kStages - 1, tid);
      }
      if (ks == 3) {
        weights.Load(next + kStageA, kb + kStages - 1);
        BarrierArriveOnCopies(full0 + 8 * ns);
      }
    });
    row_popc += StageRowPopcount<kRows, kThreads, Engine::kALayout>(smem + s * kStageBytes, tid);
    // Every thread arrives: with one arrival per warp after __syncwarp, compute-sanitizer's racecheck
    // reported the other lanes' reads as racing with the next fill's copies (session 28, job 5).
    BarrierArrive(empty0 + 8 * s);
  }
  row_popc = CombineRowPopcount<kRows, kThreads>(row_popc);
  if (const int row = RowOfPopcount<kRows, kThreads>(tid); row >= 0) popc_a[row] = row_popc;
  if constexpr (Engine::kDirectStore) {
    if (p.pool_h * p.pool_w == 1) {
      __syncthreads();
      Engine::StoreDirect(acc, p, popc_a, origins, row_class, reinterpret_cast<int*>(smem), cols, tile_m, col0, tid);
      return;
    }
  }
  __syncthreads();
  int* acc_tile = reinterpret_cast<int*>(smem);
  Engine::Store(acc, acc_tile, kLd, tid);
  __syncthreads();
  StoreTile<kRows, kCols, kLd, kThreads>(p, acc_tile, popc_a, cols, origins, tile_m, col0, tid);
}

// ---------------------------------------------------------------------------------------------------
// Dense taps: convolutions of fewer than 32 channels (a binarized image's first layer). A tap's C real bits
// fill one channel word, so the word layout's reduction is 32 / C times the real one (7x7 at C = 3: 49 words
// for 147 bits, 7 k256 steps, 49 four-byte copies a row). The dense-tap kernel instead gathers every row's
// and every column's real bits, tap after tap, into ceil(kh kw C / 32) words of one K block. Dot products,
// row and column popcounts and the padding corrections are those of the same bits in another order, and an
// out-of-frame tap gathers as zeros, as the word layout's zero fill.
inline bool UsesDenseTaps(const BinaryGemmProblem& p) {
  return p.cw == 1 && p.c < 32 && p.kh * p.kw > 1 && p.kh * p.kw * p.c <= kKBlockWords * 32;
}
// The k256 steps of a dense-tap K block: 8 words each.
__device__ __forceinline__ int DenseTapSteps(const BinaryGemmProblem& p) { return (p.kh * p.kw * p.c + 255) / 256; }

// Packs the C low bits of every tap's word in order, least significant bit first, then zeros: filter_row(fkh)
// returns the filter row's tap reader (its set-up once a filter row), whose call with fkw returns the word of
// tap (fkh, fkw); store(j, word) receives words 0 .. `words` - 1. Returns the popcount of the stored words.
template <class FilterRow, class Store>
__device__ __forceinline__ int PackDenseTaps(const BinaryGemmProblem& p, int words, FilterRow&& filter_row, Store&& store) {
  const uint32_t mask = (1u << p.c) - 1;
  uint64_t pending = 0;  // gathered bits not yet stored, the next one at bit `bits`
  int bits = 0, word = 0, popc = 0;
  auto put = [&](uint32_t w) {
    store(word++, w);
    popc += __popc(w);
  };
  const int row_width = p.kw * p.c;
  for (int fkh = 0; fkh < p.kh; ++fkh) {
    const auto tap_word = filter_row(fkh);
    if (row_width <= 32) {
      // a filter row's bits fit one word (7x7 at C = 3: 21): its taps are gathered in 32 bits, and the word
      // store's test and block run once a filter row instead of once a tap, where they were ~12 of ~26
      // instructions (session 37)
      uint32_t row_bits = 0;
      int shift = 0;
#pragma unroll 4
      for (int fkw = 0; fkw < p.kw; ++fkw, shift += p.c) row_bits |= (tap_word(fkw) & mask) << shift;
      pending |= static_cast<uint64_t>(row_bits) << bits;
      bits += row_width;
      if (bits >= 32) {
        put(static_cast<uint32_t>(pending));
        pending >>= 32;
        bits -= 32;
      }
      continue;
    }
#pragma unroll 4
    for (int fkw = 0; fkw < p.kw; ++fkw) {
      pending |= static_cast<uint64_t>(tap_word(fkw) & mask) << bits;
      bits += p.c;
      if (bits >= 32) {
        put(static_cast<uint32_t>(pending));
        pending >>= 32;
        bits -= 32;
      }
    }
  }
  if (bits > 0) put(static_cast<uint32_t>(pending));
  while (word < words) put(0u);
  return popc;
}

// The dense-tap kernel's shared memory: ClassicKernel's regions (two stages, origins, popc_a, the columns,
// the row classes), the gathered K block in stage 1 (A rows, then the column tile's weights, which stay
// there over all of a CTA's tiles), the epilogue's scratch from byte 0 (over stage 0 and A, which are free by
// then), and in place of the barriers the border prefix sums of DenseBorderRowBounds (int16: every sum is
// within +-kh kw C <= +-1024), (kh + 1) (kw + 1) <= kPrefixCorners a column: filters up to 7x7.
template <class Engine>
struct DenseTapSmem {
  static constexpr int kStage = (Engine::kRows + Engine::kCols) * 128;
  static constexpr int kWeights = kStage + Engine::kRows * 128;
  static constexpr int kPrefix = ClassicBarrierOffset<Engine>();
  static constexpr int kPrefixCorners = 64;
  static constexpr int kBytes = kPrefix + kPrefixCorners * Engine::kCols * 2;
  static_assert(Engine::kRows * (Engine::kCols + 4) * 4 <= kWeights, "the epilogues' scratch ends before the weights");
  static_assert(kWeights + Engine::kCols * 128 <= 2 * kStage, "the K block lies in stage 1");
};
// Where the border rows' bounds come from DenseBorderRowBounds: unpooled threshold epilogues of "zero"-padded
// problems without the class table. Other problems keep StoreDirectBits' own path, whose per-warp loop over
// its border rows left AlexNet's 11x11 conv1 2.7x slower than with "one" padding: with 56-pixel image rows,
// 31% of the warps' row steps held a border row, the other warps waited at the next barrier (ncu, session 39).
__host__ __device__ __forceinline__ bool DenseBorderBounds(const BinaryGemmProblem& p) {
  return p.pool_h * p.pool_w == 1 && p.epilogue == Epilogue::kBits && !p.pad_one && !p.correction_table;
}
// Whether DenseBorderRowBounds reads prefix sums (filters up to 7x7); where not, the kernel's instance with the
// edge-table form (DenseTapKernel's kEdgeBorders, the launcher's choice) runs the problem.
template <class Engine>
__host__ __device__ __forceinline__ bool DensePrefixSums(const BinaryGemmProblem& p) {
  return DenseBorderBounds(p) && (p.kh + 1) * (p.kw + 1) <= DenseTapSmem<Engine>::kPrefixCorners;
}

// Column c's 2-D prefix sums of its tap terms C - 2 popc_tap (0 past N), built once per CTA:
// prefix[(i (kw + 1) + j) kCols + c] sums the taps (i', j') with i' < i, j' < j.
template <int kCols>
__device__ __forceinline__ void BuildDenseBorderPrefix(const BinaryGemmProblem& p, int16_t* prefix, int col0, int c) {
  const int side = p.kw + 1, col = col0 + c;
  for (int j = 0; j < side; ++j) prefix[j * kCols + c] = 0;
  for (int i = 0; i < p.kh; ++i) {
    int row_sum = 0;
    prefix[((i + 1) * side) * kCols + c] = 0;
#pragma unroll 4
    for (int j = 0; j < p.kw; ++j) {
      row_sum += col < p.n ? p.c - 2 * p.tap_popc[(i * p.kw + j) * p.n + col] : 0;
      prefix[((i + 1) * side + j + 1) * kCols + c] = static_cast<int16_t>(prefix[(i * side + j + 1) * kCols + c] + row_sum);
    }
  }
}

// A field's out-of-frame sum (of C - 2 popc_tap) for DenseBorderRowBounds where it has no prefix sums: from
// the edge table; a corner field whose block the table lacks (AlexNet's conv1: 49 corner blocks) takes its
// row and column strips less the block, summed from at most (top + bottom) x (left + right) taps' popcounts
// (16 there, not ExcludedTapsOf's loop over all 121); without the edge table (a filter larger than the
// frame), ExcludedTapsOf.
template <int kCols>
__device__ __forceinline__ int DenseExcludedTaps(const BinaryGemmProblem& p, const TileColumns<kCols>& cols,
                                                 FrameExcess e, int lc, int col) {
  if (col >= p.n) return 0;  // the column's bound is unreachable
  const EdgeRowsOfField edge = EdgeRowsOf(p, e);
  if (edge.usable) return EdgeCorrection(cols, edge, lc);
  if (!p.edge_table) return ExcludedTapsOf(p, cols, e, lc, col);
  const int strips = EdgeCorrection(cols, EdgeRowsOf(p, {e.top, e.bottom, 0, 0}), lc) +
                     EdgeCorrection(cols, EdgeRowsOf(p, {0, 0, e.left, e.right}), lc);
  const int i0 = e.top > 0 ? 0 : p.kh - e.bottom, i1 = e.top > 0 ? e.top : p.kh;
  const int j0 = e.left > 0 ? 0 : p.kw - e.right, j1 = e.left > 0 ? e.left : p.kw;
  int block = 0;
  for (int i = i0; i < i1; ++i) {
    for (int j = j0; j < j1; ++j) block += p.c - 2 * p.tap_popc[(i * p.kw + j) * p.n + col];
  }
  return strips - block;
}

// The dense-tap kernel's border rows (no class table: 7x7 at stride 2 has 144 excess classes, the table takes
// 25): every border row's bounds in StoreDirectBits' scratch rows, in BorderRowBounds' form, the work spread
// over the CTA's threads a (row, column pair) each. Up to 7x7 from the prefix sums, four reads per row and
// column (BorderRowBounds loaded every excluded tap's popcount for every column of a border row: at
// ResNet-18's conv1, batch 256, that took 2.5 of the dense kernel's 3.4 ms, session 36); larger filters
// from the edge table (DenseExcludedTaps; kEdgeBorders).
template <class Engine, bool kEdgeBorders>
__device__ __forceinline__ void DenseBorderRowBounds(const BinaryGemmProblem& p, const TileColumns<Engine::kCols>& cols,
                                                     const int16_t* prefix, const int4* origins,
                                                     const int8_t* row_class, int* scratch, int col0, int tid) {
  constexpr int kRows = Engine::kRows, kCols = Engine::kCols, kThreads = Engine::kThreads;
  const int side = p.kw + 1;
  auto corner = [&](int i, int j, int lc) -> int { return prefix[(i * side + j) * kCols + lc]; };
  for (int item = tid; item < kRows * (kCols / 2); item += kThreads) {
    const int r = item / (kCols / 2), lc = 2 * (item % (kCols / 2));
    if (row_class[r] == 0) continue;
    const int4 o = origins[r];
    const FrameExcess e = ExcessOf(p, o.y, o.z);
    const int i0 = e.top, i1 = p.kh - e.bottom, j0 = e.left, j1 = p.kw - e.right;
    int bound[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      int excluded;
      if constexpr (kEdgeBorders) {
        excluded = DenseExcludedTaps(p, cols, e, lc + k, col0 + lc + k);
      } else {
        const int inside = corner(i1, j1, lc + k) - corner(i0, j1, lc + k) - corner(i1, j0, lc + k) + corner(i0, j0, lc + k);
        excluded = corner(p.kh, p.kw, lc + k) - inside;
      }
      const int plain = cols.bound[lc + k];  // columns past N keep their unreachable bound
      bound[k] = plain == kUnreachableBound ? plain : plain + excluded;
    }
    StoreRowBounds(p, scratch + r * kCols, lc, bound[0], bound[1]);
  }
}

// CTAs an SM that the dense-tap kernel's registers are sized for (PlanDenseTaps also asks the shared memory).
inline constexpr int kDenseTapCtasPerSm = 3;

// The dense-tap kernel: persistent CTAs of 4 warps (128 x 64 tiles in MmaSyncDenseTaps' engine), three an SM,
// so that one CTA's gather runs under the others' mma and epilogues. CTA b keeps column tile b /
// ctas_per_column: its parameters, gathered weights (thread c: column c) and border prefix sums are set up
// once, then it takes row tiles b % ctas_per_column, + ctas_per_column, ...: thread r gathers row r into the
// K block and counts its bits, one mma.sync pass of DenseTapSteps steps, the engine's epilogues. One tile a
// CTA re-gathered the weights in every tile (0.27 of 0.95 ms at ResNet-18's conv1 with "one" padding) and
// rebuilt the prefix sums (session 36). kEdgeBorders: the instance for the problems whose border rows come from
// the edge table (DenseBorderBounds but not DensePrefixSums); the other one has none of that code, which in one
// instance for both cost ResNet-18's conv1 1.5% (session 39).
template <class Engine, bool kEdgeBorders>
__global__ void __launch_bounds__(Engine::kThreads, kDenseTapCtasPerSm)
    DenseTapKernel(const BinaryGemmProblem p, int m_tiles, int ctas_per_column) {
  constexpr int kRows = Engine::kRows, kCols = Engine::kCols, kThreads = Engine::kThreads;
  using Smem = DenseTapSmem<Engine>;
  static_assert(kRows == kThreads && kCols <= kThreads, "a thread per row and per column");
  extern __shared__ __align__(1024) uint8_t smem[];
  int4* origins = reinterpret_cast<int4*>(smem + Engine::kStages * Smem::kStage);
  int* popc_a = reinterpret_cast<int*>(origins + kRows);
  auto& cols = *reinterpret_cast<TileColumns<kCols>*>(popc_a + kRows);
  int8_t* row_class = reinterpret_cast<int8_t*>(&cols + 1);
  int16_t* prefix = reinterpret_cast<int16_t*>(smem + Smem::kPrefix);
  uint8_t* stage = smem + Smem::kStage;
  int* scratch = reinterpret_cast<int*>(smem);
  const int tid = threadIdx.x;
  const int col0 = (blockIdx.x / ctas_per_column) * kCols;
  const int steps = DenseTapSteps(p);
  const bool direct_bits = p.pool_h * p.pool_w == 1 && p.epilogue == Epilogue::kBits;
  const bool prefix_sums = !kEdgeBorders && DensePrefixSums<Engine>(p), border_bounds = kEdgeBorders || prefix_sums;

  SetUpTileColumns<kCols, kThreads>(p, cols, col0, tid, direct_bits, p.edge_table && !prefix_sums);
  if (tid < kCols) {
    const int c = tid, n = col0 + tid;
    // FSB tiles: K word t (= tap t, one word per tap) of column n; columns past N stay zero
    const uint32_t* w = p.w + static_cast<size_t>(n / 8) * p.w_k_tiles * 32 + (n % 8) * 4;
    PackDenseTaps(
        p, 8 * steps,
        [&](int fkh) {
          return [&, fkh](int fkw) -> uint32_t {
            const int t = fkh * p.kw + fkw;
            return n < p.n ? __ldg(w + (t / 4) * 32 + t % 4) : 0u;
          };
        },
        [&](int j, uint32_t word) {
          *reinterpret_cast<uint32_t*>(smem + Smem::kWeights + StageOffset(c, j / 4) + (j % 4) * 4) = word;
        });
    if (prefix_sums) BuildDenseBorderPrefix<kCols>(p, prefix, col0, c);
  }

  for (int tile_m = blockIdx.x % ctas_per_column; tile_m < m_tiles; tile_m += ctas_per_column) {
    // row r: its origin, class and K block (every word the k loop reads, zeros past the taps), and its bits.
    // The gather is most of the kernel's instructions (84% at ResNet-18's conv1, ncu): a filter row's address
    // and frame test are set up once, a tap's frame test is one compare (the columns in frame are a range),
    // and a word's place in A's swizzled rows, ChunkOffset(r, j / 4) + (j % 4) * 4, is one XOR.
    static_assert(Engine::kALayout == ALayout::kSwizzledRows, "A's rows are 128-byte swizzled lines");
    const int r = tid;
    const int4 o = RowOrigin(p, tile_m, kRows, r);
    origins[r] = o;
    if (direct_bits) row_class[r] = EpilogueRowClass(p, o);
    const int first_in = max(0, -o.z);
    const unsigned in_count = max(0, min(p.kw, p.in_w - o.z) - first_in);
    uint8_t* row_words = stage + r * 128;
    const int swizzle = (r % 8) * 16;
    popc_a[r] = PackDenseTaps(
        p, 8 * steps,
        [&](int fkh) {
          const unsigned row_count = o.w && static_cast<unsigned>(o.y + fkh) < static_cast<unsigned>(p.in_h) ? in_count : 0;
          // tap (fkh, 0) (outside the frame at its left border), opaque to the compiler: it otherwise rebuilt the
          // 64-bit address of every tap from the ints (four instructions and a reload of p.x)
          const uint32_t* taps;
          asm("mov.b64 %0, %1;\n" : "=l"(taps) : "l"(p.x + (o.x + fkh * p.in_w)));
          return [=](int fkw) -> uint32_t {
            return static_cast<unsigned>(fkw - first_in) < row_count ? __ldg(taps + fkw) : 0u;
          };
        },
        [&](int j, uint32_t word) { *reinterpret_cast<uint32_t*>(row_words + ((4 * j) ^ swizzle)) = word; });
    __syncthreads();
    typename Engine::Accumulators acc = {};
    Engine::Compute(acc, stage, SmemAddress(stage), tid, [](int) {}, steps);
    if (p.pool_h * p.pool_w == 1) {
      // every thread passes the barrier; the tile's border rows decide whether their bounds are filled
      if (__syncthreads_or(border_bounds && row_class[tid] != 0)) {
        DenseBorderRowBounds<Engine, kEdgeBorders>(p, cols, prefix, origins, row_class, scratch, col0, tid);
        __syncthreads();
        Engine::template StoreDirect<true>(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
      } else {
        Engine::StoreDirect(acc, p, popc_a, origins, row_class, scratch, cols, tile_m, col0, tid);
      }
    } else {
      __syncthreads();
      Engine::Store(acc, scratch, kCols + 4, tid);
      __syncthreads();
      StoreTile<kRows, kCols, kCols + 4, kThreads>(p, scratch, popc_a, cols, origins, tile_m, col0, tid);
    }
    __syncthreads();  // the next tile's rows overwrite origins, popc_a and A, which the epilogue read
  }
}

// ---------------------------------------------------------------------------------------------------
// wgmma engine (sm_90a): warp-specialized, mbarrier pipeline, clusters of two CTAs along M.
//
// The two CTAs of a cluster take row tiles 2i and 2i + 1 of one column tile, so they need the same weight
// stages: each copies half of a stage's weight rows and multicasts it into both CTAs' shared memory,
// which halves the L2 -> SM weight traffic. A stage is refilled only after the consumers of both CTAs
// released it (the "empty" barriers count the consumer warps of the whole cluster).
// Activations: one TMA tensor copy per stage (128B swizzle) when the rows of A are rows of a matrix
// (bmm, 1x1 stride-1 convolutions), else cp.async by the producer warpgroup with the implicit-GEMM
// addressing (zero fill of out-of-frame taps).

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

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The thread's index, read by a volatile instruction that the compiler cannot hoist out of a loop: what
// is derived from it is then recomputed in the loop instead of being kept live (or spilled) across it.
__device__ __forceinline__ int FreshThreadIndex() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}

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
  // (trace, benchmarks/NOTES.md session 25).
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

// The tile pairs of one cluster of the persistent wgmma kernel, in order: pairs first, first + step, ...
// below end. `runs`: a contiguous run of pairs in column-tile-major order (problems whose operands sit in
// L2 together), so that a CTA keeps its column tile, and the column table staged for it, over most of its
// tiles; otherwise every ClusterCount-th pair of the grouped raster, so that the clusters working at one
// time share row and column tiles in L2.
struct PairRange {
  int first, end, step;
};
__device__ __forceinline__ PairRange PairsOfCluster(int cluster, int clusters, int m_pairs, int n_tiles, bool runs) {
  const long long pairs = static_cast<long long>(m_pairs) * n_tiles;
  if (!runs) return {cluster, static_cast<int>(pairs), clusters};
  return {static_cast<int>(cluster * pairs / clusters), static_cast<int>((cluster + 1) * pairs / clusters), 1};
}
__device__ __forceinline__ void PairCoordinates(int pair, int m_pairs, int n_tiles, bool runs, int& pair_m,
                                                int& tile_n) {
  if (runs) {
    tile_n = pair / m_pairs;
    pair_m = pair - tile_n * m_pairs;
  } else {
    TileCoordinates(pair, m_pairs, n_tiles, pair_m, tile_n);
  }
}

// Arrives on the barrier at the same shared-memory offset in every CTA of the cluster. Default (.cta)
// release semantics, as CUTLASS's cluster barriers: .release.cluster costs a GPU-wide memory barrier.
__device__ __forceinline__ void BarrierArriveCluster(uint32_t bar) {
#pragma unroll
  for (uint32_t rank = 0; rank < kWgCluster; ++rank) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
  }
}
__device__ __forceinline__ void BarrierArriveExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One bulk copy of `bytes` contiguous bytes into the same offset of every CTA of the cluster; completes
// its bytes on the barrier at `bar`'s offset in each of them.
__device__ __forceinline__ void BulkCopyMulticast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  const uint16_t every_cta = (1u << kWgCluster) - 1;
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(every_cta)
      : "memory");
}
// One TMA copy of the weight box (128 bytes = one FSB tile, 8 FSB tiles of K, kWgCols / 8 / kWgCluster row
// tiles) at (FSB tile k, row tile j) of `map`, into the same offset of every CTA of the cluster; tiles past
// K or N arrive as zeros and still count towards the box's bytes.
__device__ __forceinline__ void WeightCopyMulticast(uint32_t dst, const CUtensorMap& map, int k, int j, uint32_t bar) {
  const uint16_t every_cta = (1u << kWgCluster) - 1;
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(0), "r"(k), "r"(j), "r"(bar), "h"(every_cta)
      : "memory");
}
// One TMA copy of the (128 bytes x 128 rows) box at (byte x, row y) of `map`; rows and bytes outside the
// matrix arrive as zeros and still count towards the box's bytes.
__device__ __forceinline__ void TensorCopy(uint32_t dst, const CUtensorMap& map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// One TMA copy of the (16 bytes, w, h, 1) box at (byte, x, y, image) of a 4-D `map` (NHWC bytes).
__device__ __forceinline__ void TensorCopy4d(uint32_t dst, const CUtensorMap& map, int byte, int x, int y, int image,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(byte), "r"(x), "r"(y), "r"(image), "r"(bar)
      : "memory");
}
// One TMA copy of the (w, h, 1) box at (x, y, image) of a 3-D `map`.
__device__ __forceinline__ void TensorCopy3d(uint32_t dst, const CUtensorMap& map, int x, int y, int image,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(image), "r"(bar)
      : "memory");
}
// Fetches a TMA descriptor (a __grid_constant__ parameter) into the TMA unit's cache ahead of its first
// copy. It depends on no buffer of the problem, so kernels issue it before `griddepcontrol.wait`, under the
// previous kernel's tail.
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t ClusterId() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t ClusterCount() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
// No-swizzle K-major descriptor: `along_k` bytes between core matrices along K (LBO), `between_groups`
// bytes between 8-row groups (SBO); the defaults are the kCoreMatrices layout.
__device__ __forceinline__ uint64_t OperandDescriptor(uint32_t addr, uint32_t along_k = 128,
                                                      uint32_t between_groups = 1024) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(along_k >> 4) << 16) |
         (static_cast<uint64_t>(between_groups >> 4) << 32);
}
// Swizzled K-major descriptor: rows of `row_bytes` (128, 64 or 32) with that swizzle (mode 1, 2 or 3 in
// bits 62-63), SBO = 8 rows between 8-row groups (LBO unused); a k256 step advances the start address by 32
// bytes within a row.
__device__ __forceinline__ uint64_t SwizzledOperandDescriptor(uint32_t addr, uint32_t row_bytes = 128) {
  const uint64_t mode = row_bytes == 128 ? 1 : row_bytes == 64 ? 2 : 3;
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(8 * row_bytes >> 4) << 32) |
         (mode << 62);
}

// The four lanes of this thread's quad. The quads of a warp hold different rows and may take different
// epilogue paths (border rows or not) with different numbers of shuffles, so the shuffles that assemble a
// quad's words name only the quad: a full-warp mask would pair shuffles of different paths, or wait forever.
__device__ __forceinline__ unsigned QuadLanes() { return 0xfu << (threadIdx.x % 32 & ~3u); }

// Threshold bits of a thread's two accumulator rows (h = 0, 1). Bits of columns 8 j + 2 t + e land at
// bit 8 (j % 4) + e of word j / 4; the quad's lanes (t) fill the other positions after a shift by 2 t, then
// an OR over the quad completes each 32-column word. bounds[h]: the bounds row h compares with: cols.bound,
// or the row of its border class in the class-bound table (kClassBounds: then the two rows' bounds are
// loaded separately); kPaired: their PairedBounds (in the even slots of a table row, TileColumns). kWords:
// output words per row (8: a 256-column tile; 4: a narrow tile of at most 128 columns, whose accumulators
// are the first 64; 2: at most 64 columns, the first 32). kAcc: the accumulators a thread holds (128 for
// m64n256, 64 for m64n128).
template <bool kClassBounds, bool kPaired, int kWords, int kAcc>
__device__ __forceinline__ void StoreBitsRows(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                              const TileColumns<kWgCols>& cols, const int (&v0)[2],
                                              const long long (&row)[2], const bool (&row_valid)[2],
                                              const int* const (&bounds)[2], int col0, int t) {
  static_assert(16 * kWords <= kAcc, "a word of 32 columns takes 16 accumulators of each thread");
  uint32_t words[2][kWords];
  // the values of fragments 4 wd .. 4 wd + 3 of row h, and that row's bounds from the word's first column
  auto word_bits = [&](int h, int wd) {
    int a[4][2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      a[q][0] = acc[4 * (4 * wd + q) + 2 * h];
      a[q][1] = acc[4 * (4 * wd + q) + 2 * h + 1];
    }
    const int* row_bounds = &bounds[kClassBounds ? h : 0][32 * wd + 2 * t];
    return kPaired ? ThresholdBitsPaired(a, v0[h], row_bounds) : ThresholdBitsUnpaired(a, v0[h], row_bounds);
  };
  // word by word, both rows (the paired form went row by row: BandWgmmaKernel<0> spilled 8 bytes that way)
#pragma unroll
  for (int wd = 0; wd < kWords; ++wd) {
#pragma unroll
    for (int h = 0; h < 2; ++h) words[h][wd] = word_bits(h, wd);
  }
  uint32_t* out = static_cast<uint32_t*>(p.out);
  if constexpr (kWords == 2) {
    // two words a row: lanes 0, 1 gather word 0 and lanes 2, 3 word 1, then lanes 0 and 2 store them
    const int out_words = (p.n + 31) / 32, wd = t / 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t lo = words[h][0] << (2 * t), hi = words[h][1] << (2 * t);
      uint32_t word = ((t & 2) ? hi : lo) | __shfl_xor_sync(QuadLanes(), (t & 2) ? lo : hi, 2);
      word |= __shfl_xor_sync(QuadLanes(), word, 1);
      if (row_valid[h] && t % 2 == 0 && col0 + 32 * wd < p.n) {
        out[row[h] * out_words + col0 / 32 + wd] = word ^ cols.flip_word[wd];
      }
    }
  } else {
    // The OR over the quad as a reduce-scatter: after two exchanges lane t holds the finished words
    // kPerLane t .. kPerLane t + kPerLane - 1 of each row (3 shuffles per row and 8 words, not 16), which
    // it stores together (one 8-byte store where the rows are 8-byte aligned; stores were 3-8% of the
    // resident kernel's time: benchmarks/NOTES.md, session 12).
    constexpr int kPerLane = kWords / 4;
    const int out_words = (p.n + 31) / 32, first = kPerLane * t;
    const bool pairs = kPerLane == 2 && out_words % 2 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t half[kWords / 2], mine[kPerLane];
#pragma unroll
      for (int i = 0; i < kWords / 2; ++i) {  // lanes 0, 1 keep the first half, lanes 2, 3 the second
        const uint32_t lo = words[h][i] << (2 * t), hi = words[h][kWords / 2 + i] << (2 * t);
        half[i] = ((t & 2) ? hi : lo) | __shfl_xor_sync(QuadLanes(), (t & 2) ? lo : hi, 2);
      }
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {  // then lanes 0, 2 the first quarter, lanes 1, 3 the second
        const uint32_t lo = half[i], hi = half[kPerLane + i];
        mine[i] = ((t & 1) ? hi : lo) | __shfl_xor_sync(QuadLanes(), (t & 1) ? lo : hi, 1);
        mine[i] ^= cols.flip_word[first + i];
      }
      if (!row_valid[h]) continue;
      uint32_t* dst = out + row[h] * out_words + col0 / 32 + first;
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

// RowOrigin of output pixel `pixel` of an unpooled problem.
__device__ __forceinline__ int4 PixelOrigin(const BinaryGemmProblem& p, long long pixel) {
  return RowOrigin(p, static_cast<int>(pixel), 1, 0);
}

// The same for one row (h) whose receptive field may leave the frame, for problems without the
// border-class table: corrections summed per value.
template <int kAcc>
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
  uint32_t words[kWords] = {};
#pragma unroll
  for (int j = 0; j < 4 * kWords; ++j) {
    const int2 bound = *reinterpret_cast<const int2*>(&cols.bound[8 * j + 2 * t]);
    const int x0 = 4 * acc[4 * j + 2 * h] + v0 - excl[2 * j], x1 = 4 * acc[4 * j + 2 * h + 1] + v0 - excl[2 * j + 1];
    words[j / 4] |= static_cast<uint32_t>(x0 >= bound.x) << (8 * (j % 4)) |
                    static_cast<uint32_t>(x1 >= bound.y) << (8 * (j % 4) + 1);
  }
  uint32_t* out = static_cast<uint32_t*>(p.out);
  const int out_words = (p.n + 31) / 32;
#pragma unroll
  for (int wd = 0; wd < kWords; ++wd) {
    uint32_t v = words[wd] << (2 * t);
    v |= __shfl_xor_sync(QuadLanes(), v, 1);
    v |= __shfl_xor_sync(QuadLanes(), v, 2);
    if (t == (wd & 3) && row_valid && col0 + 32 * wd < p.n) out[row * out_words + col0 / 32 + wd] = v ^ cols.flip_word[wd];
  }
}

// StoreBitsRows in the form of the problem: paired bounds or not (PairsBounds), the tile's 256 columns or
// (narrow, or m64n128 accumulators) its first 128, or (kQuarter) its first 64.
template <bool kClassBounds, bool kQuarter, int kAcc>
__device__ __forceinline__ void StoreBitsRowsOfProblem(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                                       const TileColumns<kWgCols>& cols, const int (&v0)[2],
                                                       const long long (&row)[2], const bool (&row_valid)[2],
                                                       const int* const (&bounds)[2], int col0, int t, bool paired,
                                                       bool narrow) {
  if constexpr (kQuarter) {
    if (paired) {
      StoreBitsRows<kClassBounds, true, 2>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    } else {
      StoreBitsRows<kClassBounds, false, 2>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    }
  } else if (kAcc == 64 || narrow) {
    if (paired) {
      StoreBitsRows<kClassBounds, true, 4>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    } else {
      StoreBitsRows<kClassBounds, false, 4>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
    }
  } else if (paired) {
    StoreBitsRows<kClassBounds, true, kAcc / 16>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
  } else {
    StoreBitsRows<kClassBounds, false, kAcc / 16>(p, acc, cols, v0, row, row_valid, bounds, col0, t);
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

// The epilogue straight from the wgmma accumulators (no pool) of thread (warp w, lane g*4+t) of a consumer
// warpgroup, which holds rows 16 w + g (+8) of the warpgroup's 64 and columns 8 j + 2 t (+1).
// narrow: the tile has at most 128 columns, so only the first 64 accumulators hold real columns (an m64n256
// wgmma still computes all 256). kAcc: 128 (m64n256 accumulators) or 64 (m64n128: always narrow).
// kQuarter: at most 64 columns (the threshold bits of the first 32 accumulators only).
template <int kAcc, bool kQuarter = false>
__device__ __forceinline__ void StoreAccumulatorRows(const BinaryGemmProblem& p, const int (&acc)[kAcc],
                                                     const AccumulatorRows& rows, const TileColumns<kWgCols>& cols,
                                                     int col0, int t, bool narrow) {
  const int(&v0)[2] = rows.v0;
  const int(&correction)[2] = rows.correction;
  const long long(&row)[2] = rows.row;
  const bool(&row_valid)[2] = rows.valid;
  bool border[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) border[h] = row_valid[h] && correction[h] != 0;
  if (p.epilogue == Epilogue::kBits) {
    // One code path per problem where possible: the epilogue is fetch-bound (ncu: "no instruction" was
    // the first stall reason), and warps of one CTA in two variants fetch twice the code.
    // (a problem takes one of the paired and unpaired forms in all its tiles)
    const bool paired = PairsBounds(p);
    if (p.correction_table) {
      // every row compares with its border class's bounds; class 0 (inside the frame) holds the plain ones
      const int* const bounds[2] = {cols.correction[border[0] ? correction[0] : 0],
                                    cols.correction[border[1] ? correction[1] : 0]};
      StoreBitsRowsOfProblem<true, kQuarter>(p, acc, cols, v0, row, row_valid, bounds, col0, t, paired, narrow);
    } else if (!__any_sync(0xffffffffu, border[0] || border[1])) {
      // one path per warp: a warp whose quads took both paths would run both
      const int* const plain = paired ? cols.correction[0] : cols.bound;
      const int* const bounds[2] = {plain, plain};
      StoreBitsRowsOfProblem<false, kQuarter>(p, acc, cols, v0, row, row_valid, bounds, col0, t, paired, narrow);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        StoreBitsBorderRow(p, acc, cols, v0[h], row[h], row_valid[h], border[h], h, col0, t);
      }
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!row_valid[h]) continue;
    int excl[kAcc / 2];
    if (border[h]) BorderCorrections(p, cols, PixelOrigin(p, row[h]), col0, 2 * t, excl);
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
      const int lc = 8 * j + 2 * t, col = col0 + lc;
      if (col >= p.n) continue;
      int d0 = v0[h] - 2 * cols.popc_b[lc] + 4 * acc[4 * j + 2 * h];
      int d1 = v0[h] - 2 * cols.popc_b[lc + 1] + 4 * acc[4 * j + 2 * h + 1];
      if (border[h]) {
        d0 -= excl[2 * j];
        d1 -= excl[2 * j + 1];
      }
      StorePair(p, row[h], col, d0, d1, cols.scale[lc], cols.bias[lc], cols.scale[lc + 1], cols.bias[lc + 1]);
    }
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
#endif

#ifdef JAXBNN_TILE_TRACE
__device__ unsigned long long* g_tile_trace = nullptr;  // SetTileTrace

// SM cycles (clock64): fine enough to place sub-microsecond steps within a CTA (%globaltimer ticks
// coarsely), but not comparable between SMs.
__device__ __forceinline__ void TraceWord(int word) {
  const unsigned long long now = clock64();
  g_tile_trace[static_cast<size_t>(blockIdx.x) * kTraceWordsPerCta + word] = now;
}
// Start-up stamp `word` (< kTraceStartWords), by the one thread for which `stamping` holds. The other
// threads do not read the trace pointer: a load per thread and stamp site slowed what was traced.
__device__ __forceinline__ void TraceStart(int word, bool stamping) {
  if (stamping && g_tile_trace != nullptr) TraceWord(word);
}
// Stamp `event` of this warpgroup's tile `tile` (thread 0 of the warpgroup; tiles past the slots are not
// recorded).
__device__ __forceinline__ void TraceTile(int half, int tile, int event, int wtid) {
  if (wtid != 0 || tile >= kTraceTiles || g_tile_trace == nullptr) return;
  TraceWord(kTraceStartWords + (half * kTraceTiles + tile) * kTraceEvents + event);
}
#define JAXBNN_TRACE_START(word, stamping) TraceStart(word, stamping)
#define JAXBNN_TRACE_TILE(half, tile, event, wtid) TraceTile(half, tile, event, wtid)
#else
#define JAXBNN_TRACE_START(word, stamping) static_cast<void>(0)
#define JAXBNN_TRACE_TILE(half, tile, event, wtid) static_cast<void>(0)
#endif

// Persistent over tile pairs (one pair per cluster and step) unless the epilogue pools, which stages the
// tile in the pipeline's shared memory and so runs one pair per cluster. The producer runs ahead into the
// next tile while the consumers finish the previous one's epilogue. kLayout: how the activations arrive
// (kCoreMatrices: cp.async by the producer warpgroup; else TMA boxes issued by one producer warp).
// kSteps: the k256 steps of a K block, 4, or fewer for unpooled cp.async problems of one short K block
// (K <= 256 or <= 768 bits: ResNet's 1x1 stride-2 shortcuts, 3x3 stride-2 convolutions of C = 64), whose
// stages hold zeros past K from the start, so that the producer copies only the words of K (a full K block
// was 16 copies of 8 bytes per row, most of them zero fill) and the consumers issue only the steps of K.
// Launched with a cluster dimension of kWgCluster (LaunchWgmma).
template <ALayout kLayout, int kSteps = 4>
__global__ void __launch_bounds__(kWgThreads, 1)
    WgmmaKernel(const BinaryGemmProblem p, const __grid_constant__ CUtensorMap a_map,
                const __grid_constant__ CUtensorMap w_map, bool weights_by_tma, const LaunchDivisors div,
                int m_pairs, int n_tiles, bool runs) {
  [[maybe_unused]] constexpr bool kTensorA = kLayout != ALayout::kCoreMatrices;  // unused in the sm_80 pass
  // How the activations lie in a stage: as the TMA boxes put them, and where the producer copies them
  // (kCoreMatrices), in 128-byte swizzled rows too, so that a quarter-warp copies one row's 128 contiguous
  // bytes where a tap has >= 32 bytes (LoadActivationStage; the core-matrix order requested every 32-byte
  // sector twice there, as in the mma.sync engine before session 31).
  [[maybe_unused]] constexpr ALayout kStageLayout = kTensorA ? kLayout : ALayout::kSwizzledRows;
  // the lanes of a consumer warp that arrive on a stage's "empty" barrier (release, below)
  [[maybe_unused]] constexpr int kReleasingLanes = kTensorA ? 1 : 32;
  static_assert(kSteps == 4 || (kSteps > 0 && kSteps < 4 && !kTensorA), "short K blocks: cp.async instances");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  int4* origins = reinterpret_cast<int4*>(smem + kWgStages * kWgStageBytes);
  int* popc_a = reinterpret_cast<int*>(origins + kWgRows);
  auto& cols = *reinterpret_cast<TileColumns<kWgCols>*>(popc_a + kWgRows);
  auto* barriers = reinterpret_cast<uint64_t*>(&cols + 1);
  const uint32_t full0 = SmemAddress(barriers);   // kWgStages "stage landed" barriers
  const uint32_t empty0 = full0 + kWgStages * 8;  // kWgStages "stage consumed by the cluster" barriers
  int8_t* row_correction = reinterpret_cast<int8_t*>(barriers + 2 * kWgStages);  // RowCorrection per tile row
  const int tid = threadIdx.x;
  JAXBNN_TRACE_START(0, tid == 0);
  const PairRange schedule =
      PairsOfCluster(static_cast<int>(ClusterId()), static_cast<int>(ClusterCount()), m_pairs, n_tiles, runs);
  const int rank = static_cast<int>(ClusterRank());
  const bool staged = p.pool_h * p.pool_w > 1;
  // Bytes of K per row of one activation slab (one TMA box): 16 in the chunk slabs, W in the tap rows;
  // 128 (a whole stage row) in the other layouts.
  const int a_box_bytes = kLayout == ALayout::kChunkSlabs ? 16 : kLayout == ALayout::kTapRows ? TapRowBytes(p.cw) : 128;
  const int a_box_log2 = __ffs(a_box_bytes) - 1;  // a power of two: shifts, not divisions
  const int a_boxes = 128 >> a_box_log2;           // per stage
  // kTapRows: where k256 step ks (32 bytes of K) starts: in slab ks * 32 / W, ks * 32 % W bytes into a row.
  uint32_t tap_row_step[4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    tap_row_step[ks] = ((ks * 32) >> a_box_log2) * kWgRows * a_box_bytes + ((ks * 32) & (a_box_bytes - 1));
  }
  if (tid == 0) {
    if (kTensorA) PrefetchTensorMap(a_map);
    if (weights_by_tma) PrefetchTensorMap(w_map);
    for (int s = 0; s < kWgStages; ++s) {
      // TMA: one arrival (with the stage's byte count). cp.async: one per producer thread when its copies
      // land, plus the one that brings the weights' byte count.
      BarrierInit(full0 + 8 * s, kTensorA ? 1 : 129);
      BarrierInit(empty0 + 8 * s, kWgCluster * kWgConsumerWarps * kReleasingLanes);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kSteps < 4) {  // the activation words past K, for good (the producer never copies them)
    for (int i = tid; i < kWgStages * kWgStageA / 16; i += kWgThreads) {
      *reinterpret_cast<uint4*>(smem + i / (kWgStageA / 16) * kWgStageBytes + i % (kWgStageA / 16) * 16) =
          make_uint4(0, 0, 0, 0);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // for the wgmmas
  }
  ClusterSync();  // the partner's barriers exist before any multicast copy or remote arrival reaches them
  JAXBNN_TRACE_START(1, tid == 0);
  // Launched as a programmatic dependent (PlanPersistent): everything above overlaps the previous kernel's
  // last tiles; every global read and write of the problem's buffers comes after this wait.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");

  const uint32_t base = SmemAddress(smem);
  const int k_blocks = (p.k_words + kKBlockWords - 1) / kKBlockWords;
  const int warpgroup = tid / 128;
  if (warpgroup == 0) {  // producer
    // 40 + 2 x 232 registers per thread fill the register file; at 224 the consumers spilled k_blocks
    // and reloaded it from local memory on every k block.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (kTensorA && tid >= 32) return;  // one warp issues the copies
    int it = 0;
    for (int pair = schedule.first; pair < schedule.end; pair += schedule.step) {
      int pair_m, tile_n;
      PairCoordinates(pair, m_pairs, n_tiles, runs, pair_m, tile_n);
      const int tile_m = pair_m * kWgCluster + rank;
      const int col0 = tile_n * kWgCols;
      // Weight rows of this column tile: FSB row tiles past N are not copied; what stays in their place
      // lands in columns that are never stored.
      const int row_tiles = min(kWgCols / 8, p.w_row_tiles - col0 / 8);
      if (!kTensorA) {
        asm volatile("bar.sync 2, 128;\n" ::: "memory");  // the previous tile's copies are all issued
        origins[tid] = RowOrigin(p, tile_m, kWgRows, tid);
        asm volatile("bar.sync 2, 128;\n" ::: "memory");
      }
      // The tap boxes' origin: the tile's first output pixel (whole output rows, or a 128-pixel run of one).
      const int first = tile_m * kWgRows;
      const int image = Quotient(first, div.image_pixels), in_image = first - image * div.image_pixels.divisor;
      const int oh0 = Quotient(in_image, div.out_w), ow0 = in_image - oh0 * p.out_w;
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % kWgStages;
        const uint32_t full = full0 + 8 * s;
        // Box `tid` of the K block (box layouts): a_box_bytes of one tap's channel bytes (16: one chunk),
        // placed before the wait so that only the copies follow the stage's release. Boxes past K start
        // past the channel bytes: they arrive as zeros.
        const int k_byte = kb * 128 + tid * a_box_bytes, tap_bytes = p.cw * 4;
        const int tap = Quotient(k_byte, div.tap_bytes);
        const int fkh = Quotient(tap, div.kw), fkw = tap - fkh * p.kw;
        const int channel_byte = k_byte < p.k_words * 4 ? k_byte - tap * tap_bytes : tap_bytes;
        if (it >= kWgStages) BarrierWait(empty0 + 8 * s, ((it / kWgStages) - 1) & 1);
        JAXBNN_TRACE_START(3, it == 0 && tid == 0);
        const uint32_t stage = base + s * kWgStageBytes;
        // FSB tiles past K are not copied either: what stays there meets zero-filled activation words.
        const int kt0 = kb * 8, k_tiles = min(8, p.w_k_tiles - kt0);
        // by TMA: whole boxes, zeros included; by bulk copies: the FSB tiles that exist
        const uint32_t weight_bytes = weights_by_tma ? kWgCols * 128 : row_tiles * k_tiles * 128;
        if constexpr (kTensorA) {
          if (tid == 0) BarrierArriveExpectBytes(full, kWgStageA + weight_bytes);
          if constexpr (kLayout == ALayout::kSwizzledRows) {
            if (tid == 0) TensorCopy(stage, a_map, kb * 128, tile_m * kWgRows, full);
          } else if (tid < a_boxes) {
            // the tile's block of output pixels shifted by the tap; pixels out of the frame or past the
            // batch arrive as zeros
            TensorCopy4d(stage + tid * kWgRows * a_box_bytes, a_map, channel_byte, ow0 + fkw - p.pad_left,
                         oh0 + fkh - p.pad_top, image, full);
          }
        } else {
          // 8-byte copies where a tap has an even but not a multiple-of-4 number of words (C = 64: 2)
          if (p.cw % 4 == 0) {
            LoadActivationStage<kWgRows, 4, 128, kStageLayout, (kSteps < 4)>(p, div, origins, stage, kb, tid);
          } else {
            LoadActivationStage<kWgRows, 2, 128, kStageLayout, (kSteps < 4)>(p, div, origins, stage, kb, tid);
          }
          if (tid == 0) BarrierArriveExpectBytes(full, weight_bytes);
        }
        // This CTA's half of the weight rows, 1 KB (8 FSB tiles) per 8-row tile row, into both CTAs: one TMA
        // box, or one bulk copy per row tile (each a serialized trip through the uniform datapath).
        constexpr int kRowTilesPerCta = kWgCols / 8 / kWgCluster;
        if (weights_by_tma) {
          if (tid == 0) {
            WeightCopyMulticast(stage + kWgStageA + rank * kRowTilesPerCta * kRowGroupBytes, w_map, kt0,
                                col0 / 8 + rank * kRowTilesPerCta, full);
          }
        } else if (const int j = rank * kRowTilesPerCta + tid; tid < kRowTilesPerCta && j < row_tiles) {
          BulkCopyMulticast(stage + kWgStageA + j * kRowGroupBytes,
                            p.w + (static_cast<size_t>(col0 / 8 + j) * p.w_k_tiles + kt0) * 32, k_tiles * 128, full);
        }
        if (!kTensorA) BarrierArriveOnCopies(full);
      }
    }
    // Every copy is issued: the next kernel in the stream may start its CTAs' prologue as SMs free up.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (!kTensorA) CopyAsyncWait<0>();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  JAXBNN_TRACE_START(2, tid == 128);
  const int ctid = tid - 128;      // 0..255 over both consumer warpgroups
  const int half = warpgroup - 1;  // rows 64 * half ... of the tile
  const int wtid = ctid % 128;     // thread in its warpgroup
  // Arrivals on the stage's "empty" barrier in every CTA of the cluster once all of a warp's reads (wgmma
  // and row popcounts) of it are done: one per warp, or with cp.async refills, one per thread (as in the
  // ClassicKernel: with one arrival per warp after __syncwarp, racecheck reported the other lanes' popcount
  // reads as racing with the producer's next copies into the stage; session 32).
  auto release = [&](uint32_t s) {
    if constexpr (kReleasingLanes == 1) {
      __syncwarp();
      if (wtid % 32 != 0) return;
    }
    BarrierArriveCluster(empty0 + 8 * s);
  };
  uint32_t it = 0;  // k blocks consumed so far: stage it % kWgStages, phase (it / kWgStages) % 2
  int staged_tile_n = -1;  // the column tile whose parameters `cols` holds
  // The column parameters' global loads take a while: they are issued after the second k block's wgmmas
  // (the first one's when there is one k block), when the tensor cores have two k blocks queued.
  const int fill_kb = min(1, k_blocks - 1);
  // the threshold epilogue's class-bound table (StoreAccumulators): unpooled threshold problems with a table
  const bool class_bounds = p.epilogue == Epilogue::kBits && !staged && p.correction_table;
#ifdef JAXBNN_TILE_TRACE
  int traced_tile = -1;
#endif
  for (int pair = schedule.first; pair < schedule.end; pair += schedule.step) {
    int pair_m, tile_n;
    PairCoordinates(pair, m_pairs, n_tiles, runs, pair_m, tile_n);
    const int tile_m = pair_m * kWgCluster + rank;
    const int col0 = tile_n * kWgCols;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the previous epilogue is done with cols and popc_a
#ifdef JAXBNN_TILE_TRACE
    ++traced_tile;
#endif
    JAXBNN_TRACE_TILE(half, traced_tile, 0, wtid);
    // The border-class corrections stay while the column tile does (runs of pairs change it rarely);
    // filled before the accumulators are live.
    const bool new_columns = tile_n != staged_tile_n;
    if (new_columns && p.correction_table) FillCorrectionTable<kWgCols>(p, cols, col0, ctid);
    if (new_columns && p.edge_table) FillEdgeTable<kWgCols>(p, cols, col0, ctid);
    staged_tile_n = tile_n;
    int acc[128];
    int row_popc = 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const uint32_t s = it % kWgStages;
      BarrierWait(full0 + 8 * s, (it / kWgStages) & 1);
      if (kb == 0) JAXBNN_TRACE_TILE(half, traced_tile, 1, wtid);
      // cp.async wrote the activations through the generic proxy; the tensor cores read through the async one.
      if (!kTensorA) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      // this warpgroup's 64 rows: the second half starts 64 rows in (64 x a_box_bytes in the slab layouts)
      const int half_offset = half * 64 * a_box_bytes;
      const uint32_t stage_a = base + s * kWgStageBytes + half_offset;
      const uint32_t stage_b = base + s * kWgStageBytes + kWgStageA;
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        uint64_t desc_a;
        if constexpr (kStageLayout == ALayout::kSwizzledRows) {
          desc_a = SwizzledOperandDescriptor(stage_a + ks * 32);
        } else if constexpr (kStageLayout == ALayout::kChunkSlabs) {
          desc_a = OperandDescriptor(stage_a + ks * 2 * kWgRows * 16, kWgRows * 16, 128);
        } else {
          static_assert(kStageLayout == ALayout::kTapRows, "a stage layout of the wgmma kernel");
          desc_a = SwizzledOperandDescriptor(stage_a + tap_row_step[ks], a_box_bytes);
        }
        wgmma_m64n256k256_and_popc(acc, desc_a, OperandDescriptor(stage_b + ks * 256), (kb | ks) != 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      if (kb == fill_kb && new_columns) {
        FillTileColumn<kWgCols>(p, cols, col0, ctid);
        if (class_bounds) AddBoundsToClasses(p, cols, ctid);
      }
      // each warpgroup its own 64 rows' corrections ("zero" padding; read by the unpooled epilogue only)
      if (kb == 0 && !p.pad_one && !staged && wtid < 64) {
        row_correction[64 * half + wtid] = RowCorrection(p, div, tile_m, 64 * half + wtid);
      }
      // While the tensor cores run: popc(a) of this warpgroup's 64 rows, two threads per row.
      row_popc += StageRowPopcount<64, 128, kStageLayout, kWgRows>(smem + s * kWgStageBytes + half_offset, wtid, a_box_log2);
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (kb > 0) release((it - 1) % kWgStages);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    JAXBNN_TRACE_TILE(half, traced_tile, 2, wtid);
    release((it - 1) % kWgStages);
    row_popc = CombineRowPopcount<64, 128>(row_popc);
    // Plain GEMMs (kSwizzledRows) read the thread index afresh: ptxas hoisted what the epilogue derives
    // from it out of the tile loop and spilled it (ncu, 16384^3 BMM: local-memory reloads at every tile
    // end; +6% with the re-read). The convolution layouts keep wtid: the re-read moved their register
    // allocation, and they ran 3-5% slower with it (benchmarks/NOTES.md, session 7).
    const int epilogue_wtid = kLayout == ALayout::kSwizzledRows ? FreshThreadIndex() % 128 : wtid;
    if (const int row = RowOfPopcount<64, 128>(epilogue_wtid); row >= 0) popc_a[64 * half + row] = row_popc;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // popc_a, row_correction, cols complete; all wgmmas done
    if (!staged) {
      // tiles of at most 128 columns (N <= 128, or the last column tile) store half the accumulators
      StoreAccumulators(p, acc, popc_a, row_correction, cols, tile_m, col0, half, epilogue_wtid,
                        p.n - col0 <= kWgCols / 2);
      JAXBNN_TRACE_TILE(half, traced_tile, 3, wtid);
      continue;
    }
    // Pooled: one tile per CTA; every copy into this CTA has landed (the consumers waited for all of
    // them), so the stages are free for the int32 tile.
    int* acc_tile = reinterpret_cast<int*>(smem);
    {
      const int w = wtid / 32, lane = wtid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
      for (int i = 0; i < 128; i += 2) {
        const int row = 64 * half + 16 * w + g + 8 * ((i >> 1) & 1);
        const int col = 8 * (i >> 2) + 2 * t;
        *reinterpret_cast<int2*>(acc_tile + row * kWgLd + col) = make_int2(acc[i], acc[i + 1]);
      }
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    // The staged epilogue needs every row's receptive-field origin (the producer's table is for its rows).
    if (ctid < kWgRows) origins[ctid] = RowOrigin(p, tile_m, kWgRows, ctid);
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    StoreTile<kWgRows, kWgCols, kWgLd, 256>(p, acc_tile, popc_a, cols, origins, tile_m, col0, ctid);
  }
  // The partner may still arrive on this CTA's barriers: neither CTA leaves before both are done.
  ClusterSync();
#endif
}

// ---------------------------------------------------------------------------------------------------
// Resident-weight wgmma kernel (sm_90a): for problems whose column tile's weights fit in shared memory
// whole (ResidentWeightBytes; a 3x3 convolution up to C = 512, a GEMM up to K = 4608 on H100, twice that K
// for N <= 128).
//
// The tensor cores idle while both consumer warpgroups of WgmmaKernel run their threshold epilogue at once
// (2.1 us per C = 512 tile against a 3.2 us k loop): they share every stage, so they run in step. Here a CTA
// keeps one column tile for its whole life and loads its weights once; each consumer warpgroup then takes
// its 64 rows of the CTA's row tiles through its own ring of 64-row activation stages, fed by its own
// producer warp, and never waits for the other, so one warpgroup's epilogue can run under the other's
// wgmmas. Unlike the ping-pong schedule tried before (v11), no weight byte is loaded twice.
// Measured (benchmarks/NOTES.md, sessions 11-12): +8-10% at C = 128 and 512 and for the 4096^3 BMM, but a
// warpgroup alone runs its k loop well below the tensor cores' rate (benchmarks/kloop_probe.cu), so most of
// the overlap is lost. kCols: the columns of a CTA's tile, 256, or 128 where N <= 128 (m64n128 wgmmas:
// half the tensor work of an m64n256 whose upper half would be discarded, and half the weight bytes) or where
// 256-column tiles would leave half the SMs idle (PlanResident). A 128-column tile still fills the column
// table's 256 columns from its first (one per consumer thread, as many at once): the upper half is unused.
constexpr int kResidentStageBytes = 64 * 128;  // 64 rows x one K block
// per warpgroup: deeper rings measured slower (C = 256: 3 stages +8% against main, 7 stages -3%; jobs BE, BF)
constexpr int kResidentStages = 3;
// Everything but the weights: alignment slack, the rings, the column table, popc_a, the barriers, the row
// corrections, and (16-byte aligned) the all-ones B of the popc(a) wgmmas.
constexpr int kResidentRingBytes = 2 * kResidentStages * kResidentStageBytes;
constexpr int kResidentFixedBytes = 1024 + kResidentRingBytes + static_cast<int>(sizeof(TileColumns<kWgCols>)) +
                                    kWgRows * 4 + (4 * kResidentStages + 1) * 8 + kWgRows + 16 + 256;
__host__ __device__ __forceinline__ int ResidentWeightBytes(int w_k_tiles, int cols) { return cols / 8 * w_k_tiles * 128; }
// The cp.async instance's receptive-field origins of a tile's rows (RowOrigin), after the all-ones B.
constexpr int kResidentOriginBytes = kWgRows * 16;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// One bulk copy of `bytes` contiguous bytes into this CTA's shared memory, completing on `bar`.
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// A position in a ring of kResidentStages stages: the stage and the parity of its current fill.
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance() {
    if (++stage == kResidentStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};
#endif

// grid: n_tiles x ctas_per_column CTAs; CTA b takes column tile b / ctas_per_column and row tiles
// b % ctas_per_column, + ctas_per_column, ... a_map: the activations in 64-row boxes (ActivationTensorMap).
template <ALayout kLayout, int kCols>
__global__ void __launch_bounds__(kWgThreads, 1)
    ResidentWgmmaKernel(const BinaryGemmProblem p, const __grid_constant__ CUtensorMap a_map,
                        const __grid_constant__ CUtensorMap w_map, const LaunchDivisors div, int m_tiles,
                        int ctas_per_column) {
  static_assert(kCols == kWgCols || kCols == kWgCols / 2, "m64n256 or m64n128 wgmmas");
  // kCoreMatrices: activations by cp.async (no TMA box takes the tiles), copied into 128-byte swizzled rows as
  // a TMA box of rows would put them; each half's ring is fed by two producer warps (LoadActivationStage's
  // copies keep a row's place modulo 8 only with 8 or more rows between a thread's copies).
  constexpr bool kCopies = kLayout == ALayout::kCoreMatrices;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  // rings (1024-aligned: the swizzled boxes), the weights, then the rest; the last K block's k256 steps
  // past K read weight bytes past the last row tile, which land in `cols` (their activations are zeros)
  const int weight_bytes = ResidentWeightBytes(p.w_k_tiles, kCols);
  auto& cols = *reinterpret_cast<TileColumns<kWgCols>*>(smem + kResidentRingBytes + weight_bytes);
  int* popc_a = reinterpret_cast<int*>(&cols + 1);
  auto* barriers = reinterpret_cast<uint64_t*>(popc_a + kWgRows);
  int8_t* row_correction = reinterpret_cast<int8_t*>(barriers + 4 * kResidentStages + 1);
  // B of the popc(a) wgmmas: 8 columns of all ones (2 core matrices of k256), 16-byte aligned
  uint32_t* ones = reinterpret_cast<uint32_t*>(smem + ((reinterpret_cast<uint8_t*>(row_correction) + kWgRows - smem + 15) & ~15));
  int4* origins = reinterpret_cast<int4*>(ones + 64);  // kCopies only (kResidentOriginBytes)
  const uint32_t base = SmemAddress(smem), weights = base + kResidentRingBytes;
  const uint32_t full0 = SmemAddress(barriers);                  // [half][stage]: the stage landed
  const uint32_t empty0 = full0 + 2 * kResidentStages * 8;    // [half][stage]: its 4 warps read it
  const uint32_t weights_full = empty0 + 2 * kResidentStages * 8;
  auto ring = [](int half, int s) { return (half * kResidentStages + s) * kResidentStageBytes; };
  auto bar = [](uint32_t bar0, int half, int s) { return bar0 + 8 * (half * kResidentStages + s); };
  const int tid = threadIdx.x;
  JAXBNN_TRACE_START(0, tid == 0);
  const int tile_n = blockIdx.x / ctas_per_column, first_tile = blockIdx.x % ctas_per_column;
  const int col0 = tile_n * kCols;
  const int k_blocks = (p.k_words + kKBlockWords - 1) / kKBlockWords;
  const int a_box_bytes = kLayout == ALayout::kChunkSlabs ? 16 : kLayout == ALayout::kTapRows ? TapRowBytes(p.cw) : 128;
  const int a_box_log2 = __ffs(a_box_bytes) - 1;
  if (tid == 0) {
    if (!kCopies) PrefetchTensorMap(a_map);  // (the cp.async instance has no activation map)
    PrefetchTensorMap(w_map);
    for (int half = 0; half < 2; ++half) {
      for (int s = 0; s < kResidentStages; ++s) {
        BarrierInit(bar(full0, half, s), kCopies ? 64 : 1);  // cp.async: every producer thread of the half
        BarrierInit(bar(empty0, half, s), 4);
      }
    }
    BarrierInit(weights_full, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (tid < 64) ones[tid] = 0xFFFFFFFFu;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // for the wgmmas
  __syncthreads();
  JAXBNN_TRACE_START(1, tid == 0);
  // a programmatic dependent launch, as WgmmaKernel: no global access before this
  asm volatile("griddepcontrol.wait;\n" ::: "memory");

  if (tid < 128) {  // producer warps: 0 and 1 feed the rings of consumer warpgroups 0 and 1, 2 the weights
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    const int warp = tid / 32, lane = tid % 32;
    if constexpr (kCopies) {  // warps 0-1 feed half 0's ring, 2-3 half 1's; thread 0 also brings the weights
      const int half = warp / 2, ptid = tid % 64;
      if (tid == 0) {
        BarrierArriveExpectBytes(weights_full, kCols / 8 * p.w_k_tiles * 128);
        TensorCopy3d(weights, w_map, 0, 0, col0 / 8, weights_full);
      }
      RingPosition at;
      bool first_round = true;
      for (int tile_m = first_tile; tile_m < m_tiles; tile_m += ctas_per_column) {
        // the half's copies of the previous tile are issued before its rows' origins are replaced
        asm volatile("bar.sync %0, 64;\n" ::"r"(5 + half) : "memory");
        origins[64 * half + ptid] = RowOrigin(p, tile_m, kWgRows, 64 * half + ptid);
        asm volatile("bar.sync %0, 64;\n" ::"r"(5 + half) : "memory");
        for (int kb = 0; kb < k_blocks; ++kb) {
          if (!first_round) BarrierWait(bar(empty0, half, at.stage), at.phase ^ 1);
          LoadActivationStage<64, 4, 64, ALayout::kSwizzledRows>(p, div, origins + 64 * half,
                                                                 base + ring(half, at.stage), kb, ptid);
          BarrierArriveOnCopies(bar(full0, half, at.stage));
          at.Advance();
          if (at.stage == 0) first_round = false;
        }
      }
      asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
      CopyAsyncWait<0>();
      return;
    }
    if (warp == 3) return;
    if (warp == 2) {
      // one TMA box of the column tile's kCols / 8 row tiles (zeros past N), as they lie in shared memory:
      // the first tile waits for the weights, and one box brings them sooner than a bulk copy per row tile (v54)
      if (lane == 0) {
        BarrierArriveExpectBytes(weights_full, kCols / 8 * p.w_k_tiles * 128);
        TensorCopy3d(weights, w_map, 0, 0, col0 / 8, weights_full);
      }
    } else {
      const int half = warp, a_boxes = 128 >> a_box_log2, tap_bytes = p.cw * 4;
      RingPosition at;
      bool first_round = true;  // the ring's stages have not been filled yet
      for (int tile_m = first_tile; tile_m < m_tiles; tile_m += ctas_per_column) {
        const int first = tile_m * kWgRows + 64 * half;  // the half's first output pixel
        const int image = Quotient(first, div.image_pixels), in_image = first - image * div.image_pixels.divisor;
        const int oh0 = Quotient(in_image, div.out_w), ow0 = in_image - oh0 * p.out_w;
        for (int kb = 0; kb < k_blocks; ++kb) {
          // box `lane`: a_box_bytes of one tap's channel bytes; boxes past K start past them (zeros)
          const int k_byte = kb * 128 + lane * a_box_bytes;
          const int tap = Quotient(k_byte, div.tap_bytes);
          const int fkh = Quotient(tap, div.kw), fkw = tap - fkh * p.kw;
          const int channel_byte = k_byte < p.k_words * 4 ? k_byte - tap * tap_bytes : tap_bytes;
          if (!first_round) BarrierWait(bar(empty0, half, at.stage), at.phase ^ 1);
          JAXBNN_TRACE_START(3, first_round && at.stage == 0 && tid == 0);
          const uint32_t stage = base + ring(half, at.stage), full = bar(full0, half, at.stage);
          if (lane == 0) BarrierArriveExpectBytes(full, kResidentStageBytes);
          if constexpr (kLayout == ALayout::kSwizzledRows) {
            if (lane == 0) TensorCopy(stage, a_map, kb * 128, first, full);
          } else if (lane < a_boxes) {
            TensorCopy4d(stage + lane * 64 * a_box_bytes, a_map, channel_byte, ow0 + fkw - p.pad_left,
                         oh0 + fkh - p.pad_top, image, full);
          }
          at.Advance();
          if (at.stage == 0) first_round = false;
        }
      }
    }
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  JAXBNN_TRACE_START(2, tid == 128);
  const int ctid = tid - 128, half = ctid / 128, wtid = ctid % 128;
  const uint32_t tile_bar = 2 + half;  // named barrier of this warpgroup alone
  uint32_t tap_row_step[4];            // kTapRows: where k256 step ks starts in a 64-row stage
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    tap_row_step[ks] = ((ks * 32) >> a_box_log2) * 64 * a_box_bytes + ((ks * 32) & (a_box_bytes - 1));
  }
  const bool class_bounds = p.epilogue == Epilogue::kBits && p.correction_table;
  // Each thread fills column ctid of the table and of the parameters. Warpgroup 1 fills its columns
  // before it waits (barrier 1); warpgroup 0 fills its own behind its second K block's wgmmas and lets
  // warpgroup 1 go then (barrier 4), so warpgroup 1 starts two K blocks late. Started a whole k loop late
  // (so that each one's epilogue would run under the other's wgmmas), warpgroup 1 idled ~3 us at every
  // CTA's start, and the stagger did not last (C = 512: the k loops overlapped 60%); one K block late:
  // C = 256 +4%, C = 512 +1% (v56, benchmarks/NOTES.md session 24); two: C = 512, BMM 4096^3 +1-2% more
  // (v62, session 25).
  if (p.correction_table) FillCorrectionTable<kWgCols>(p, cols, col0, ctid);
  if (p.edge_table) FillEdgeTable<kWgCols>(p, cols, col0, ctid);
  const int fill_kb = half == 0 ? min(1, k_blocks - 1) : -1;
  if (half == 1 && first_tile < m_tiles) {  // (a CTA without tiles: nothing to wait for)
    FillTileColumn<kWgCols>(p, cols, col0, ctid);
    if (class_bounds) AddBoundsToClasses(p, cols, ctid);
    asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    asm volatile("bar.sync 4, 256;\n" ::: "memory");
  }
  BarrierWait(weights_full, 0);
  RingPosition at;
  int traced_tile = 0;
  for (int tile_m = first_tile; tile_m < m_tiles; tile_m += ctas_per_column, ++traced_tile) {
    const bool first_tile_of_cta = tile_m == first_tile;
    // the previous epilogue is done with this warpgroup's popc_a and row corrections
    asm volatile("bar.sync %0, 128;\n" ::"r"(tile_bar) : "memory");
    JAXBNN_TRACE_TILE(half, traced_tile, 0, wtid);
    int acc[kCols / 2];
    // popc(a) of this thread's rows g and g + 8 (row_popc[0], [2]) from the tensor cores: an m64n8 wgmma per
    // k256 step against all-ones columns, as the band kernel (v35, v41). Counted from the stages by the
    // consumers (LDS and POPC between the wgmmas and the wait) they cost C = 512 8% (a timing-only build
    // without them); these wgmmas gain less (C = 512 unchanged, C = 256 +4%, one-padded C = 512 +3.5%);
    // producer warps counting the stages instead made C = 512 27% slower (benchmarks/NOTES.md, session 42).
    int row_popc[4];
    int previous_stage = 0;
    const uint64_t desc_ones = OperandDescriptor(SmemAddress(ones), 128, 256);
    for (int kb = 0; kb < k_blocks; ++kb) {
      BarrierWait(bar(full0, half, at.stage), at.phase);
      if (kb == 0) JAXBNN_TRACE_TILE(half, traced_tile, 1, wtid);
      // cp.async wrote the activations through the generic proxy; the tensor cores read through the async one.
      if constexpr (kCopies) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      const uint32_t stage_a = base + ring(half, at.stage);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint64_t desc_a;
        if constexpr (kLayout == ALayout::kSwizzledRows || kCopies) {
          desc_a = SwizzledOperandDescriptor(stage_a + ks * 32);
        } else if constexpr (kLayout == ALayout::kChunkSlabs) {
          desc_a = OperandDescriptor(stage_a + ks * 2 * 64 * 16, 64 * 16, 128);
        } else {
          desc_a = SwizzledOperandDescriptor(stage_a + tap_row_step[ks], a_box_bytes);
        }
        // the weights: FSB tiles as they lie in global memory, a row tile's K tiles contiguous
        const uint64_t desc_b = OperandDescriptor(weights + (kb * 8 + 2 * ks) * 128, 128, p.w_k_tiles * 128);
        if constexpr (kCols == kWgCols) {
          wgmma_m64n256k256_and_popc(acc, desc_a, desc_b, (kb | ks) != 0);
        } else {
          wgmma_m64n128k256_and_popc(acc, desc_a, desc_b, (kb | ks) != 0);
        }
        wgmma_m64n8k256_and_popc(row_popc, desc_a, desc_ones, (kb | ks) != 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      if (first_tile_of_cta && kb == fill_kb) {
        FillTileColumn<kWgCols>(p, cols, col0, ctid);
        if (class_bounds) AddBoundsToClasses(p, cols, ctid);
        asm volatile("bar.arrive 4, 256;\n" ::: "memory");
      }
      // At the last K block, not the first: between the first block's wgmmas and the next block's, the two warps'
      // RowCorrection made C = 512 "zero" 4% slower (session 43); here it runs while the tile's last wgmmas finish.
      // (Producer warps computing them, handed over through an mbarrier, gained 3%: benchmarks/NOTES.md, session 43.)
      if (kb == k_blocks - 1 && !p.pad_one && wtid < 64) {
        row_correction[64 * half + wtid] = RowCorrection(p, div, tile_m, 64 * half + wtid);
      }
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (kb > 0 && wtid % 32 == 0) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar(empty0, half, previous_stage)) : "memory");
      }
      previous_stage = at.stage;
      at.Advance();
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    JAXBNN_TRACE_TILE(half, traced_tile, 2, wtid);
    if (wtid % 32 == 0) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar(empty0, half, previous_stage)) : "memory");
    }
    if (wtid % 4 == 0) {
      const int r = 64 * half + 16 * (wtid / 32) + wtid % 32 / 4;
      popc_a[r] = row_popc[0];
      popc_a[r + 8] = row_popc[2];
    }
    if (first_tile_of_cta && half == 0) {
      asm volatile("bar.sync 1, 256;\n" ::: "memory");  // warpgroup 1's columns are staged too
    } else {
      asm volatile("bar.sync %0, 128;\n" ::"r"(tile_bar) : "memory");
    }
    StoreAccumulators(p, acc, popc_a, row_correction, cols, tile_m, col0, half, wtid, p.n - col0 <= kWgCols / 2);
    JAXBNN_TRACE_TILE(half, traced_tile, 3, wtid);
  }
#endif
}

// ---------------------------------------------------------------------------------------------------
// Image-band wgmma kernel (sm_90a): stride-1 convolutions of at most 128 output channels whose taps are
// whole 16-byte chunks of channels (C a multiple of 128, one chunk per tap or an even number of them) or
// 8-byte halves of one (C = 64: pixel pairs, below), unpooled.
//
// A CTA keeps its column tile's weights and a band of input rows of one image in shared memory. In the
// band, the zero-padded frame (the TMA unit fills out-of-frame pixels with zeros) lies row after row,
// Wp = out_w + kw - 1 positions per row, 16 bytes per position in each of the P = cw / 4 channel planes.
// Output position q = oy Wp + ox takes tap (i, j) of chunk c from position q + i Wp + j of plane c: 64
// consecutive positions are 64 rows of 16 contiguous bytes, a no-swizzle wgmma operand (8-row groups 128
// bytes apart) whatever the tap. So each k256 step's A operand is the band itself at a shifted start, and
// the implicit GEMM runs without a gather, a ring of stages or a producer: the resident kernel's k loop of
// then (barriers, TMA boxes per K block, row-popcount loads) is gone, and C = 128 was bound by exactly that
// (benchmarks/NOTES.md, session 12). A k256 step takes two consecutive chunks of K, as the FSB weights hold
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
// lost to the resident kernel (session 13, jobs DA-DB).
//
// A work item is a run of consecutive 64-position tiles; its band is every input row those tiles read. The
// tiles of image b are b * image_tiles .. + tiles_per_image - 1 (image_tiles >= tiles_per_image: the slots
// past an image's tiles are empty). Where image_tiles is a multiple of tiles_per_item, items stay within
// an image; else an item may run from the end of one image into the start of the next, and its band is
// two segments, one per image, each in its own slot of the band buffer: so that every SM takes an equal
// share where images do not divide evenly (16 images of 66 tiles: 8 tiles on each of 132 SMs, not 9 on
// 128: two rounds of tiles over the four warpgroups instead of three).
// CTA b takes items b, b + ctas, ... into two band buffers (the next item's band loads while the current
// one's tiles run); its warpgroups take the item's tiles in turn.
inline constexpr int kBandCols = 128, kBandWarpgroups = 4, kBandThreads = 128 * kBandWarpgroups;

// Its divisors are fast ones: the set-up's runtime divisions (the first item's, the steps' chunk offsets)
// were single-thread dependent chains on the way to the first tile (clock64 trace, session 16).
struct BandLayout {
  FastDivisor padded_w;  // Wp
  FastDivisor planes;    // P
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
                            // padded rows of 8-byte elements, not a box row of 16 bytes per position (v38)
};

// Whether the band kernel takes `p` as pixel pairs (C = 64: 8 bytes a position, two sets of weights; above).
__host__ __device__ __forceinline__ bool PixelPairs(const BinaryGemmProblem& p) { return p.cw == 2; }

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
// m64n144 wgmma: each row's popc(A)), the column table, the steps' A descriptors, three barriers.
struct BandSmem {
  int buffer_bytes, weights, ones, cols, steps, barriers, total;
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
  s.buffer_bytes = (PixelPairs(p) ? 1 : p.cw / 4) * b.plane_bytes;
  const int slack = (16 * (p.kw + 64) + 127) / 128 * 128;
  s.weights = 2 * s.buffer_bytes + slack;
  s.ones = s.weights + kBandCols / 8 * b.k_tiles * 128;
  s.cols = s.weights + (PixelPairs(p) ? 2 : 1) * WeightSetBytes(b);  // pixel pairs: a set per parity
  s.steps = (s.cols + static_cast<int>(sizeof(TileColumns<kWgCols>)) + 7) / 8 * 8;
  s.barriers = s.steps + 8 * b.steps;
  s.total = 1024 + s.barriers + 3 * 8;
  return s;
}

// Pixel pairs: k256 steps per filter row, ceil((kw + 1) / 4): four columns each, from column 0 or -1.
__host__ __device__ __forceinline__ int PixelPairStepsPerRow(int kw) { return (kw + 4) / 4; }
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
#endif

// kUnrolledSteps > 0: at most that many k256 steps, issued by a fully unrolled loop (kExactSteps: exactly
// that many, the 3x3 filters of C = 64 and 128); 0: any number, by a loop of runtime length. ptxas
// serializes the wgmmas of every runtime-length form it was given (remark C7520, "compiler-inserted WG.AR in
// divergent path": a fence per step, per pair, per block of 8 with or without a commit in the loop, session
// 14). The unrolled loop's exit after band.steps still costs a `warpgroup.arrive` before every wgmma and a
// dummy HGMMA per tile (remark C7519), which the exact instances do without. kPixelPairs: C = 64 (above),
// its own instances so that the other channel counts keep their registers; kQuarter: N <= 64 (most C = 64
// layers), the threshold bits of the first 64 columns only (a run-time choice between the two epilogues
// spilled).
inline constexpr int kBandUnrolledSteps = 16;
template <int kUnrolledSteps, bool kExactSteps, bool kPixelPairs, bool kQuarter>
__global__ void __launch_bounds__(kBandThreads, 1)
    BandWgmmaKernel(const BinaryGemmProblem p, const __grid_constant__ CUtensorMap band_map, const BandLayout band) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - SmemAddress(smem_raw) % 1024) % 1024;
  const BandSmem at = BandSmemOf(p, band);
  auto& cols = *reinterpret_cast<TileColumns<kWgCols>*>(smem + at.cols);
  uint64_t* step_desc = reinterpret_cast<uint64_t*>(smem + at.steps);
  const uint32_t base = SmemAddress(smem), weights = base + at.weights;
  const uint32_t band_full = base + at.barriers;  // [buffer]: the band landed
  const uint32_t weights_full = band_full + 16;
  const int tid = threadIdx.x, wp = band.padded_w.divisor, planes = band.planes.divisor, taps = p.kh * p.kw;
  // pixel pairs: 8 bytes a position, and the band's extra first column where the left padding is odd
  const int position_bytes = kPixelPairs ? 8 : 16, odd_pad = kPixelPairs ? p.pad_left & 1 : 0;
  const int wg = tid / 128, wtid = tid % 128, w = wtid / 32, lane = wtid % 32, g = lane / 4, t = lane % 4;
  JAXBNN_TRACE_START(0, tid == 0);
  constexpr int col0 = 0;  // N <= 128: one column tile
  // the first output row of segment s's band (the second segment starts its image)
  auto first_row = [&](const BandItem& it, int s) { return s == 0 ? Quotient(64 * it.first_tile, band.padded_w) : 0; };
  auto load_band = [&](const BandItem& it, int buffer) {  // one thread
    const int segments = it.tiles[1] > 0 ? 2 : 1;
    const uint32_t full = band_full + 8 * buffer, dst = base + buffer * at.buffer_bytes;
    BarrierArriveExpectBytes(full, segments * planes * band.band_rows * wp * position_bytes);
    for (int s = 0; s < segments; ++s) {
      if (kPixelPairs) {  // from the even column at or left of the frame's first
        TensorCopy3d(dst + s * band.slot_positions * 8, band_map, -p.pad_left - odd_pad, first_row(it, s) - p.pad_top,
                     it.image + s, full);
        continue;
      }
      if (band.whole_rows) {
        TensorCopy3d(dst + s * band.slot_positions * 16, band_map, -2 * p.pad_left, first_row(it, s) - p.pad_top,
                     it.image + s, full);
        continue;
      }
      for (int c = 0; c < planes; ++c) {
        TensorCopy4d(dst + c * band.plane_bytes + s * band.slot_positions * 16, band_map, 16 * c, -p.pad_left,
                     first_row(it, s) - p.pad_top, it.image + s, full);
      }
    }
  };
  if (tid == 0) {
    PrefetchTensorMap(band_map);
    BarrierInit(band_full, 1);
    BarrierInit(band_full + 8, 1);
    BarrierInit(weights_full, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // What depends on the parameters only (no buffer of the problem) comes before `griddepcontrol.wait`, under
  // the previous kernel's tail: the first item, the zeroed chunks, the all-ones block, the steps' descriptors.
  // Each piece of the set-up was one thread's short dependent chain of ~0.5-0.7 us, however few its
  // instructions (clock64 trace, session 16, jobs GB-GC); the small jobs go to the last warps
  // (`from_last`), away from the warps that issue the copies.
  const BandItem first_item = BandItemOf(p, band, blockIdx.x);  // every CTA has an item
  const int from_last = kBandThreads - 1 - tid;
  // The odd last chunk's partner (P = 1, an odd number of taps): zero weights, so its A bytes count nothing.
  const int chunks = taps * planes;
  if (!kPixelPairs && band.k_tiles > chunks) {
    for (int i = from_last; i < kBandCols / 8 * 8; i += kBandThreads) {
      *reinterpret_cast<uint4*>(smem + at.weights + (i / 8 * band.k_tiles + chunks) * 128 + i % 8 * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }
  // The all-ones row groups: ones over the real chunks, zeros over the odd partner. AND-popc with them is
  // popc(A) of the row's receptive field, computed with the tile's dot products (the position popcounts
  // of each band, a pass over it before its first tile, and their window sums per row took ~0.4 us of the
  // first tile's start, session 17), by the same wgmma as the weights' columns (v41: an m64n128 and an
  // m64n8 wgmma per step before).
  // Pixel pairs: ones over the halves of real taps, in both sets.
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
  // Step s takes chunks 2s, 2s + 1 of K: chunk k is plane k % P of tap k / P, at plane_bytes (k % P) +
  // 16 (i Wp + j) from the band's start for tile position 0 (the partner of an odd last chunk: 16 bytes on).
  auto tap_position = [&](int tap) {  // i Wp + j
    const int i = Quotient(tap, band.kw);
    return i * wp + tap - i * p.kw;
  };
  auto chunk_offset = [&](int k) {
    const int tap = Quotient(k, band.planes), c = k - tap * planes;
    return c * band.plane_bytes + 16 * tap_position(tap);
  };
  if (kPixelPairs) {
    // Step s of filter row dy reads four positions from dy Wp + 4 (s % steps per row) on, relative to the
    // tile's first aligned one (the tile adds it); its two 16-byte chunks lie 16 bytes apart.
    for (int s = from_last; s < band.steps; s += kBandThreads) {
      const int dy = s / PixelPairStepsPerRow(p.kw);
      step_desc[s] = OperandDescriptor(base + 8 * (dy * wp + PixelPairColumn(p, 2 * s, 0, 0)), 16, 128);
    }
  } else {
    for (int s = from_last; s < band.steps; s += kBandThreads) {
      const int first = chunk_offset(2 * s);
      const int along_k = 2 * s + 1 < chunks ? chunk_offset(2 * s + 1) - first : 16;
      step_desc[s] = OperandDescriptor(base + first, along_k, 128);
    }
  }
  __syncthreads();
  // a programmatic dependent launch, as the other wgmma kernels: no global access before this
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  JAXBNN_TRACE_START(4, tid == 0);
  // The rest of the set-up is three latency chains, each started right here in its own warps: the band's
  // copy (thread 0), the weights' copies (warp 1), each column's loads and sums (every thread). Thread 0
  // issuing the copies and the small jobs in turn reached its share of the column table 1.9 us after the
  // wait (session 16, job GB).
  if (tid == 0) {
    load_band(first_item, 0);
    JAXBNN_TRACE_START(3, true);
  } else if (tid / 32 == 1 && !kPixelPairs) {
    const int row_tiles = p.w_row_tiles, lane_1 = tid % 32;
    const uint32_t row_bytes = p.w_k_tiles * 128;
    if (lane_1 == 0) BarrierArriveExpectBytes(weights_full, row_tiles * row_bytes);
    __syncwarp();
    for (int j = lane_1; j < row_tiles; j += 32) {
      BulkCopy(weights + j * band.k_tiles * 128, p.w + static_cast<size_t>(j) * p.w_k_tiles * 32, row_bytes,
               weights_full);
    }
  }
  // The column table, a column per thread of each warpgroup: the last one also fills the other parameters,
  // and every one a quarter of the border classes (so that the classes' sums run 4 chains a column), each
  // class already holding its bound (the thread computes the bound itself: no second barrier). A column's
  // tap popcounts and threshold are loaded together, one round trip to L2. "Zero" padding's set-up, from
  // the CTA's start: one warpgroup filling all, 4.2 us; the parameters by another warpgroup, 4.0; the table
  // over four, 3.5 (session 14, jobs EA-EB); this form, 3.3 (session 15, job FB: the loads were not what
  // "zero" spends over "one").
  static_assert(kBandCols == 128, "a column per thread of each warpgroup");
  if (p.correction_table) {
    const ColumnThreshold th = LoadColumnThreshold(p, col0 + wtid);
    const bool class_bounds = p.epilogue == Epilogue::kBits;
    const int popc_b = FillCorrectionTable<kWgCols>(p, cols, col0, wtid, wg, kBandWarpgroups, class_bounds, th);
    if (wg == kBandWarpgroups - 1) FillColumnParameters<kWgCols>(p, cols, col0, wtid, popc_b, th);
  } else if (wg == kBandWarpgroups - 1) {
    FillTileColumn<kWgCols>(p, cols, col0, wtid);
  } else if (wg == 0 && p.edge_table) {
    FillEdgeTable<kWgCols>(p, cols, col0, wtid);
  }
  if (kPixelPairs) LoadPixelPairWeights(p, band, smem + at.weights, tid);
  JAXBNN_TRACE_START(5, tid == 0);
  // the zeroed chunks, ones and pixel-pair weights, for the wgmmas
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  JAXBNN_TRACE_START(6, tid == 0);
  if (!kPixelPairs) BarrierWait(weights_full, 0);
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  JAXBNN_TRACE_START(1, tid == 0);

  int round = 0, traced_tile = 0;
  for (int item = blockIdx.x; item < band.items; item += band.ctas, ++round) {
    const int buffer = round & 1, next = item + band.ctas;
    // the other buffer's last reader finished before the previous round's closing barrier
    if (tid == 0 && next < band.items) load_band(BandItemOf(p, band, next), buffer ^ 1);
    const BandItem item_tiles = BandItemOf(p, band, item);
    const int tiles = item_tiles.tiles[0] + item_tiles.tiles[1];
    BarrierWait(band_full + 8 * buffer, (round >> 1) & 1);  // every thread: no barrier needed after it
    if (round == 0) JAXBNN_TRACE_START(2, tid == 0);
    // The first tiles in two halves: the second half of the warpgroups issues its wgmmas only once the first
    // half has issued its own, so that the tensor cores finish the first half's tiles first and their
    // epilogues run under the second half's wgmmas; the halves then stay apart. Issued all at once, the four
    // tiles finished together and four epilogues ran at once with the tensor cores idle (session 17).
    const bool leading_half = wg < kBandWarpgroups / 2;
    if (round == 0 && !leading_half) asm volatile("bar.sync 1, %0;\n" ::"n"(kBandThreads) : "memory");
    if (round == 0 && leading_half && wg >= tiles) asm volatile("bar.arrive 1, %0;\n" ::"n"(kBandThreads) : "memory");
    for (int i = wg; i < tiles; i += kBandWarpgroups, ++traced_tile) {
      // traced: the first two warpgroups (the harness's trace has two)
      if (wg < 2) JAXBNN_TRACE_TILE(wg, traced_tile, 0, wtid);
      // recomputed per tile (a fast division since v32), not kept from `item_tiles`: ptxas reported the same
      // spills both ways, and no timing compared them (session 15)
      const BandItem it = BandItemOf(p, band, item);
      const int seg = i >= it.tiles[0] ? 1 : 0, image = it.image + seg;
      // the tile's first position in its image, and in the band buffer; pixel pairs: its rows every other
      // position
      const int tile = seg == 0 ? it.first_tile + i : i - it.tiles[0], row_step = kPixelPairs ? 2 : 1;
      const int q0 = kPixelPairs ? 128 * (tile >> 1) + (tile & 1) : 64 * tile;
      const int local0 = q0 - first_row(it, seg) * wp + seg * band.slot_positions;
      int acc[kBandCols / 2], popc_a[8];  // popc_a: rows g, g + 8 (each four times) against the all-ones B
      // step_desc is relative to buffer 0 at tile position 0: the start address field moves by 16 bytes per
      // position. Pixel pairs: the band holds position q at byte 8 (q + odd_pad); a tile whose rows start at
      // an odd byte offset / 8 reads from one position before, with the second weight set.
      const int parity = kPixelPairs ? (local0 + odd_pad) & 1 : 0;
      const uint32_t a_shift =
          (buffer * at.buffer_bytes >> 4) + (kPixelPairs ? (local0 + odd_pad - parity) >> 1 : local0);
      const uint32_t b_set = weights + parity * WeightSetBytes(band);
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
      if (round == 0 && leading_half && i == wg) asm volatile("bar.arrive 1, %0;\n" ::"n"(kBandThreads) : "memory");
      AccumulatorRows rows;  // while the wgmmas run
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * w + g + 8 * h, q = q0 + row_step * r;
        const int oy = Quotient(q, band.padded_w), ox = q - oy * wp;
        rows.valid[h] = oy < p.out_h && ox < p.out_w;
        rows.row[h] = (static_cast<long long>(image) * p.out_h + oy) * p.out_w + ox;
        const FrameExcess e = ExcessOf(p, oy - p.pad_top, ox - p.pad_left);
        const bool border = !p.pad_one && rows.valid[h] && e.top + e.bottom + e.left + e.right > 0;
        rows.correction[h] = border ? (p.correction_table ? BorderClass(p, e) : 1) : 0;
      }
      if (wg < 2) JAXBNN_TRACE_TILE(wg, traced_tile, 1, wtid);
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      if (wg < 2) JAXBNN_TRACE_TILE(wg, traced_tile, 2, wtid);
#pragma unroll
      for (int h = 0; h < 2; ++h) rows.v0[h] = p.k_real - 2 * popc_a[2 * h];
      StoreAccumulatorRows<kBandCols / 2, kQuarter>(p, acc, rows, cols, col0, t, true);
      if (wg < 2) JAXBNN_TRACE_TILE(wg, traced_tile, 3, wtid);
    }
    __syncthreads();  // this buffer is free for the item after next
  }
#endif
}

// ---------------------------------------------------------------------------------------------------
// Host side: a launch is planned once per problem shape and replayed from a cache.
//
// Planning (which kernel, its grid and shared memory, the band layout, the tensor maps) took the launcher
// 4.3-6.2 us of host time per call (kernel harness, session 17, job HK): about half the ~9 us a C = 128
// convolution takes on the GPU, paid again whenever XLA calls the handler. A plan depends on the problem's
// shape, the operands' alignment and the device alone; only its tensor maps hold operand addresses, so a
// cached plan is re-pointed (its maps re-encoded from their recipes) when a call brings other buffers.

struct DeviceInfo {
  int major = 0, minor = 0, sms = 0, smem_optin = 0;  // smem_optin: bytes of shared memory a block may take
  int smem_per_sm = 0, smem_reserved = 0;              // an SM's shared memory, and what each block costs it extra
};

cudaError_t QueryDevice(int device, DeviceInfo& info) {
  cudaError_t err;
  if ((err = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) {
    return err;
  }
  if ((err = cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device)) != cudaSuccess) {
    return err;
  }
  return cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

LaunchDivisors DivisorsOf(const BinaryGemmProblem& p) {
  return {FastDivisor(p.cw), FastDivisor(p.kw), FastDivisor(p.cw * 4), FastDivisor(p.out_h * p.out_w),
          FastDivisor(p.out_w)};
}

int TilesOfRows(const BinaryGemmProblem& p, int rows) {
  const int pooled_per_tile = rows / (p.pool_h * p.pool_w);
  return (p.pooled_rows + pooled_per_tile - 1) / pooled_per_tile;
}

// cuTensorMapEncodeTiled from the driver, through the runtime (no link-time dependency on libcuda);
// null if the driver lacks it, and then the activations go by cp.async.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encode;
}

// A tensor map without its address: what cuTensorMapEncodeTiled takes besides the operand's pointer.
struct TensorMapRecipe {
  CUtensorMapDataType data_type = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  cuuint32_t rank = 0;  // 0: no map
  cuuint64_t dims[4] = {};
  cuuint64_t strides[3] = {};  // rank - 1 of them
  cuuint32_t box[4] = {};
  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
};

bool Encode(const TensorMapRecipe& r, const void* address, CUtensorMap& map) {
  std::memset(&map, 0, sizeof(map));
  if (r.rank == 0) return true;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  const cuuint32_t unit_strides[4] = {1, 1, 1, 1};
  return encode != nullptr &&
         encode(&map, r.data_type, r.rank, const_cast<void*>(address), r.dims, r.strides, r.box,
                unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, r.swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The activations as a 4-D tensor of NHWC bytes, (channel bytes, W, H, images), in (box_bytes, box_w,
// box_h, 1) boxes; coordinates outside the image (padding) arrive as zeros.
TensorMapRecipe NhwcBytes(const BinaryGemmProblem& p, int box_bytes, int box_w, int box_h,
                          CUtensorMapSwizzle swizzle) {
  const cuuint64_t pixel_bytes = static_cast<cuuint64_t>(p.cw) * 4;
  TensorMapRecipe r;
  r.rank = 4;
  r.dims[0] = pixel_bytes;
  r.dims[1] = static_cast<cuuint64_t>(p.in_w);
  r.dims[2] = static_cast<cuuint64_t>(p.in_h);
  r.dims[3] = static_cast<cuuint64_t>(p.batch);
  r.strides[0] = pixel_bytes;
  r.strides[1] = pixel_bytes * p.in_w;
  r.strides[2] = pixel_bytes * p.in_w * p.in_h;
  r.box[0] = static_cast<cuuint32_t>(box_bytes);
  r.box[1] = static_cast<cuuint32_t>(box_w);
  r.box[2] = static_cast<cuuint32_t>(box_h);
  r.box[3] = 1;
  r.swizzle = swizzle;
  return r;
}

// How the wgmma kernel takes the activations of `p`, with the recipe of the TMA tensor map it needs:
//   rows of a plain matrix (bmm, 1x1 stride-1 unpadded convolutions): bytes x rows, 128 x 128 boxes,
//   128B swizzle (kSwizzledRows);
//   stride-1 convolutions whose 128-row tiles are whole output rows (128 % out_w == 0, tiles inside an
//   image) or 128-pixel runs of one (out_w % 128 == 0): NHWC bytes, out-of-frame taps zero-filled by the
//   TMA unit; one (W bytes, pixels) box per W bytes of K with the W-byte swizzle where a tap's channel
//   bytes are 32, 64 or a multiple of 128 (kTapRows), else one (16 bytes, pixels) box per 16-byte chunk
//   (kChunkSlabs);
//   anything else: cp.async (kCoreMatrices: no map; WgmmaKernel copies into kSwizzledRows).
// `rows`: the rows of a box (128: WgmmaKernel's tiles; 64: ResidentWgmmaKernel's halves).
ALayout ActivationLayout(const BinaryGemmProblem& p, TensorMapRecipe& r, int rows = kWgRows) {
  r = TensorMapRecipe{};
  // the boxes take 16 bytes (4 words) of a tap at least
  if (p.pool_h * p.pool_w != 1 || p.stride_h != 1 || p.stride_w != 1 || p.cw % 4 != 0) return ALayout::kCoreMatrices;
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(p.cw) * 4;
  if (p.kh == 1 && p.kw == 1 && p.pad_top == 0 && p.pad_left == 0 && p.out_h == p.in_h && p.out_w == p.in_w) {
    r.rank = 2;
    r.dims[0] = row_bytes;
    r.dims[1] = static_cast<cuuint64_t>(p.pooled_rows);
    r.strides[0] = row_bytes;
    r.box[0] = 128;
    r.box[1] = static_cast<cuuint32_t>(rows);
    r.swizzle = CU_TENSOR_MAP_SWIZZLE_128B;
    return ALayout::kSwizzledRows;
  }
  const int box_w = p.out_w < rows ? p.out_w : rows, box_h = rows / box_w;
  const bool whole_rows = rows % p.out_w == 0 && p.out_h % box_h == 0;
  if (!(whole_rows || p.out_w % rows == 0)) return ALayout::kCoreMatrices;
  // Tap rows where a tap's bytes allow (W-byte boxes with the W-byte swizzle), else 16-byte chunk boxes.
  const int tap_row_bytes = TapRowBytes(p.cw);
  r = NhwcBytes(p, tap_row_bytes ? tap_row_bytes : 16, box_w, box_h,
                tap_row_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                : tap_row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                : tap_row_bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                      : CU_TENSOR_MAP_SWIZZLE_NONE);
  return tap_row_bytes ? ALayout::kTapRows : ALayout::kChunkSlabs;
}

// The weights as a 3-D tensor of FSB tiles for WeightCopyMulticast: (128 bytes, w_k_tiles, w_row_tiles),
// boxes of 8 x 16 tiles.
TensorMapRecipe WeightRecipe(const BinaryGemmProblem& p) {
  TensorMapRecipe r;
  r.rank = 3;
  r.dims[0] = 128;
  r.dims[1] = static_cast<cuuint64_t>(p.w_k_tiles);
  r.dims[2] = static_cast<cuuint64_t>(p.w_row_tiles);
  r.strides[0] = 128;
  r.strides[1] = static_cast<cuuint64_t>(p.w_k_tiles) * 128;
  r.box[0] = 128;
  r.box[1] = kKBlockWords / 4;
  r.box[2] = kWgCols / 8 / kWgCluster;
  return r;
}

// The resident kernel's weights: one box of a column tile's `cols` / 8 row tiles of all K tiles (FSB tiles
// of 128 bytes; at most 256 of each, a box's limit: PlanResident's shared memory keeps K far below).
TensorMapRecipe ResidentWeightRecipe(const BinaryGemmProblem& p, int cols) {
  TensorMapRecipe r = WeightRecipe(p);
  r.box[1] = static_cast<cuuint32_t>(p.w_k_tiles);
  r.box[2] = static_cast<cuuint32_t>(cols / 8);
  return r;
}

// A launch of one problem: the kernel, its grid, and the values of its parameters. The kernels take some of
// these in the order `kind` names (Launch lists them).
struct LaunchPlan {
  enum class Kind { kClassic, kPersistent, kResident, kBand, kDenseTaps } kind = Kind::kClassic;
  const void* kernel = nullptr;
  KernelPath path = KernelPath::kSimt;  // the engine that runs
  unsigned ctas = 0, threads = 0;
  int smem = 0;
  int cluster = 1;
  bool programmatic = false;  // a programmatic dependent launch (the wgmma kernels)
  BinaryGemmProblem p;
  LaunchDivisors div;
  TensorMapRecipe a_recipe, w_recipe;  // a: the activations (p.x), w: the weights (p.w)
  CUtensorMap a_map, w_map;
  BandLayout band;
  int m_tiles = 0, n_tiles = 0, m_pairs = 0, ctas_per_column = 0;
  bool weights_by_tma = false, runs = false;
};

// The fields the launcher derives from the shape: the frame's largest excess, "one" padding where no
// receptive field reaches past the frame (a BMM, a convolution without padding: both paddings then agree,
// and as "one" padding the kernels skip the per-row border tests and the correction table; through XLA, a
// BMM as "zero" padding ran 17% longer), and whether the tiles keep the correction table.
void DeriveFromShape(BinaryGemmProblem& p) {
  p.max_excess = MaxExcessOf(p);
  if (!p.pad_one && BorderClasses(p) == 1) p.pad_one = true;
  p.compact_classes = UsesCompactClasses(p);
  p.class_numbering = ClassNumberingOf(p);
  p.correction_table = KeepsCorrectionTable(p);
  p.edge_table = KeepsEdgeTable(p);
  p.edge_corners = KeepsEdgeCorners(p);
}

// Points the plan at the operands of `p` (same shape): its problem, and its tensor maps re-encoded where an
// address moved. False where a map cannot be made for the new address.
bool Repoint(LaunchPlan& plan, const BinaryGemmProblem& p) {
  const bool x_moved = plan.p.x != p.x, w_moved = plan.p.w != p.w;
  plan.p = p;
  DeriveFromShape(plan.p);
  return (!x_moved || Encode(plan.a_recipe, p.x, plan.a_map)) && (!w_moved || Encode(plan.w_recipe, p.w, plan.w_map));
}

// One tile per CTA of ClassicKernel<Engine>; 16-byte activation copies where every tap's words are aligned.
template <class Engine>
LaunchPlan PlanClassic(const BinaryGemmProblem& p, bool aligned, KernelPath path) {
  LaunchPlan plan;
  plan.kind = LaunchPlan::Kind::kClassic;
  plan.path = path;
  plan.kernel = reinterpret_cast<const void*>(aligned ? ClassicKernel<Engine, 4> : ClassicKernel<Engine, 1>);
  plan.threads = Engine::kThreads;
  plan.smem = ClassicSmemBytes<Engine>();
  plan.p = p;
  plan.div = DivisorsOf(p);
  plan.m_tiles = TilesOfRows(p, Engine::kRows);
  plan.n_tiles = (p.n + Engine::kCols - 1) / Engine::kCols;
  const long long tiles = static_cast<long long>(plan.m_tiles) * plan.n_tiles;
  plan.ctas = tiles > INT_MAX ? 0 : static_cast<unsigned>(tiles);  // 0: too many tiles (refused at launch)
  return plan;
}

// DenseTapKernel (UsesDenseTaps): as many CTAs as fit the SMs at once (three an SM where the shared memory
// takes them), the column tiles shared out evenly, each CTA at least one row tile.
LaunchPlan PlanDenseTaps(const BinaryGemmProblem& p, const DeviceInfo& info) {
  using Engine = MmaSyncDenseTaps;
  LaunchPlan plan;
  plan.kind = LaunchPlan::Kind::kDenseTaps;
  plan.path = KernelPath::kMmaSync;
  const bool edge_borders = DenseBorderBounds(p) && !DensePrefixSums<Engine>(p);
  plan.kernel = edge_borders ? reinterpret_cast<const void*>(DenseTapKernel<Engine, true>)
                             : reinterpret_cast<const void*>(DenseTapKernel<Engine, false>);
  plan.threads = Engine::kThreads;
  plan.smem = DenseTapSmem<Engine>::kBytes;
  plan.p = p;
  plan.m_tiles = TilesOfRows(p, Engine::kRows);
  const int n_tiles = (p.n + Engine::kCols - 1) / Engine::kCols;
  const int per_sm = std::max(1, std::min(kDenseTapCtasPerSm, info.smem_per_sm / (plan.smem + info.smem_reserved)));
  plan.ctas_per_column = std::max(1, std::min(plan.m_tiles, per_sm * info.sms / n_tiles));
  const long long ctas = static_cast<long long>(n_tiles) * plan.ctas_per_column;
  plan.ctas = ctas > INT_MAX ? 0 : static_cast<unsigned>(ctas);  // 0: too many (refused at launch)
  return plan;
}

// ResidentWgmmaKernel where it can run `p`: unpooled, the column tile's weights within the shared memory left
// by the rest, at least one CTA per column tile, and activations by TMA in 64-row boxes, or by cp.async where
// no box takes them (14 x 14 or 7 x 7 images, stride 2) but the grid is small (below): 16-byte copies, more
// than one short K block (WgmmaKernel's short-K instances take those). False (nothing planned) otherwise.
bool PlanResident(const BinaryGemmProblem& p, const DeviceInfo& info, LaunchPlan& plan) {
  const int m_tiles = TilesOfRows(p, kWgRows), wide_n_tiles = (p.n + kWgCols - 1) / kWgCols;
  // Column tiles of 128 (m64n128 wgmmas) where N <= 128, and where 256-column tiles would leave half the SMs
  // or more idle (batch-8 layers, small-batch GEMMs): twice the CTAs, each with half the weight bytes and
  // half the tensor work of its tile.
  const bool small_grid = 2ll * m_tiles * wide_n_tiles <= info.sms;
  const bool narrow = p.n <= kWgCols / 2 || small_grid;
  const int n_tiles = narrow ? (p.n + kWgCols / 2 - 1) / (kWgCols / 2) : wide_n_tiles;
  if (p.pool_h * p.pool_w != 1 || n_tiles > info.sms || reinterpret_cast<uintptr_t>(p.w) % 16 != 0 ||
      TensorMapEncoder() == nullptr) {
    return false;
  }
  const ALayout layout = ActivationLayout(p, plan.a_recipe, 64);
  const bool copies = layout == ALayout::kCoreMatrices;
  if (copies && !(small_grid && p.cw % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && p.k_words > 24)) {
    return false;
  }
  const int smem = kResidentFixedBytes + ResidentWeightBytes(p.w_k_tiles, narrow ? kWgCols / 2 : kWgCols) +
                   (copies ? kResidentOriginBytes : 0);
  if (smem > info.smem_optin || !Encode(plan.a_recipe, p.x, plan.a_map)) return false;  // (cp.async: no map)
  // the weights by one TMA box (where the driver cannot encode its map, the persistent kernel runs `p`)
  plan.w_recipe = ResidentWeightRecipe(p, narrow ? kWgCols / 2 : kWgCols);
  if (!Encode(plan.w_recipe, p.w, plan.w_map)) return false;
  const auto kernel =
      copies ? ResidentWgmmaKernel<ALayout::kCoreMatrices, kWgCols / 2>  // small grids only: always narrow
      : layout == ALayout::kSwizzledRows
          ? (narrow ? ResidentWgmmaKernel<ALayout::kSwizzledRows, kWgCols / 2> : ResidentWgmmaKernel<ALayout::kSwizzledRows, kWgCols>)
      : layout == ALayout::kChunkSlabs
          ? (narrow ? ResidentWgmmaKernel<ALayout::kChunkSlabs, kWgCols / 2> : ResidentWgmmaKernel<ALayout::kChunkSlabs, kWgCols>)
          : (narrow ? ResidentWgmmaKernel<ALayout::kTapRows, kWgCols / 2> : ResidentWgmmaKernel<ALayout::kTapRows, kWgCols>);
  plan.kind = LaunchPlan::Kind::kResident;
  plan.path = KernelPath::kWgmma;
  plan.kernel = reinterpret_cast<const void*>(kernel);
  plan.threads = kWgThreads;
  plan.smem = smem;
  plan.programmatic = true;
  plan.p = p;
  plan.div = DivisorsOf(p);
  plan.m_tiles = m_tiles;
  // every SM a CTA, the column tiles shared out evenly; each CTA at least one row tile
  plan.ctas_per_column = std::max(1, std::min(m_tiles, info.sms / n_tiles));
  plan.ctas = static_cast<unsigned>(n_tiles * plan.ctas_per_column);
  return true;
}

// BandWgmmaKernel where it can run `p`: an unpooled stride-1 convolution with taps (not a GEMM: the resident
// kernel's rows need no band) of at most 128 output channels, 16-byte channel chunks in planes it can pair
// (P = 1 or even) or pixel pairs (C = 64, an even input width), a padded row of at most 256 positions (a
// TMA box side), and a band of a tile per warpgroup in the shared memory left by the weights. False (nothing
// planned) otherwise.
bool PlanBand(const BinaryGemmProblem& p, const DeviceInfo& info, LaunchPlan& plan) {
  const int sms = info.sms, smem_optin = info.smem_optin;
  // pixel pairs: an even Wp with the extra first column of an odd left padding, and rows of an even number
  // of pixels (a TMA row stride is a multiple of 16 bytes)
  const bool pixel_pairs = PixelPairs(p);
  const int planes = pixel_pairs ? 1 : p.cw / 4, position_bytes = pixel_pairs ? 8 : 16;
  const int wp = pixel_pairs ? (p.out_w + p.kw - 1 + (p.pad_left & 1) + 1) / 2 * 2 : p.out_w + p.kw - 1;
  const bool chunks_pair = pixel_pairs ? p.in_w % 2 == 0 : p.cw % 4 == 0 && (planes == 1 || planes % 2 == 0);
  if (TensorMapEncoder() == nullptr || p.n > kBandCols || p.pool_h * p.pool_w != 1 || p.stride_h != 1 ||
      p.stride_w != 1 || p.kh * p.kw == 1 || !chunks_pair || wp > 256 ||
      reinterpret_cast<uintptr_t>(p.x) % 16 != 0 || reinterpret_cast<uintptr_t>(p.w) % 16 != 0) {
    return false;
  }
  BandLayout band;
  band.padded_w = FastDivisor(wp);
  band.planes = FastDivisor(planes);
  band.kw = FastDivisor(p.kw);
  band.steps = pixel_pairs ? p.kh * PixelPairStepsPerRow(p.kw) : (p.kh * p.kw * planes + 1) / 2;
  band.k_tiles = 2 * band.steps;
  // pixel pairs: tiles in pairs over 128-position blocks, so every count of tiles below is even
  const int tile_step = pixel_pairs ? 2 : 1;
  auto round_up = [&](long long tiles) { return (tiles + tile_step - 1) / tile_step * tile_step; };
  band.tiles_per_image = static_cast<int>(round_up((p.out_h * wp + 63) / 64));
  // Input rows of a band segment of tiles [t0, t0 + tiles) of an image: T tiles span at most (64 T - 1) / Wp + 2
  // output rows, so kh - 1 more input rows.
  auto segment_rows = [&](int t0, int tiles) { return (64 * (t0 + tiles) - 1) / wp - 64 * t0 / wp + p.kh; };
  // Sets the band's rows (the most any segment of an item needs) and slots; false where the band does not fit.
  auto fit_band = [&](int slots) {
    // tile indices over the batch stay below 2^30: ints, and exact fast divisions (Quotient)
    if (static_cast<long long>(p.batch) * band.image_tiles.divisor > INT_MAX / 2) return false;
    band.slots = slots;
    band.items = static_cast<int>(
        (static_cast<long long>(p.batch) * band.image_tiles.divisor + band.tiles_per_item - 1) / band.tiles_per_item);
    band.ctas = std::min(band.items, sms);
    band.band_rows = 0;
    // items crossing images: one item per CTA, each looked at; else the items of one image (all images alike)
    const int looked_at = slots == 2 ? band.items : band.image_tiles.divisor / band.tiles_per_item;
    for (int item = 0; item < looked_at; ++item) {
      const BandItem it = BandItemOf(p, band, item);
      band.band_rows = std::max(band.band_rows, segment_rows(it.first_tile, it.tiles[0]));
      if (it.tiles[1] > 0) band.band_rows = std::max(band.band_rows, segment_rows(0, it.tiles[1]));
    }
    // a TMA destination is 128-byte aligned: 8 positions (pixel pairs: 16)
    band.slot_positions = static_cast<int>((band.band_rows * wp + 8 * tile_step - 1) / (8 * tile_step) * (8 * tile_step));
    band.plane_bytes = band.slots * band.slot_positions * position_bytes;
    return band.band_rows <= 256 && BandSmemOf(p, band).total <= smem_optin;
  };
  // Every CTA one item of an equal share of all tiles, crossing images where they do not divide evenly;
  // where that band does not fit (or a share is more than an image), items within images, as many as fill
  // the SMs once where the images allow, else bands as large as fit.
  const long long total_tiles = static_cast<long long>(p.batch) * band.tiles_per_image;
  const long long share = round_up((total_tiles + sms - 1) / sms);
  bool fits = false;
  if (share <= band.tiles_per_image) {
    band.tiles_per_item = static_cast<int>(share);
    band.image_tiles = FastDivisor(band.tiles_per_image);
    fits = fit_band(band.tiles_per_image % band.tiles_per_item != 0 ? 2 : 1);
  }
  if (!fits) {
    band.slots = 1;
    band.band_rows = 1;
    band.slot_positions = 0;
    band.plane_bytes = 0;
    const int fixed = BandSmemOf(p, band).total;
    const int row_bytes = 2 * planes * wp * position_bytes;  // two buffers
    const int max_rows = std::min(256, (smem_optin - fixed - 2 * planes * 128 * tile_step) / row_bytes);
    if (max_rows < p.kh + 1) return false;
    // bands of fewer tiles than warpgroups would leave warpgroups idle
    const int smem_tiles = ((max_rows - p.kh - 1) * wp + 1) / 64 / tile_step * tile_step;
    if (smem_tiles < kBandWarpgroups) return false;
    const int wanted_per_image = std::max(1, sms / p.batch);
    const int balanced_tiles = static_cast<int>(round_up((band.tiles_per_image + wanted_per_image - 1) / wanted_per_image));
    band.tiles_per_item = std::min(balanced_tiles, smem_tiles);
    const long long items_per_image = (band.tiles_per_image + band.tiles_per_item - 1) / band.tiles_per_item;
    if (items_per_image * band.tiles_per_item * p.batch > INT_MAX / 2) return false;
    band.image_tiles = FastDivisor(static_cast<int>(items_per_image) * band.tiles_per_item);
    if (!fit_band(1)) return false;
  }
  // Out-of-frame pixels arrive as zeros. One plane: one (2 Wp 8-byte elements, band rows) box of image rows
  // per segment where it fits a box side; else one (16 bytes, Wp, band rows) box of NHWC bytes per plane and
  // segment.
  TensorMapRecipe& r = plan.a_recipe;
  const cuuint64_t pixel_bytes = static_cast<cuuint64_t>(p.cw) * 4;
  band.whole_rows = pixel_pairs || (planes == 1 && 2 * wp <= 256);
  if (band.whole_rows) {
    const cuuint64_t pixel_elements = static_cast<cuuint64_t>(p.cw) / 2;  // 8-byte elements
    r.data_type = CU_TENSOR_MAP_DATA_TYPE_UINT64;
    r.rank = 3;
    r.dims[0] = pixel_elements * p.in_w;
    r.dims[1] = static_cast<cuuint64_t>(p.in_h);
    r.dims[2] = static_cast<cuuint64_t>(p.batch);
    r.strides[0] = pixel_bytes * p.in_w;
    r.strides[1] = pixel_bytes * p.in_w * p.in_h;
    r.box[0] = static_cast<cuuint32_t>(pixel_elements * wp);
    r.box[1] = static_cast<cuuint32_t>(band.band_rows);
    r.box[2] = 1;
  } else {
    r = NhwcBytes(p, 16, wp, band.band_rows, CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  if (!Encode(r, p.x, plan.a_map)) return false;
  plan.kind = LaunchPlan::Kind::kBand;
  plan.path = KernelPath::kWgmma;
  const bool unrolled = band.steps <= kBandUnrolledSteps, quarter = p.n <= kBandCols / 2;
  // the exact instances: 3 steps of pixel pairs (a 3x3 filter at C = 64) or 5 steps (3x3 at C = 128)
  const bool exact = band.steps == (pixel_pairs ? 3 : 5);
  plan.kernel = reinterpret_cast<const void*>(
      !pixel_pairs ? (exact      ? BandWgmmaKernel<5, true, false, false>
                      : unrolled ? BandWgmmaKernel<kBandUnrolledSteps, false, false, false>
                                 : BandWgmmaKernel<0, false, false, false>)
      : quarter    ? (exact      ? BandWgmmaKernel<3, true, true, true>
                      : unrolled ? BandWgmmaKernel<kBandUnrolledSteps, false, true, true>
                                 : BandWgmmaKernel<0, false, true, true>)
                   : (exact      ? BandWgmmaKernel<3, true, true, false>
                      : unrolled ? BandWgmmaKernel<kBandUnrolledSteps, false, true, false>
                                 : BandWgmmaKernel<0, false, true, false>));
  plan.ctas = static_cast<unsigned>(band.ctas);
  plan.threads = kBandThreads;
  plan.smem = BandSmemOf(p, band).total;
  plan.programmatic = true;
  plan.p = p;
  plan.band = band;
  return true;
}

// Clusters of two CTAs over pairs of row tiles: persistent (one CTA per SM) unless the pooled epilogue
// needs one tile per CTA.
LaunchPlan PlanPersistent(const BinaryGemmProblem& p, const DeviceInfo& info) {
  LaunchPlan plan;
  plan.kind = LaunchPlan::Kind::kPersistent;
  plan.path = KernelPath::kWgmma;
  const long long m_pairs = (TilesOfRows(p, kWgRows) + kWgCluster - 1) / kWgCluster;
  const long long n_tiles = (p.n + kWgCols - 1) / kWgCols;
  const long long pairs = m_pairs * n_tiles;
  const long long max_clusters = p.pool_h * p.pool_w > 1 ? pairs : info.sms / kWgCluster;
  const long long clusters = pairs < max_clusters ? pairs : max_clusters;
  // ctas 0: too many tiles (refused at launch)
  plan.ctas = pairs > INT_MAX || clusters * kWgCluster > INT_MAX ? 0 : static_cast<unsigned>(clusters * kWgCluster);
  ALayout layout = ActivationLayout(p, plan.a_recipe);
  if (layout != ALayout::kCoreMatrices && !Encode(plan.a_recipe, p.x, plan.a_map)) {
    layout = ALayout::kCoreMatrices;  // the driver cannot encode it: cp.async
    plan.a_recipe = TensorMapRecipe{};
  }
  plan.w_recipe = WeightRecipe(p);
  plan.weights_by_tma = Encode(plan.w_recipe, p.w, plan.w_map);  // else bulk copies
  if (!plan.weights_by_tma) plan.w_recipe = TensorMapRecipe{};
  // Runs of pairs per cluster when activations and weights together take at most 24 MiB of the 50 MiB L2.
  const long long operand_bytes = static_cast<long long>(p.batch) * p.in_h * p.in_w * p.cw * 4 +
                                  static_cast<long long>(p.w_row_tiles) * p.w_k_tiles * 128;
  plan.runs = operand_bytes <= (24ll << 20);
  // one short K block (unpooled, by cp.async): 1 or 3 k256 steps (K <= 8 or 24 words)
  const bool short_k = layout == ALayout::kCoreMatrices && p.k_words <= 24 && p.pool_h * p.pool_w == 1;
  const auto kernel = layout == ALayout::kSwizzledRows ? WgmmaKernel<ALayout::kSwizzledRows>
                      : layout == ALayout::kChunkSlabs ? WgmmaKernel<ALayout::kChunkSlabs>
                      : layout == ALayout::kTapRows    ? WgmmaKernel<ALayout::kTapRows>
                      : !short_k                       ? WgmmaKernel<ALayout::kCoreMatrices>
                      : p.k_words <= 8                 ? WgmmaKernel<ALayout::kCoreMatrices, 1>
                                                       : WgmmaKernel<ALayout::kCoreMatrices, 3>;
  plan.kernel = reinterpret_cast<const void*>(kernel);
  plan.threads = kWgThreads;
  plan.smem = kWgSmemBytes;
  // Programmatic dependent launch: the CTAs' start-up (barrier init, cluster sync: ~1.3 us, tile trace of
  // session 8) runs while the previous kernel's last CTAs finish; the kernel waits (griddepcontrol.wait)
  // before touching memory. A previous kernel that never triggers simply completes first.
  plan.programmatic = true;
  plan.cluster = kWgCluster;
  plan.p = p;
  plan.div = DivisorsOf(p);
  plan.m_pairs = static_cast<int>(m_pairs);
  plan.n_tiles = static_cast<int>(n_tiles);
  return plan;
}

// The plan for `p` on `path` (kAuto: the default choice; a forced engine that cannot run `p` falls back to
// it), with the fields derived from the shape (DeriveFromShape).
LaunchPlan Plan(BinaryGemmProblem p, KernelPath path, const DeviceInfo& info) {
  DeriveFromShape(p);
  // 16-byte copies need every tap's words 16-byte aligned (the classic kernels' kVec, the wgmma TMA boxes).
  const bool aligned = p.cw % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  // the wgmma kernel's cp.async producer also copies 8 bytes at a time (a tap of 2 words: C = 64)
  const bool half_aligned = p.cw % 2 == 0 && reinterpret_cast<uintptr_t>(p.x) % 8 == 0;
  const bool can_wgmma = info.major == 9 && info.minor == 0 && (aligned || half_aligned);
  const bool can_mma = info.major >= 8;
  KernelPath run = can_wgmma ? KernelPath::kWgmma : can_mma ? KernelPath::kMmaSync : KernelPath::kSimt;
  if (path == KernelPath::kSimt || (path == KernelPath::kMmaSync && can_mma) ||
      (path == KernelPath::kWgmma && can_wgmma)) {
    run = path;
  }
  switch (run) {
    case KernelPath::kWgmma: {
      if (LaunchPlan plan; PlanBand(p, info, plan)) return plan;
      if (LaunchPlan plan; PlanResident(p, info, plan)) return plan;
      return PlanPersistent(p, info);
    }
    case KernelPath::kMmaSync:
      if (UsesDenseTaps(p)) return PlanDenseTaps(p, info);
      // wide tiles where N needs them and the device's shared memory takes them
      if (p.n > MmaSyncNarrow::kCols && info.smem_optin >= ClassicSmemBytes<MmaSyncWide>()) {
        return PlanClassic<MmaSyncWide>(p, aligned, run);
      }
      return PlanClassic<MmaSyncNarrow>(p, aligned, run);
    default:
      return PlanClassic<SimtEngine>(p, aligned, run);
  }
}

// Raises a kernel's dynamic shared-memory limit to `smem` once per device and kernel (cudaFuncSetAttribute
// on every launch was part of the launcher's host time); the limit only grows, so every cached plan of the
// kernel stays within it.
cudaError_t AllowSharedMemory(int device, const void* kernel, int smem) {
  struct Allowed {
    int device;
    const void* kernel;
    int smem;
  };
  static std::mutex mutex;
  static std::vector<Allowed> allowed;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = std::find_if(allowed.begin(), allowed.end(),
                         [&](const Allowed& a) { return a.device == device && a.kernel == kernel; });
  if (it != allowed.end() && it->smem >= smem) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  if (it != allowed.end()) {
    it->smem = smem;
  } else {
    allowed.push_back({device, kernel, smem});
  }
  return cudaSuccess;
}

cudaError_t Launch(LaunchPlan& plan, cudaStream_t stream) {
  if (plan.ctas == 0) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(plan.ctas);
  config.blockDim = dim3(plan.threads);
  config.dynamicSmemBytes = plan.smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  config.attrs = attrs;
  if (plan.cluster > 1) {
    attrs[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attrs[config.numAttrs].val.clusterDim.x = plan.cluster;
    attrs[config.numAttrs].val.clusterDim.y = 1;
    attrs[config.numAttrs].val.clusterDim.z = 1;
    ++config.numAttrs;
  }
  // a programmatic dependent launch: it may start while the stream's previous kernel finishes (its
  // `griddepcontrol.wait` keeps its global accesses after that kernel's), and the next kernel may start at
  // its `griddepcontrol.launch_dependents`
  if (plan.programmatic) {
    attrs[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[config.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++config.numAttrs;
  }
  // the kernels' parameters, in their order
  void* classic[] = {&plan.p, &plan.div, &plan.m_tiles, &plan.n_tiles};
  void* persistent[] = {&plan.p, &plan.a_map, &plan.w_map, &plan.weights_by_tma, &plan.div,
                        &plan.m_pairs, &plan.n_tiles, &plan.runs};
  void* resident[] = {&plan.p, &plan.a_map, &plan.w_map, &plan.div, &plan.m_tiles, &plan.ctas_per_column};
  void* band[] = {&plan.p, &plan.a_map, &plan.band};
  void* dense_taps[] = {&plan.p, &plan.m_tiles, &plan.ctas_per_column};
  void** args = plan.kind == LaunchPlan::Kind::kClassic      ? classic
                : plan.kind == LaunchPlan::Kind::kPersistent ? persistent
                : plan.kind == LaunchPlan::Kind::kResident   ? resident
                : plan.kind == LaunchPlan::Kind::kDenseTaps  ? dense_taps
                                                             : band;
  const cudaError_t err = cudaLaunchKernelExC(&config, plan.kernel, args);
  return err == cudaSuccess ? cudaGetLastError() : err;
}

// The plans of the latest problem shapes, most recent first. The key is everything a plan depends on: the
// device, the engine asked for, the problem without its addresses, and the operands' alignment (it picks
// kernels).
class PlanCache {
 public:
  // The plan for `p`, pointed at its operands: from the cache, else planned (and cached).
  LaunchPlan Get(const BinaryGemmProblem& p, KernelPath path, int device, const DeviceInfo& info) {
    const Key key = KeyOf(p, path, device);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < entries_.size(); ++i) {
        if (entries_[i].key != key) continue;
        LaunchPlan plan = entries_[i].plan;
        if (!Repoint(plan, p)) {  // a map the new address does not take: plan afresh
          entries_.erase(entries_.begin() + i);
          break;
        }
        entries_[i].plan = plan;       // keeps the maps of the latest addresses (replays with the same buffers)
        std::rotate(entries_.begin(), entries_.begin() + i, entries_.begin() + i + 1);
        return plan;
      }
    }
    LaunchPlan plan = Plan(p, path, info);
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.insert(entries_.begin(), Entry{key, plan});
    if (entries_.size() > kEntries) entries_.pop_back();
    return plan;
  }

 private:
  static constexpr size_t kEntries = 64;
  using Key = std::array<int64_t, 27>;
  struct Entry {
    Key key;
    LaunchPlan plan;
  };
  // (max_excess, compact_classes, class_numbering and the tables' flags are Plan's, derived from the key's fields)
  static_assert(sizeof(BinaryGemmProblem) == 208, "a field was added to BinaryGemmProblem: add it to KeyOf");
  static Key KeyOf(const BinaryGemmProblem& p, KernelPath path, int device) {
    const auto x = reinterpret_cast<uintptr_t>(p.x), w = reinterpret_cast<uintptr_t>(p.w);
    return {device, static_cast<int>(path), static_cast<int64_t>(x % 16), static_cast<int64_t>(w % 16),
            p.batch, p.in_h, p.in_w, p.cw, p.c, p.kh, p.kw, p.stride_h, p.stride_w, p.pad_top, p.pad_left,
            p.pad_one, p.pool_h, p.pool_w, p.out_h, p.out_w, p.n, p.w_row_tiles, p.w_k_tiles, p.k_words,
            p.k_real, p.pooled_rows, static_cast<int>(p.epilogue)};
  }
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

}  // namespace

#ifdef JAXBNN_TILE_TRACE
cudaError_t SetTileTrace(unsigned long long* buffer) {
  return cudaMemcpyToSymbol(g_tile_trace, &buffer, sizeof(buffer));
}
#endif

cudaError_t LaunchBinaryGemm(const BinaryGemmProblem& problem, KernelPath path, cudaStream_t stream,
                             KernelPath* chosen) {
  // every kernel needs a K block: the wgmma consumers fill the column parameters inside their k loop
  if (problem.k_words < 1 || problem.k_words > kMaxReductionWords) return cudaErrorInvalidValue;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static DeviceInfo infos[64];
  static cudaError_t query_errors[64];
  static std::once_flag queried[64];
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  std::call_once(queried[device], [&] { query_errors[device] = QueryDevice(device, infos[device]); });
  if ((err = query_errors[device]) != cudaSuccess) return err;
  static PlanCache cache;
  LaunchPlan plan = cache.Get(problem, path, device, infos[device]);
  if (chosen != nullptr) *chosen = plan.path;
  if ((err = AllowSharedMemory(device, plan.kernel, plan.smem)) != cudaSuccess) return err;
  return Launch(plan, stream);
}

}  // namespace jaxbnn::cuda

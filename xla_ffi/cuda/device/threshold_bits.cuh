// The threshold epilogue's bit arithmetic: paired bounds, and the bits of an accumulator thread's values.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

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
// paired_delta (the second threshold plane, else null): TileColumns::second_paired_delta from the pair of the
// first column on, subtracted from each pair of bounds.
__device__ __forceinline__ uint32_t ThresholdBitsPaired(const int (&a)[4][2], int v0, const int* bounds,
                                                        const uint32_t* paired_delta = nullptr) {
  const uint32_t v0_pair = static_cast<uint32_t>(v0) * 0x10001u;
  uint32_t y[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t bound = static_cast<uint32_t>(bounds[8 * j]);
    if (paired_delta != nullptr) bound -= paired_delta[4 * j];
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
// epilogue, 5.7 with a compare, a select and an OR per value instead (ncu). The values go in
// from the highest position down, even columns by 1 bit (their sign), odd ones by 7 (bits 25-31: the sign
// and, where |difference| < 2^25 (ColumnBound), six copies of it that fill the gap to the next pair).
// delta (the second threshold plane, else null): TileColumns::second_delta from the first column on, added to
// the bounds.
__device__ __forceinline__ uint32_t ThresholdBitsUnpaired(const int (&a)[4][2], int v0, const int* bounds,
                                                          const int* delta = nullptr) {
  uint32_t below = 0;
#pragma unroll
  for (int j = 3; j >= 0; --j) {
    int2 bound = *reinterpret_cast<const int2*>(&bounds[8 * j]);
    if (delta != nullptr) {
      const int2 d = *reinterpret_cast<const int2*>(&delta[8 * j]);
      bound.x += d.x;
      bound.y += d.y;
    }
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

// A border row's bounds of columns lc, lc + 1 in the form ThresholdBitsPaired / Unpaired read.
__device__ __forceinline__ void StoreRowBounds(const BinaryGemmProblem& p, int* row_bounds, int lc, int bound0, int bound1) {
  if (PairsBounds(p)) {
    row_bounds[lc] = static_cast<int>(PairedBounds(p, bound0, bound1));
  } else {
    row_bounds[lc] = bound0;
    row_bounds[lc + 1] = bound1;
  }
}

}  // namespace jaxbnn::cuda

// Problem geometry: where a tile row's receptive field starts, how far it leaves the frame, and the border
// classes of "zero" padding with the tables that the launcher chooses for them.
#pragma once

#include "cuda/binary_gemm.h"
#include "cuda/device/common.cuh"

namespace jaxbnn::cuda {

// The origin of output pixel (b, oh, ow) (conv output, before any pool), as RowOrigin returns it.
__device__ __forceinline__ int4 FieldOrigin(const BinaryGemmProblem& p, int b, int oh, int ow) {
  const int ih0 = oh * p.stride_h - p.pad_top, iw0 = ow * p.stride_w - p.pad_left;
  return make_int4(((b * p.in_h + ih0) * p.in_w + iw0) * p.x_cw, ih0, iw0, 1);
}

// Per tile row: where its output pixel's receptive field starts. x: stored word offset of tap (0, 0)
// (may point outside the image at borders), y/z: input row/column of tap (0, 0), w: 1 if the row is real.
__device__ __forceinline__ int4 RowOrigin(const BinaryGemmProblem& p, int tile_m, int rows_per_tile, int r) {
  const int window = p.pool_h * p.pool_w;
  const int pooled_per_tile = rows_per_tile / window;
  const int4 none = make_int4(0, 0, 0, 0);
  if (r >= pooled_per_tile * window) return none;
  const long long pooled = static_cast<long long>(tile_m) * pooled_per_tile + r / window;
  if (pooled >= p.pooled_rows) return none;
  const int e = r % window;
  const int pix = static_cast<int>(pooled);
  const int owp = pix % p.out_w, rest = pix / p.out_w;
  const int ohp = rest % p.out_h, b = rest / p.out_h;
  const int oh = ohp * p.pool_h + e / p.pool_w, ow = owp * p.pool_w + e % p.pool_w;
  return FieldOrigin(p, b, oh, ow);
}

// A tile row's place in its pool window, the same in every tile of `rows_per_tile` rows: a kernel whose thread
// keeps row r over all its tiles derives it once, and RowOrigin below takes the rest of RowOrigin's work.
struct WindowRow {
  int pooled;  // the row's pooled pixel within the tile
  int dh, dw;  // its output pixel's offset in the pool window
  bool real;   // false: past the tile's last whole window
};
__device__ __forceinline__ WindowRow WindowRowOf(const BinaryGemmProblem& p, int rows_per_tile, int r) {
  const int window = p.pool_h * p.pool_w, e = r % window;
  return {r / window, e / p.pool_w, e % p.pool_w, r < rows_per_tile / window * window};
}
// RowOrigin of a WindowRow in tile `tile_m`, with the launch's divisors of the (pooled) output for the pixel's
// image, row and column: the same int4 as RowOrigin.
__device__ __forceinline__ int4 RowOrigin(const BinaryGemmProblem& p, const LaunchDivisors& div, const WindowRow& row,
                                          int tile_m, int pooled_per_tile) {
  const int4 none = make_int4(0, 0, 0, 0);
  if (!row.real) return none;
  const long long pooled = static_cast<long long>(tile_m) * pooled_per_tile + row.pooled;
  if (pooled >= p.pooled_rows) return none;
  const int pix = static_cast<int>(pooled);
  const int b = Quotient(pix, div.image_pixels), in_image = pix - b * div.image_pixels.divisor;
  const int ohp = Quotient(in_image, div.out_w), owp = in_image - ohp * div.out_w.divisor;
  const int oh = ohp * p.pool_h + row.dh, ow = owp * p.pool_w + row.dw;
  return FieldOrigin(p, b, oh, ow);
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
inline FrameExcess MaxExcessOf(const BinaryGemmProblem& p) {
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
inline bool UsesCompactClasses(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  return !p.pad_one && (m.top + 1) * (m.bottom + 1) * (m.left + 1) * (m.right + 1) > kTableClasses &&
         p.kh <= p.in_h && p.kw <= p.in_w;
}
// Whether the tiles of `p` keep the per-class correction table (the launcher's
// BinaryGemmProblem::correction_table).
inline bool KeepsCorrectionTable(const BinaryGemmProblem& p) {
  const bool table_filter = (p.kh <= kTableSide && p.kw <= kTableSide) || (p.kh == kExactTableSide && p.kw == kExactTableSide);
  return !p.pad_one && table_filter && BorderClasses(p) <= kTableClasses;
}
// The launcher's BinaryGemmProblem::class_numbering: compact classes are (vertical class: top t is t, bottom b
// is top_max + b) x horizontal classes + horizontal class.
inline ClassNumbering ClassNumberingOf(const BinaryGemmProblem& p) {
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
// padding, its 11x11 conv1 15x.
__host__ __device__ __forceinline__ int EdgeRows(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  return m.top + m.bottom + m.left + m.right;
}
inline bool KeepsEdgeTable(const BinaryGemmProblem& p) {
  return !p.pad_one && !p.correction_table && p.kh <= p.in_h && p.kw <= p.in_w && EdgeRows(p) < kTableClasses;
}
// Whether the edge table also holds the corner blocks (after the strips: (top + bottom) x (left + right)
// of them, 16 at 5x5 with padding 2); where not (7x7 with padding 3), a corner field sums its taps.
inline bool KeepsEdgeCorners(const BinaryGemmProblem& p) {
  const FrameExcess m = p.max_excess;
  return p.edge_table && EdgeRows(p) + (m.top + m.bottom) * (m.left + m.right) < kTableClasses;
}

// For the epilogues straight from accumulators: whether the row at `origin` (RowOrigin) needs the
// "zero"-padding correction (an output pixel whose receptive field leaves the frame).
__device__ __forceinline__ bool BorderRow(const BinaryGemmProblem& p, const int4& origin) {
  if (p.pad_one) return false;
  return origin.w && !(origin.y >= 0 && origin.y + p.kh <= p.in_h && origin.z >= 0 && origin.z + p.kw <= p.in_w);
}

}  // namespace jaxbnn::cuda

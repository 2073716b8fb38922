// Border corrections of "zero" padding: the per-class and edge tables of a column tile, and the excluded
// taps of a border row.
#pragma once

#include <cstdint>

#include "cuda/binary_gemm.h"
#include "cuda/device/geometry.cuh"
#include "cuda/device/threshold_bits.cuh"
#include "cuda/device/tile_columns.cuh"

namespace jaxbnn::cuda {

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
// about four times the instructions (ncu: 516 a warp for a 3x3 filter in the band kernel,
// where all 16 warps fill the table before the first tile). Depends on the column tile only. `parts`
// threads may share a column: part `part` fills every parts-th (left, right) excess pair's classes (the
// band kernel's four warpgroups: its "zero"-padding set-up 4.0 -> 3.5 us). add_bounds: the
// column's ColumnBound (from `th`) is added to every class (AddBoundsToClasses' work, done by a thread that
// knows the bound without waiting for another's); with_popcount instead: the column's 2 popc(b), so that a class's
// entry is all the narrow residual epilogue subtracts from 4 acc + k_real - 2 popc(a) (class 0: 2 popc(b)). kSideExcess > 0: no side's excess is larger, and the
// class loops run to it unrolled (their runtime form was 297 instructions a warp of the band kernel's 3x3
// "zero" set-up, much of it loop control: ncu). Returns the column's popc(b), summed over taps.
template <int kCols, int kSide, int kSideExcess>
__device__ __forceinline__ int FillCorrectionTableOf(const BinaryGemmProblem& p, TileColumns<kCols>& cols, int col0,
                                                     int lc, int part, int parts, bool add_bounds,
                                                     ColumnThreshold th, bool with_popcount) {
  static_assert(kSide <= kTableSide, "the table's filters");
  static_assert(kSideExcess == 0 || kSide < kTableSide, "unrolled classes of an exact filter size only");
  constexpr bool kExact = kSide < kTableSide;
  const int col = col0 + lc, kh = kExact ? kSide : p.kh, kw = kExact ? kSide : p.kw;
  int term[kSide][kSide];
  int whole = 0, total = 0;
  LoadTapTerms(p, col, kh, kw, kExact, term, whole, total);
  const int bound = add_bounds ? ColumnBound(p, col, th.threshold, th.flip, total) : with_popcount ? 2 * total : 0;
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
// terms took 27% of AlexNet's conv2 stall samples on wgmma, every CTA filling it before its first tile (ncu).
template <int kCols>
__device__ __forceinline__ int FillCorrectionTableByClass(const BinaryGemmProblem& p, TileColumns<kCols>& cols,
                                                          int col0, int lc, int part, int parts, bool add_bounds,
                                                          ColumnThreshold th, bool with_popcount) {
  constexpr int kSide = kExactTableSide;
  const int col = col0 + lc;
  int term[kSide][kSide];
  int whole = 0, total = 0;
  LoadTapTerms(p, col, p.kh, p.kw, false, term, whole, total);
  const int bound = add_bounds ? ColumnBound(p, col, th.threshold, th.flip, total) : with_popcount ? 2 * total : 0;
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
                                                   ColumnThreshold th = {}, bool with_popcount = false) {
  if (p.compact_classes || p.kh > kTableSide || p.kw > kTableSide) {  // 5x5 filters, paddings past 1 at 3x3
    return FillCorrectionTableByClass<kCols>(p, cols, col0, lc, part, parts, add_bounds, th, with_popcount);
  }
  if (p.kh == 3 && p.kw == 3) {
    const FrameExcess m = p.max_excess;
    if (max(max(m.top, m.bottom), max(m.left, m.right)) <= 1) {  // padding of at most 1: 16 classes or fewer
      return FillCorrectionTableOf<kCols, 3, 1>(p, cols, col0, lc, part, parts, add_bounds, th, with_popcount);
    }
    return FillCorrectionTableOf<kCols, 3, 0>(p, cols, col0, lc, part, parts, add_bounds, th, with_popcount);
  }
  return FillCorrectionTableOf<kCols, kTableSide, 0>(p, cols, col0, lc, part, parts, add_bounds, th, with_popcount);
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

}  // namespace jaxbnn::cuda

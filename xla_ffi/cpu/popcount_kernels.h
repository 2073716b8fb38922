// The innermost CPU kernels, in several instruction-set tiers chosen at run time, so one binary runs on any
// x86-64 (or other CPU): ±1 dot products, from popcounts of (x XOR w) AND mask, between a packed panel of
// reduction rows and a run of 8-row FSB tile rows; and the epilogue of a strip of those dot products.
#ifndef JAXBNN_XLA_FFI_CPU_POPCOUNT_KERNELS_H_
#define JAXBNN_XLA_FFI_CPU_POPCOUNT_KERNELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/epilogue.h"

namespace jaxbnn::cpu {

// Rows per group of a packed panel: the kernels' register block.
inline constexpr int64_t kGroupRows = 8;

// Reduction rows packed group by group, each group chunk-major, so that a kernel walks one pointer:
// word w (0..3) of 128-bit chunk j of row r is data[((r / 8 * chunks + j) * 8 + r % 8) * 4 + w].
// Bits that are not part of the reduction (padding bits, words past the row) must be 0 in the panel; the
// weights may hold anything there, so where the reduction does not fill whole chunks the kernels AND the
// weights with `weight_mask` (one row of chunks * 4 words).
struct PackedPanel {
  const uint32_t* data;
  int64_t rows;
  int64_t chunks;
  const int32_t* k_valid;       // per row: the reduction elements that count
  const uint32_t* weight_mask;  // null when every bit of every chunk counts
};

// For every panel row r < rows, tile row t < tiles and row i < 8 of that tile row:
//   dots[r * stride + t * 8 + i] = k_valid[r] - 2 * sum over chunks j of popc((x[r, j] XOR w[t, i, j]) AND mask[j])
// where tile row t is the (chunks, 8, 4) words at tile_rows + t * chunks * 32 (default FSB tiles).
using PanelDotsFn = void (*)(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles, int32_t* dots,
                             int64_t stride);

// Lane kernels, for short reductions and a convolution's long ones (bit_kernels.cc): the weights of a tile row as
// (k_words, 2, 8) words, word k of its 8 columns side by side as its low nibbles, then as its high nibbles (each
// nibble in the low half of its byte), every bit outside the reduction 0 (gemm_driver.h, LaneTiles); each word of a
// reduction row is split into its nibbles once and broadcast against them, so that a byte's count of differing bits
// is two table lookups of XORed nibbles. The rows are read where they lie: word k of row r is base[r][offsets[r][k]]
// (a receptive field straight from the image, or a row gathered into scratch), with every bit of it counting. A
// lane kernel finishes the rows itself: it adds each row's correction (the "zero" padding terms of its excluded
// taps) and max-pools each run of `window` rows into one output row.
struct LaneRows {
  const uint32_t* const* base;
  const int64_t* const* offsets;
  int64_t rows;                          // a multiple of window
  int64_t window;                        // rows pooled into one output row
  const int32_t* k_valid;                // per row: the reduction elements that count
  const int32_t* const* correction;      // per row: null, or the row of n int32 added to its dots; null: none
};

// For every output row o < rows / window, tile row t < tiles and row i < 8, with c = col_begin + t * 8 + i:
//   dots[o * stride + t * 8 + i] = max over r in [o * window, (o + 1) * window) of
//       k_valid[r] - 2 * sum over words k of popc(x[r, k] XOR w[t, k, i]) + correction[r][c]
// where w[t, k, i] = lanes[t, k, 0, i] | lanes[t, k, 1, i] << 4, tile row t the (k_words, 2, 8) words at
// lane_tiles + t * k_words * 16.
using LaneDotsFn = void (*)(const LaneRows& rows, const uint32_t* lane_tiles, int64_t k_words, int64_t col_begin,
                            int64_t tiles, int32_t* dots, int64_t stride);

// A lane kernel sums the counts of this many words at most in byte lanes, a longer reduction in runs of it.
inline constexpr int64_t kLaneByteWords = 31;
// A lane tile row's word: its low nibbles' word, then its high nibbles'.
inline constexpr int64_t kLaneWordNibbles = 2;
inline constexpr uint32_t kLowNibbles = 0x0f0f0f0fu;

// Table kernels (AVX2), for bmm's many-row products: each nibble of a reduction row becomes a table of 16 bytes,
// entry i the count of bits where the nibble and i differ (RowTablesFn); the weights are regrouped per call into
// groups of 32 columns, nibble j of every column of a group side by side as bytes (ColumnNibblesFn), so
// that one table lookup (pshufb) counts nibble j of 32 columns and one byte add sums it: per 128 products a lookup
// and an add, where the lane kernel spends two of each and two XORs per 256. Nibble j of a row is bits 4j .. 4j + 3
// of its bit string, every bit outside the reduction 0 in the row and in the weights.
struct TableRows {
  const uint8_t* tables;   // row r's table of nibble j at tables + (r * nibbles + j) * 16
  int64_t rows;
  const int32_t* k_valid;  // per row: the reduction elements that count
};

// The tables of one row of k_words words (its last word ANDed with last_mask first) into `tables`
// (k_words * 8 * 16 bytes).
using RowTablesFn = void (*)(const uint32_t* row, int64_t k_words, uint32_t last_mask, uint8_t* tables);

// For every row r < rows.rows, tile row t < tiles and row i < 8, with c = col_begin + t * 8 + i (col_begin a multiple
// of 32):
//   dots[r * stride + t * 8 + i] = k_valid[r] - 2 * sum over nibbles j of popc(x[r, j] XOR w[c, j])
// where w[c, j] = column_nibbles[((c / 32) * nibbles + j) * 32 + c % 32]; the counts are summed in 16-bit lanes, so
// nibbles * 4 must stay below 65536 (kTableMaxNibbles).
using TableDotsFn = void (*)(const TableRows& rows, const uint8_t* column_nibbles, int64_t nibbles, int64_t col_begin,
                             int64_t tiles, int32_t* dots, int64_t stride);

// Groups [first_group, end_group) of the column nibbles TableDotsFn reads, from the kernels' tiles of n output columns
// (gemm_driver.h, KernelTiles) over k_words words, into `column_nibbles` (the whole (ceil(n / 32), k_words * 8, 32)
// array): the last word ANDed with last_mask; the nibbles of columns past n are unspecified (their dots are never read).
using ColumnNibblesFn = void (*)(const uint32_t* kernel_tiles, int64_t n, int64_t k_words, uint32_t last_mask,
                                 int64_t first_group, int64_t end_group, uint8_t* column_nibbles);

// A tier's table kernel and what it reads, or all null.
struct TableTier {
  TableDotsFn dots = nullptr;
  RowTablesFn row_tables = nullptr;
  ColumnNibblesFn column_nibbles = nullptr;
};

inline constexpr int64_t kTableGroupCols = 32;
inline constexpr int64_t kTableMaxNibbles = 65535 / 4;

// Columns of a strip: the dot products of a panel for this many columns at most, small enough to stay in L1
// until the epilogue reads them; a multiple of 32, so that a strip owns its packed output words.
inline constexpr int64_t kStripCols = 128;

// Dot products of `outputs * window` panel rows (row r at dots + r * stride) for output columns
// [col_begin, col_begin + width), col_begin a multiple of 32 and width <= kStripCols. Each run of `window`
// rows is max-pooled into output row first_output + o, then written with the epilogue into `out`, the
// call's output: int32 or float32 (rows, n), float(dot) * scale + bias (two roundings), or the epilogue's
// planes of packed threshold bits (rows, planes, ceil(n/32)) (dot >= threshold, dot <= threshold where
// flip != 0; padding bits past n are 0).
struct Strip {
  const int32_t* dots;
  int64_t stride, outputs, window, first_output, col_begin, width, n;
  void* out;
};

using FinishStripFn = void (*)(const Strip& strip, const EpilogueData& epilogue);

// dots[i] += factor * (rows[0][i] + ... + rows[count - 1][i]) for i < width: the "zero" padding correction
// of a conv panel row's excluded taps (gemm_driver.h), factor 2 for the binary products (the taps' weight
// popcounts, doubled), 1 for BTN (the taps' weight sums).
using AddRowsFn = void (*)(int32_t* dots, const int32_t* const* rows, int64_t count, int64_t width);

enum class Isa { kGeneric, kPopcnt, kAvx2, kAvx512 };

const char* IsaName(Isa isa);
// Tiers this CPU can run, best first (kGeneric is always last).
std::vector<Isa> SupportedIsas();
// The tier used by the handlers: the best supported one unless a test forced another.
Isa ActiveIsa();
// Returns false (and changes nothing) when `name` is not a supported tier.
bool ForceIsa(const std::string& name);
PanelDotsFn PanelDotsFor(Isa isa);
// Null where the tier has none (the AVX-512 panel kernel already keeps one column per 64-bit lane).
LaneDotsFn LaneDotsFor(Isa isa);
// All null where the tier has no table kernel (every tier but AVX2: AVX-512 counts 512 bits a VPOPCNTQ).
TableTier TableTierFor(Isa isa);
FinishStripFn FinishStripFor(Isa isa);
// factor: 1 or 2.
AddRowsFn AddRowsFor(Isa isa, int factor);

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_POPCOUNT_KERNELS_H_

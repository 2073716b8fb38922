// Instruction-set tiers of the panel dot-product kernel (panel_words.h: how a tier is compiled); the tier is
// picked with __builtin_cpu_supports.
#include "cpu/popcount_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "cpu/panel_words.h"

namespace jaxbnn::cpu {
namespace {

using namespace panel_words;

constexpr int kGroupChunkWords = kGroupRows * kChunkWords;  // one chunk of every row of a panel group

// Chunk 0 of panel row r; chunk j follows at + j * kGroupChunkWords.
inline const uint32_t* PanelRow(const PackedPanel& panel, int64_t r) {
  return panel.data + ((r / kGroupRows) * panel.chunks * kGroupRows + r % kGroupRows) * kChunkWords;
}

// Scalar tiers: the same code with and without the popcnt instruction.
#define JAXBNN_SCALAR_PANEL(NAME, ATTR)                                                                   \
  template <bool kMask>                                                                                   \
  ATTR void NAME##Masked(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles,              \
                         int32_t* dots, int64_t stride) {                                            \
    const int64_t chunks = panel.chunks;                                                                  \
    for (int64_t r = 0; r < panel.rows; ++r) {                                                            \
      const uint32_t* x = PanelRow(panel, r);                                                             \
      for (int64_t t = 0; t < tiles; ++t) {                                                               \
        const uint32_t* tile_row = tile_rows + t * chunks * kTileChunkWords;                              \
        for (int i = 0; i < kTileRows; ++i) {                                                             \
          uint64_t acc = 0;                                                                               \
          for (int64_t j = 0; j < chunks; ++j) {                                                          \
            const uint32_t* xj = x + j * kGroupChunkWords;                                                \
            const uint32_t* w = tile_row + j * kTileChunkWords + i * kChunkWords;                         \
            uint64_t m0 = ~uint64_t{0}, m1 = ~uint64_t{0};                                                \
            if constexpr (kMask) {                                                                        \
              m0 = Load64(panel.weight_mask + j * kChunkWords);                                           \
              m1 = Load64(panel.weight_mask + j * kChunkWords + 2);                                       \
            }                                                                                             \
            acc += __builtin_popcountll((Load64(xj) ^ Load64(w)) & m0) +                                  \
                   __builtin_popcountll((Load64(xj + 2) ^ Load64(w + 2)) & m1);                           \
          }                                                                                               \
          dots[r * stride + t * kTileRows + i] = panel.k_valid[r] - 2 * static_cast<int32_t>(acc);        \
        }                                                                                                 \
      }                                                                                                   \
    }                                                                                                     \
  }                                                                                                       \
  ATTR void NAME(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles, int32_t* dots,  \
                 int64_t stride) {                                                                        \
    if (panel.weight_mask != nullptr) {                                                                   \
      NAME##Masked<true>(panel, tile_rows, tiles, dots, stride);                                     \
    } else {                                                                                              \
      NAME##Masked<false>(panel, tile_rows, tiles, dots, stride);                                    \
    }                                                                                                     \
  }

JAXBNN_SCALAR_PANEL(PanelGeneric, )
#ifdef JAXBNN_X86
JAXBNN_SCALAR_PANEL(PanelPopcnt, JAXBNN_TARGET_POPCNT)
#endif
#undef JAXBNN_SCALAR_PANEL

#ifdef JAXBNN_X86

// How the vector kernels apply the weight mask: not at all (every bit counts), on every chunk, or on the last
// chunk only (the reduction fills whole words of whole 32-bit runs, and only its last chunk has padding
// words), then with both of that chunk's 64-bit halves or, where the second is all padding, with the first.
enum AvxMask { kNoMask, kEveryChunk, kLastHalf, kLastChunk };

// Which AvxMask a panel's weight mask needs.
AvxMask MaskUseOf(const PackedPanel& panel) {
  if (panel.weight_mask == nullptr) return kNoMask;
  const uint32_t* last = panel.weight_mask + (panel.chunks - 1) * kChunkWords;
  for (const uint32_t* word = panel.weight_mask; word < last; ++word) {
    if (*word != ~0u) return kEveryChunk;
  }
  return last[2] == 0 && last[3] == 0 ? kLastHalf : kLastChunk;
}

// AVX2: a tile chunk is four 256-bit registers (tile rows 2q, 2q+1 in register q); a panel chunk is
// broadcast to both 128-bit lanes. Bytes are counted (ByteCountsAvx2) and summed in byte lanes over up to
// kAvx2PairedChunks chunks, folded into two registers (PairColumnBytesAvx2), then into 64-bit lanes with
// psadbw. The weight mask is applied only to the chunks that have padding (MaskUseOf).

// Adds chunk j of panel row x against a tile row's chunk to the byte counts of its four registers.
template <bool kMasked>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void AddChunkAvx2(const uint32_t* x, const uint32_t* tile_row,
                                                                            const uint32_t* mask, int64_t j,
                                                                            __m256i (&bytes)[4]) {
  const uint32_t* w = tile_row + j * kTileChunkWords;
  const __m256i xj =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j * kGroupChunkWords)));
  [[maybe_unused]] __m256i mj;
  if constexpr (kMasked) {
    mj = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mask + j * kChunkWords)));
  }
  for (int q = 0; q < 4; ++q) {
    __m256i bits = _mm256_xor_si256(xj, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * q)));
    if constexpr (kMasked) bits = _mm256_and_si256(bits, mj);
    bytes[q] = _mm256_add_epi8(bytes[q], ByteCountsAvx2(bits));
  }
}

// The first 64 bits of each row of the last chunk of every tile row, masked, in the column order of
// PairColumnBytesAvx2: (tiles, [c0, c2, c1, c3, c4, c6, c5, c7], 2 words). Where the rest of the last chunk is
// padding (kLastHalf: 3x3 at C = 32 and 64), a tile row's two registers of them take the chunk's byte counts
// into its folded bytes instead of four registers of the whole chunk.
JAXBNN_TARGET_AVX2 const uint32_t* LastHalvesAvx2(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles) {
  constexpr int kPairedColumn[kTileRows] = {0, 2, 1, 3, 4, 6, 5, 7};
  thread_local std::vector<uint32_t> halves;
  if (static_cast<int64_t>(halves.size()) < tiles * 2 * kTileRows) halves.resize(tiles * 2 * kTileRows);
  const int64_t last = panel.chunks - 1;
  const uint32_t* mask = panel.weight_mask + last * kChunkWords;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t* chunk = tile_rows + (t * panel.chunks + last) * kTileChunkWords;
    for (int i = 0; i < kTileRows; ++i) {
      const int column = kPairedColumn[i];
      halves[(t * kTileRows + i) * 2] = chunk[column * kChunkWords] & mask[0];
      halves[(t * kTileRows + i) * 2 + 1] = chunk[column * kChunkWords + 1] & mask[1];
    }
  }
  return halves.data();
}

// kMask: kNoMask, kEveryChunk, kLastHalf (LastHalvesAvx2) or kLastChunk (the last chunk alone masked).
template <AvxMask kMask>
JAXBNN_TARGET_AVX2 void PanelAvx2Masked(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles,
                                        int32_t* dots, int64_t stride) {
  const __m256i zero = _mm256_setzero_si256();
  const int64_t chunks = panel.chunks;
  // chunks summed as whole chunks (kLastHalf: all but the last), and of them those taken unmasked
  const int64_t counted = kMask == kLastHalf ? chunks - 1 : chunks;
  const int64_t unmasked = kMask == kLastChunk || kMask == kLastHalf ? chunks - 1 : chunks;
  [[maybe_unused]] const uint32_t* last_halves = nullptr;
  [[maybe_unused]] uint64_t last_mask = 0;
  if constexpr (kMask == kLastHalf) {
    last_halves = LastHalvesAvx2(panel, tile_rows, tiles);
    last_mask = Load64(panel.weight_mask + counted * kChunkWords);
  }
  for (int64_t r = 0; r < panel.rows; ++r) {
    const uint32_t* x = PanelRow(panel, r);
    [[maybe_unused]] __m256i x_last;
    if constexpr (kMask == kLastHalf) {
      x_last = _mm256_set1_epi64x(static_cast<long long>(Load64(x + counted * kGroupChunkWords) & last_mask));
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const uint32_t* tile_row = tile_rows + t * chunks * kTileChunkWords;
      __m256i low_total = zero, high_total = zero;
      int64_t j = 0;
      do {  // once at least: kLastHalf's half chunk alone when it is the only chunk
        const int64_t group_end = std::min(counted, j + kAvx2PairedChunks);
        __m256i bytes[4] = {zero, zero, zero, zero};
        for (; j < std::min(group_end, unmasked); ++j) {
          AddChunkAvx2<kMask == kEveryChunk>(x, tile_row, panel.weight_mask, j, bytes);
        }
        if (kMask == kLastChunk && j < group_end) AddChunkAvx2<true>(x, tile_row, panel.weight_mask, j++, bytes);
        __m256i low, high;
        PairColumnBytesAvx2(bytes, low, high);
        if constexpr (kMask == kLastHalf) {
          if (j == counted) {
            const __m256i* halves = reinterpret_cast<const __m256i*>(last_halves + t * 2 * kTileRows);
            low = _mm256_add_epi8(low, ByteCountsAvx2(_mm256_xor_si256(_mm256_loadu_si256(halves), x_last)));
            high = _mm256_add_epi8(high, ByteCountsAvx2(_mm256_xor_si256(_mm256_loadu_si256(halves + 1), x_last)));
          }
        }
        low_total = _mm256_add_epi64(low_total, _mm256_sad_epu8(low, zero));
        high_total = _mm256_add_epi64(high_total, _mm256_sad_epu8(high, zero));
      } while (j < counted);
      const __m256i popcounts = PairedColumnSumsAvx2(low_total, high_total);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + r * stride + t * kTileRows),
                          _mm256_sub_epi32(_mm256_set1_epi32(panel.k_valid[r]), _mm256_slli_epi32(popcounts, 1)));
    }
  }
}

JAXBNN_TARGET_AVX2 void PanelAvx2(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles,
                                  int32_t* dots, int64_t stride) {
  switch (MaskUseOf(panel)) {
    case kNoMask: return PanelAvx2Masked<kNoMask>(panel, tile_rows, tiles, dots, stride);
    case kEveryChunk: return PanelAvx2Masked<kEveryChunk>(panel, tile_rows, tiles, dots, stride);
    case kLastHalf: return PanelAvx2Masked<kLastHalf>(panel, tile_rows, tiles, dots, stride);
    case kLastChunk: return PanelAvx2Masked<kLastChunk>(panel, tile_rows, tiles, dots, stride);
  }
}

// AVX2 lane kernel: one row against kTiles tile rows at once. Each word of the row is split into its nibbles and
// broadcast to the 8 columns' nibbles of a tile row (LaneTiles); a byte's differing bits are then two lookups of
// XORed nibbles (pshufb), without ByteCountsAvx2's mask and shift per tile row. The counts are summed in byte lanes
// over up to kLaneByteWords words (31 * 8 = 248 cannot wrap), then each column's 4 bytes into its 32-bit lane
// (vpmaddubsw, vpmaddwd with ones), already in column order. On a 3 x 3 reduction at C = 32 (9 words) the chunked
// panel kernel computes 12 words, the last chunk's padding, and regroups its columns for every tile row
// (decisions.md).
static_assert(kLaneByteWords * 8 <= 255, "byte lanes must not wrap");

// The byte counts of words [begin, end) of one row against kTiles tile rows, added to `bytes`.
template <int kTiles>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void AddLaneWordsAvx2(const uint32_t* base,
                                                                                const int64_t* offsets,
                                                                                const uint32_t* lanes, int64_t k_words,
                                                                                int64_t begin, int64_t end,
                                                                                __m256i (&bytes)[kTiles]) {
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1,
                                         2, 2, 3, 2, 3, 3, 4);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  for (int64_t k = begin; k < end; ++k) {
    const __m256i xk = _mm256_set1_epi32(static_cast<int>(base[offsets[k]]));
    const __m256i x_low = _mm256_and_si256(xk, low_nibbles);
    const __m256i x_high = _mm256_and_si256(_mm256_srli_epi16(xk, 4), low_nibbles);
#pragma GCC unroll 8
    for (int u = 0; u < kTiles; ++u) {
      const __m256i* w = reinterpret_cast<const __m256i*>(lanes + (u * k_words + k) * kLaneWordNibbles * kTileRows);
      bytes[u] = _mm256_add_epi8(bytes[u],
                                 _mm256_shuffle_epi8(table, _mm256_xor_si256(x_low, _mm256_loadu_si256(w))));
      bytes[u] = _mm256_add_epi8(bytes[u],
                                 _mm256_shuffle_epi8(table, _mm256_xor_si256(x_high, _mm256_loadu_si256(w + 1))));
    }
  }
}

// Each column's 4 byte counts as one 32-bit count.
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) __m256i ColumnCountsAvx2(__m256i bytes) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(bytes, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
}

// The counts of words [begin, end) of one row against kTiles tile rows, in 32-bit lanes in column order: byte counts
// folded into them after each run of kLaneByteWords words.
template <int kTiles>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void LaneCountsAvx2(const uint32_t* base,
                                                                              const int64_t* offsets,
                                                                              const uint32_t* lanes, int64_t k_words,
                                                                              int64_t begin, int64_t end,
                                                                              __m256i (&counts)[kTiles]) {
#pragma GCC unroll 8
  for (int u = 0; u < kTiles; ++u) counts[u] = _mm256_setzero_si256();
  for (int64_t run = begin; run < end; run += kLaneByteWords) {
    __m256i bytes[kTiles];
#pragma GCC unroll 8
    for (int u = 0; u < kTiles; ++u) bytes[u] = _mm256_setzero_si256();
    AddLaneWordsAvx2<kTiles>(base, offsets, lanes, k_words, run, std::min(end, run + kLaneByteWords), bytes);
#pragma GCC unroll 8
    for (int u = 0; u < kTiles; ++u) counts[u] = _mm256_add_epi32(counts[u], ColumnCountsAvx2(bytes[u]));
  }
}

// The dots of one row against kTiles tile rows from its counts, corrected (correction: at the first of their
// columns, or null).
template <int kTiles>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void LaneDotsAvx2(int32_t k_valid, const int32_t* correction,
                                                                            const __m256i (&counts)[kTiles],
                                                                            __m256i (&dots)[kTiles]) {
#pragma GCC unroll 8
  for (int u = 0; u < kTiles; ++u) {
    dots[u] = _mm256_sub_epi32(_mm256_set1_epi32(k_valid), _mm256_slli_epi32(counts[u], 1));
    if (correction != nullptr) {
      dots[u] = _mm256_add_epi32(
          dots[u], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(correction + u * kTileRows)));
    }
  }
}

// A reduction of more words than this is counted block by block (BlockedLaneRowsAvx2), so that 4 tile rows' words
// (16 KB) stay in L1 while a run of rows passes.
constexpr int64_t kLaneBlockWords = 2 * kLaneByteWords;

// kTiles tile rows of every output row: each window row's dots, their max stored. kLong: a reduction of more than
// kLaneByteWords words, its counts folded into 32-bit counts (the short form keeps no 32-bit counts in registers
// beside the bytes).
template <int kTiles, bool kLong>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void LaneOutputsAvx2(const LaneRows& rows,
                                                                               const uint32_t* lanes, int64_t k_words,
                                                                               int64_t col, int32_t* dots,
                                                                               int64_t stride) {
  const auto correction_of = [&](int64_t r) {
    return rows.correction == nullptr || rows.correction[r] == nullptr ? nullptr : rows.correction[r] + col;
  };
  const auto dots_of = [&](int64_t r, const __m256i (&counts)[kTiles], __m256i (&row)[kTiles])
                           JAXBNN_TARGET_AVX2 __attribute__((always_inline)) {
    LaneDotsAvx2<kTiles>(rows.k_valid[r], correction_of(r), counts, row);
  };
  if constexpr (kLong) {
    if (k_words > kLaneBlockWords) {
      const auto count = [&](int64_t r, int64_t begin, int64_t end, __m256i (&counts)[kTiles])
                             JAXBNN_TARGET_AVX2 __attribute__((always_inline)) {
        LaneCountsAvx2<kTiles>(rows.base[r], rows.offsets[r], lanes, k_words, begin, end, counts);
      };
      BlockedLaneRowsAvx2<kTiles>(rows.rows, rows.window, k_words, kLaneBlockWords, count, dots_of, dots, stride);
      return;
    }
  }
  const auto row_dots = [&](int64_t r, __m256i (&row)[kTiles]) JAXBNN_TARGET_AVX2 __attribute__((always_inline)) {
    __m256i counts[kTiles];
    if constexpr (kLong) {
      LaneCountsAvx2<kTiles>(rows.base[r], rows.offsets[r], lanes, k_words, 0, k_words, counts);
    } else {
      __m256i bytes[kTiles];
#pragma GCC unroll 8
      for (int u = 0; u < kTiles; ++u) bytes[u] = _mm256_setzero_si256();
      AddLaneWordsAvx2<kTiles>(rows.base[r], rows.offsets[r], lanes, k_words, 0, k_words, bytes);
#pragma GCC unroll 8
      for (int u = 0; u < kTiles; ++u) counts[u] = ColumnCountsAvx2(bytes[u]);
    }
    dots_of(r, counts, row);
  };
  PoolLaneRowsAvx2<kTiles>(rows.rows, rows.window, row_dots, dots, stride);
}

// kWidest tile rows a step, each over all output rows while its weights are hot in L1; then half as many, down to
// one.
template <int kWidest, bool kLong>
JAXBNN_TARGET_AVX2 void LaneStepsAvx2(const LaneRows& rows, const uint32_t* lane_tiles, int64_t k_words,
                                      int64_t col_begin, int64_t tiles, int32_t* dots, int64_t stride) {
  const int64_t tile_words = k_words * kLaneWordNibbles * kTileRows;
  int64_t t = 0;
  for (; t + kWidest <= tiles; t += kWidest) {
    LaneOutputsAvx2<kWidest, kLong>(rows, lane_tiles + t * tile_words, k_words, col_begin + t * kTileRows,
                                    dots + t * kTileRows, stride);
  }
  if constexpr (kWidest > 1) {
    if (t < tiles) {
      LaneStepsAvx2<kWidest / 2, kLong>(rows, lane_tiles + t * tile_words, k_words, col_begin + t * kTileRows,
                                        tiles - t, dots + t * kTileRows, stride);
    }
  }
}

// Short reductions eight tile rows a step (a row word's nibbles serve 64 columns); long ones four, their 32-bit
// counts beside the bytes in registers.
JAXBNN_TARGET_AVX2 void LaneAvx2(const LaneRows& rows, const uint32_t* lane_tiles, int64_t k_words, int64_t col_begin,
                                 int64_t tiles, int32_t* dots, int64_t stride) {
  if (k_words <= kLaneByteWords) {
    LaneStepsAvx2<8, false>(rows, lane_tiles, k_words, col_begin, tiles, dots, stride);
  } else {
    LaneStepsAvx2<4, true>(rows, lane_tiles, k_words, col_begin, tiles, dots, stride);
  }
}

// AVX2 table kernel (popcount_kernels.h, TableDotsFn): R rows' tables of a nibble against C groups of 32 columns'
// nibbles, each lookup a byte per column added in byte lanes over kTableRunNibbles nibbles (63 * 4 = 252 cannot
// wrap), then into 16-bit counts in column order. R = 4, C = 2: 8 accumulators, 4 tables, the 2 groups' nibbles.
constexpr int64_t kTableRunNibbles = 63;
constexpr int kTableRows = 4;

// 8-bit vectors as a vector type: GCC keeps `+=` on them in the accumulators' registers.
typedef char V32qi __attribute__((vector_size(32)));

template <int R, int C>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void TableBlockAvx2(const uint8_t* tables, int64_t nibbles,
                                                                              const uint8_t* groups,
                                                                              const int32_t* k_valid, int64_t tiles,
                                                                              int32_t* dots, int64_t stride) {
  alignas(32) uint16_t counts[R][C * kTableGroupCols] = {};
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t begin = 0; begin < nibbles; begin += kTableRunNibbles) {
    const int64_t end = std::min(nibbles, begin + kTableRunNibbles);
    V32qi bytes[R][C] = {};
    for (int64_t j = begin; j < end; ++j) {
      __m256i table[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        table[r] = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tables + (r * nibbles + j) * 16)));
      }
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(groups + (c * nibbles + j) * kTableGroupCols));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) bytes[r][c] += reinterpret_cast<V32qi>(_mm256_shuffle_epi8(table[r], w));
      }
    }
    // byte b of a lane's unpack is column b of the lane's half: columns 0-7 | 16-23 (low), 8-15 | 24-31 (high)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        const __m256i low = _mm256_unpacklo_epi8(reinterpret_cast<__m256i>(bytes[r][c]), zero);
        const __m256i high = _mm256_unpackhi_epi8(reinterpret_cast<__m256i>(bytes[r][c]), zero);
        auto* sums = reinterpret_cast<__m256i*>(counts[r] + c * kTableGroupCols);
        sums[0] = _mm256_add_epi16(sums[0], _mm256_permute2x128_si256(low, high, 0x20));
        sums[1] = _mm256_add_epi16(sums[1], _mm256_permute2x128_si256(low, high, 0x31));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256i k = _mm256_set1_epi32(k_valid[r]);
    for (int64_t t = 0; t < tiles; ++t) {
      const __m256i count =
          _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(counts[r] + t * kTileRows)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + r * stride + t * kTileRows),
                          _mm256_sub_epi32(k, _mm256_slli_epi32(count, 1)));
    }
  }
}

template <int C>
JAXBNN_TARGET_AVX2 void TableRowBlocksAvx2(const TableRows& rows, const uint8_t* groups, int64_t nibbles,
                                           int64_t tiles, int32_t* dots, int64_t stride) {
  const int64_t row_tables = nibbles * 16;
  for (int64_t r = 0; r < rows.rows; r += kTableRows) {
    const uint8_t* tables = rows.tables + r * row_tables;
    int32_t* row_dots = dots + r * stride;
    switch (std::min<int64_t>(kTableRows, rows.rows - r)) {
      case 4: TableBlockAvx2<4, C>(tables, nibbles, groups, rows.k_valid + r, tiles, row_dots, stride); break;
      case 3: TableBlockAvx2<3, C>(tables, nibbles, groups, rows.k_valid + r, tiles, row_dots, stride); break;
      case 2: TableBlockAvx2<2, C>(tables, nibbles, groups, rows.k_valid + r, tiles, row_dots, stride); break;
      default: TableBlockAvx2<1, C>(tables, nibbles, groups, rows.k_valid + r, tiles, row_dots, stride); break;
    }
  }
}

// Two groups of 32 columns a pass while they last (a row's table serves 64 columns), each over every row, so that the
// pass's column nibbles stay in L1 while the rows' tables pass.
JAXBNN_TARGET_AVX2 void TableAvx2(const TableRows& rows, const uint8_t* column_nibbles, int64_t nibbles,
                                  int64_t col_begin, int64_t tiles, int32_t* dots, int64_t stride) {
  constexpr int64_t kGroupTiles = kTableGroupCols / kTileRows;
  const uint8_t* groups = column_nibbles + col_begin / kTableGroupCols * nibbles * kTableGroupCols;
  for (int64_t t = 0; t < tiles; t += 2 * kGroupTiles) {
    const int64_t pass = std::min(2 * kGroupTiles, tiles - t);
    const uint8_t* pass_groups = groups + t / kGroupTiles * nibbles * kTableGroupCols;
    if (pass > kGroupTiles) {
      TableRowBlocksAvx2<2>(rows, pass_groups, nibbles, pass, dots + t * kTileRows, stride);
    } else {
      TableRowBlocksAvx2<1>(rows, pass_groups, nibbles, pass, dots + t * kTileRows, stride);
    }
  }
}

// A word's 8 tables, two a register: nibble 2p (the low nibble of byte p) in the low lane, nibble 2p + 1 in the high
// one, each entry i the popcount of nibble XOR i.
JAXBNN_TARGET_AVX2 void RowTablesAvx2(const uint32_t* row, int64_t k_words, uint32_t last_mask, uint8_t* tables) {
  const __m256i counts = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1,
                                          2, 2, 3, 2, 3, 3, 4);
  const __m256i entries = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6,
                                           7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  for (int64_t k = 0; k < k_words; ++k) {
    const uint32_t word = k + 1 == k_words ? row[k] & last_mask : row[k];
    const __m256i broadcast = _mm256_set1_epi32(static_cast<int>(word));
    // low lane: the word's low nibbles, high lane: its high nibbles, one a byte
    const __m256i nibbles = _mm256_blend_epi32(_mm256_and_si256(broadcast, low_nibbles),
                                               _mm256_and_si256(_mm256_srli_epi16(broadcast, 4), low_nibbles), 0xf0);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i spread = _mm256_shuffle_epi8(nibbles, _mm256_set1_epi8(static_cast<char>(p)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tables + (k * 8 + 2 * p) * 16),
                          _mm256_shuffle_epi8(counts, _mm256_xor_si256(spread, entries)));
    }
  }
}

// The column nibbles of one whole chunk (4 words) of one tile row (8 columns): its 8 x 16 bytes (column i's four
// words, byte b of word w at 4 w + b) transposed into 16 x 8 by unpacks, then each byte's low nibble (nibble 2b of
// word w) and high nibble (2b + 1) stored as 8 bytes at the tile row's place in its group.
JAXBNN_TARGET_AVX2 inline void ChunkNibblesAvx2(const uint32_t* chunk, uint8_t* word_nibbles) {
  const auto* c = reinterpret_cast<const __m256i*>(chunk);
  // register q: columns 2q (low lane) and 2q + 1 (high lane)
  const __m256i y0 = _mm256_loadu_si256(c), y1 = _mm256_loadu_si256(c + 1), y2 = _mm256_loadu_si256(c + 2),
                y3 = _mm256_loadu_si256(c + 3);
  const __m256i a0 = _mm256_unpacklo_epi8(y0, y1), a1 = _mm256_unpackhi_epi8(y0, y1);
  const __m256i a2 = _mm256_unpacklo_epi8(y2, y3), a3 = _mm256_unpackhi_epi8(y2, y3);
  // b_q: bytes 4q .. 4q + 3 of the even columns 0, 2, 4, 6 (low lane) and of the odd ones (high lane)
  const __m256i b[4] = {_mm256_unpacklo_epi16(a0, a2), _mm256_unpackhi_epi16(a0, a2), _mm256_unpacklo_epi16(a1, a3),
                        _mm256_unpackhi_epi16(a1, a3)};
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  for (int h = 0; h < 2; ++h) {
    const __m256i even = _mm256_permute2x128_si256(b[2 * h], b[2 * h + 1], 0x20);
    const __m256i odd = _mm256_permute2x128_si256(b[2 * h], b[2 * h + 1], 0x31);
    // the 8 columns of byte m in 8-byte piece p of `pieces`: bytes 8h + (0, 1, 4, 5) then 8h + (2, 3, 6, 7)
    const __m256i pieces[2] = {_mm256_unpacklo_epi8(even, odd), _mm256_unpackhi_epi8(even, odd)};
    for (int u = 0; u < 2; ++u) {
      alignas(32) uint64_t low[4], high[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(low), _mm256_and_si256(pieces[u], low_nibbles));
      _mm256_store_si256(reinterpret_cast<__m256i*>(high),
                         _mm256_and_si256(_mm256_srli_epi16(pieces[u], 4), low_nibbles));
      constexpr int kByteOf[4] = {0, 1, 4, 5};
      for (int p = 0; p < 4; ++p) {
        const int m = 8 * h + 2 * u + kByteOf[p];  // byte m = 4 w + b: nibbles 8 w + 2 b, 8 w + 2 b + 1
        uint8_t* nibble = word_nibbles + ((m / 4) * 8 + 2 * (m % 4)) * kTableGroupCols;
        std::memcpy(nibble, &low[p], 8);
        std::memcpy(nibble + kTableGroupCols, &high[p], 8);
      }
    }
  }
}

JAXBNN_TARGET_AVX2 void ColumnNibblesAvx2(const uint32_t* kernel_tiles, int64_t n, int64_t k_words, uint32_t last_mask,
                                          int64_t first_group, int64_t end_group, uint8_t* column_nibbles) {
  const int64_t chunks = (k_words + kChunkWords - 1) / kChunkWords, nibbles = k_words * 8;
  // chunks before the one holding the last word: whole, unmasked
  const int64_t whole_chunks = (k_words - 1) / kChunkWords;
  const int64_t group_tiles = kTableGroupCols / kTileRows, tile_rows = (n + kTileRows - 1) / kTileRows;
  for (int64_t g = first_group; g < end_group; ++g) {
    uint8_t* group = column_nibbles + g * nibbles * kTableGroupCols;
    const int64_t first_tile = g * group_tiles, end_tile = std::min(tile_rows, first_tile + group_tiles);
    if (end_tile - first_tile < group_tiles) std::memset(group, 0, nibbles * kTableGroupCols);
    for (int64_t t = first_tile; t < end_tile; ++t) {
      const uint32_t* tile_row = kernel_tiles + t * chunks * kTileChunkWords;
      uint8_t* tile_nibbles = group + (t - first_tile) * kTileRows;
      for (int64_t j = 0; j < whole_chunks; ++j) {
        ChunkNibblesAvx2(tile_row + j * kTileChunkWords, tile_nibbles + j * kChunkWords * 8 * kTableGroupCols);
      }
      for (int64_t word = whole_chunks * kChunkWords; word < k_words; ++word) {
        for (int64_t i = 0; i < kTileRows; ++i) {
          uint32_t w = tile_row[word / kChunkWords * kTileChunkWords + i * kChunkWords + word % kChunkWords];
          if (word + 1 == k_words) w &= last_mask;
          if (t * kTileRows + i >= n) w = 0;
          uint8_t* nibble = tile_nibbles + word * 8 * kTableGroupCols + i;
          for (int b = 0; b < 8; ++b, w >>= 4) nibble[b * kTableGroupCols] = static_cast<uint8_t>(w & 0xf);
        }
      }
    }
  }
}

// GCC 12 reports its own _mm512_undefined_* placeholders (inside the narrowing intrinsics) as maybe
// uninitialized; they are do-not-care lanes by design.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// AVX-512 VPOPCNTDQ, one register block: kRows panel rows x kTiles tile rows (8 output columns each). The
// two 64-bit halves of a tile chunk are regrouped into one register per half (8 columns x 64 bits), so
// that each 64-bit panel word is broadcast from memory into the XOR itself and every accumulator lane is
// one output column: per 64 x 8 ±1 products one XOR, one VPOPCNTQ and one add, nothing else.
template <int kRows, int kTiles, bool kMasked, int kHalves>
JAXBNN_TARGET_AVX512 inline __attribute__((always_inline)) void ChunkAvx512(const uint32_t* group,
                                                                            const uint32_t* tile_row,
                                                                            int64_t tile_row_words, int64_t j,
                                                                            const uint32_t* mask,
                                                                            __m512i (&acc)[kRows][kTiles]) {
  __m512i w[kTiles][2];
#pragma GCC unroll 2
  for (int t = 0; t < kTiles; ++t) {
    const uint32_t* chunk = tile_row + t * tile_row_words + j * kTileChunkWords;
    const __m512i rows_0_3 = _mm512_loadu_si512(chunk);
    const __m512i rows_4_7 = _mm512_loadu_si512(chunk + 16);
    // Columns in the order 0, 4, 1, 5, 2, 6, 3, 7 (in-lane unpacks need no index registers).
    w[t][0] = _mm512_unpacklo_epi64(rows_0_3, rows_4_7);
    w[t][1] = _mm512_unpackhi_epi64(rows_0_3, rows_4_7);
    if constexpr (kMasked) {
      w[t][0] = _mm512_and_si512(w[t][0], _mm512_set1_epi64(static_cast<long long>(Load64(mask + j * kChunkWords))));
      w[t][1] = _mm512_and_si512(w[t][1], _mm512_set1_epi64(static_cast<long long>(Load64(mask + j * kChunkWords + 2))));
    }
  }
  const uint32_t* x = group + j * kGroupChunkWords;
#pragma GCC unroll 2
  for (int half = 0; half < kHalves; ++half) {
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512i xr = _mm512_set1_epi64(static_cast<long long>(Load64(x + r * kChunkWords + 2 * half)));
#pragma GCC unroll 2
      for (int t = 0; t < kTiles; ++t) {
        acc[r][t] = _mm512_add_epi64(acc[r][t], _mm512_popcnt_epi64(_mm512_xor_si512(w[t][half], xr)));
      }
    }
  }
}

template <int kRows, int kTiles, int kMask>
JAXBNN_TARGET_AVX512 void PanelBlockAvx512(const uint32_t* group, const uint32_t* tile_row, int64_t chunks,
                                           const uint32_t* mask, const int32_t* k_valid, int32_t* dots,
                                           int64_t stride) {
  const int64_t tile_row_words = chunks * kTileChunkWords;
  __m512i acc[kRows][kTiles];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
    for (int t = 0; t < kTiles; ++t) acc[r][t] = _mm512_setzero_si512();
  }
  const int64_t body = kMask == kLastHalf || kMask == kLastChunk ? chunks - 1 : chunks;
  for (int64_t j = 0; j < body; ++j) {
    ChunkAvx512<kRows, kTiles, kMask == kEveryChunk, 2>(group, tile_row, tile_row_words, j, mask, acc);
  }
  if constexpr (kMask == kLastHalf) ChunkAvx512<kRows, kTiles, true, 1>(group, tile_row, tile_row_words, body, mask, acc);
  if constexpr (kMask == kLastChunk) ChunkAvx512<kRows, kTiles, true, 2>(group, tile_row, tile_row_words, body, mask, acc);
  const __m256i column_order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
    for (int t = 0; t < kTiles; ++t) {
      const __m256i popcounts = _mm256_permutevar8x32_epi32(_mm512_cvtepi64_epi32(acc[r][t]), column_order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + r * stride + t * kTileRows),
                          _mm256_sub_epi32(_mm256_set1_epi32(k_valid[r]), _mm256_slli_epi32(popcounts, 1)));
    }
  }
}

template <int kTiles, int kMask>
void PanelGroupsAvx512(const PackedPanel& panel, const uint32_t* tile_row, int32_t* dots, int64_t stride) {
  const int64_t group_words = panel.chunks * kGroupChunkWords;
  for (int64_t first = 0; first < panel.rows; first += kGroupRows) {
    const uint32_t* group = panel.data + (first / kGroupRows) * group_words;
    const int32_t* k_valid = panel.k_valid + first;
    int32_t* out = dots + first * stride;
    const uint32_t* mask = panel.weight_mask;
    const int64_t chunks = panel.chunks;
    switch (std::min<int64_t>(kGroupRows, panel.rows - first)) {
      case 8: PanelBlockAvx512<8, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      case 7: PanelBlockAvx512<7, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      case 6: PanelBlockAvx512<6, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      case 5: PanelBlockAvx512<5, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      case 4: PanelBlockAvx512<4, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      case 3: PanelBlockAvx512<3, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      case 2: PanelBlockAvx512<2, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      case 1: PanelBlockAvx512<1, kTiles, kMask>(group, tile_row, chunks, mask, k_valid, out, stride); break;
      default: break;
    }
  }
}

// Two tile rows (16 output columns) at a time, each pair swept over every row group of the panel while its
// weights are hot in L1.
template <int kMask>
void PanelAvx512Masked(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles, int32_t* dots,
                       int64_t stride) {
  const int64_t tile_row_words = panel.chunks * kTileChunkWords;
  int64_t t = 0;
  for (; t + 2 <= tiles; t += 2) {
    PanelGroupsAvx512<2, kMask>(panel, tile_rows + t * tile_row_words, dots + t * kTileRows, stride);
  }
  if (t < tiles) PanelGroupsAvx512<1, kMask>(panel, tile_rows + t * tile_row_words, dots + t * kTileRows, stride);
}

void PanelAvx512(const PackedPanel& panel, const uint32_t* tile_rows, int64_t tiles, int32_t* dots,
                 int64_t stride) {
  switch (MaskUseOf(panel)) {
    case kNoMask: return PanelAvx512Masked<kNoMask>(panel, tile_rows, tiles, dots, stride);
    case kEveryChunk: return PanelAvx512Masked<kEveryChunk>(panel, tile_rows, tiles, dots, stride);
    case kLastHalf: return PanelAvx512Masked<kLastHalf>(panel, tile_rows, tiles, dots, stride);
    case kLastChunk: return PanelAvx512Masked<kLastChunk>(panel, tile_rows, tiles, dots, stride);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // JAXBNN_X86

// --- strip epilogues ------------------------------------------------------------------------------------
// One body per tier (JAXBNN_FINISH_STRIP): the pooling and copy loops below are inlined into it and
// vectorized for its ISA; a tier's threshold word (32 columns at once) is its own.

#if defined(__GNUC__)
#define JAXBNN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define JAXBNN_ALWAYS_INLINE inline
#endif

constexpr int64_t kWordBits = 32;

// The max of `window` rows of `width` dots (rows `stride` apart).
JAXBNN_ALWAYS_INLINE void PoolRows(const int32_t* rows, int64_t stride, int64_t window, int64_t width,
                                   int32_t* pooled) {
  for (int64_t i = 0; i < width; ++i) pooled[i] = rows[i];
  for (int64_t r = 1; r < window; ++r) {
    const int32_t* row = rows + r * stride;
    for (int64_t i = 0; i < width; ++i) pooled[i] = std::max(pooled[i], row[i]);
  }
}

JAXBNN_ALWAYS_INLINE void AffineRow(const int32_t* dots, const float* scale, const float* bias, int64_t width,
                                    float* dst) {
  // Exactly float(dot) * scale + bias: the module is built with -ffp-contract=off (no fused multiply-add).
  for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<float>(dots[i]) * scale[i] + bias[i];
}

// dot >= threshold, or dot <= threshold where flip, for 32 columns: bit i of the word is column i.
JAXBNN_ALWAYS_INLINE uint32_t ScalarThresholdWord(const int32_t* dots, const int32_t* threshold,
                                                  const uint8_t* flip) {
  uint32_t bits = 0;
  for (int i = 0; i < kWordBits; ++i) {
    const uint32_t at_least = dots[i] >= threshold[i], at_most = dots[i] <= threshold[i];
    bits |= (flip[i] ? at_most : at_least) << i;
  }
  return bits;
}

#ifdef JAXBNN_X86
JAXBNN_TARGET_AVX2 JAXBNN_ALWAYS_INLINE uint32_t Avx2ThresholdWord(const int32_t* dots, const int32_t* threshold,
                                                                   const uint8_t* flip) {
  uint32_t below = 0, above = 0;  // dot < threshold, dot > threshold
  for (int q = 0; q < 4; ++q) {
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dots + 8 * q));
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(threshold + 8 * q));
    below |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(t, d)))) << (8 * q);
    above |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(d, t)))) << (8 * q);
  }
  const __m256i f = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(flip));
  const uint32_t flipped = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(f, _mm256_setzero_si256())));
  return ~((below & ~flipped) | (above & flipped));
}

JAXBNN_TARGET_AVX512 JAXBNN_ALWAYS_INLINE uint32_t Avx512ThresholdWord(const int32_t* dots,
                                                                       const int32_t* threshold,
                                                                       const uint8_t* flip) {
  uint32_t bits = 0;
  for (int h = 0; h < 2; ++h) {
    const __m512i d = _mm512_loadu_si512(dots + 16 * h), t = _mm512_loadu_si512(threshold + 16 * h);
    const __m512i f = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(flip + 16 * h)));
    const uint32_t flipped = _mm512_test_epi32_mask(f, f);
    const uint32_t at_least = _mm512_cmpge_epi32_mask(d, t), at_most = _mm512_cmple_epi32_mask(d, t);
    bits |= ((at_least & ~flipped) | (at_most & flipped)) << (16 * h);
  }
  return bits;
}
#endif

// The shortcut pixels of consecutive output rows of the residual epilogue: output pixel (b, oh, ow) reads
// (b, oh * stride, ow * stride), stepped row by row (divisions only for a strip's first row).
class ShortcutRows {
 public:
  ShortcutRows(const ResidualData& r, int64_t row) : r_(r) {
    const int64_t image_pixels = r.out_h * r.out_w;
    b_ = row / image_pixels;
    const int64_t in_image = row - b_ * image_pixels;
    oh_ = in_image / r.out_w;
    ow_ = in_image - oh_ * r.out_w;
  }
  // The element offset of the current row's shortcut pixel.
  int64_t Offset() const { return ((b_ * r_.height + oh_ * r_.stride) * r_.width + ow_ * r_.stride) * r_.channels; }
  void Next() {
    if (++ow_ < r_.out_w) return;
    ow_ = 0;
    if (++oh_ == r_.out_h) oh_ = 0, ++b_;
  }

 private:
  const ResidualData& r_;
  int64_t b_, oh_, ow_;
};

// The stream values of `width` columns from their dots: (dot >> shift) + the shortcut's first `added`
// columns (0 past them), in T's arithmetic (int16: the low 16 bits of the int32 sum), stored into `stream`
// and, where given, as int32 into `values` (what the thresholds compare).
template <class T>
JAXBNN_ALWAYS_INLINE void ResidualValues(const int32_t* dots, const T* shortcut, int64_t added, int64_t width,
                                         int64_t shift, T* stream, int32_t* values) {
  for (int64_t i = 0; i < added; ++i) {
    const T value =
        static_cast<T>(static_cast<uint32_t>(dots[i] >> shift) + static_cast<uint32_t>(static_cast<int32_t>(shortcut[i])));
    stream[i] = value;
    if (values != nullptr) values[i] = value;
  }
  for (int64_t i = added; i < width; ++i) {
    const T value = static_cast<T>(dots[i] >> shift);
    stream[i] = value;
    if (values != nullptr) values[i] = value;
  }
}

// The strip epilogue of one tier, whose 32-column threshold word is WORD (Strip in popcount_kernels.h), and
// its threshold words of a row's values (NAME##Words). The last word of a row may have fewer columns
// (`valid`): it is computed on zero-padded copies, its padding bits cleared.
#define JAXBNN_FINISH_STRIP(NAME, ATTR, WORD)                                                          \
  ATTR void NAME##Words(const int32_t* values, const int32_t* threshold, const uint8_t* flip,          \
                        int64_t width, uint32_t* dst) {                                                \
    for (int64_t word = 0; word * kWordBits < width; ++word) {                                         \
      const int64_t c = word * kWordBits, valid = std::min(kWordBits, width - c);                      \
      if (valid == kWordBits) {                                                                        \
        dst[word] = WORD(values + c, threshold + c, flip + c);                                         \
        continue;                                                                                      \
      }                                                                                                \
      int32_t d[kWordBits] = {}, t[kWordBits] = {};                                                    \
      uint8_t f[kWordBits] = {};                                                                       \
      std::copy(values + c, values + c + valid, d);                                                    \
      std::copy(threshold + c, threshold + c + valid, t);                                              \
      std::copy(flip + c, flip + c + valid, f);                                                        \
      dst[word] = WORD(d, t, f) & ((uint32_t{1} << valid) - 1);                                        \
    }                                                                                                  \
  }                                                                                                    \
  /* the residual epilogue (unpooled): the stream, then each threshold plane's bits of its values */   \
  ATTR void NAME##Residual(const Strip& s, const EpilogueData& e) {                                    \
    const ResidualData& r = e.residual;                                                                \
    const int64_t words = (s.n + kWordBits - 1) / kWordBits;                                           \
    const int64_t added = std::max<int64_t>(0, std::min(s.width, r.channels - s.col_begin));           \
    int32_t narrow_values[kStripCols];                                                                 \
    ShortcutRows shortcut(r, s.first_output);                                                          \
    for (int64_t o = 0; o < s.outputs; ++o, shortcut.Next()) {                                         \
      const int64_t row = s.first_output + o, at = row * s.n + s.col_begin;                            \
      const int64_t from = added > 0 ? shortcut.Offset() + s.col_begin : 0;                            \
      const int32_t* dots = s.dots + o * s.stride;                                                     \
      const int32_t* values;                                                                           \
      if (r.narrow) {                                                                                  \
        ResidualValues(dots, static_cast<const int16_t*>(r.shortcut) + from, added, s.width, r.shift,  \
                       static_cast<int16_t*>(s.out) + at, narrow_values);                              \
        values = narrow_values;                                                                        \
      } else {                                                                                         \
        int32_t* stream = static_cast<int32_t*>(s.out) + at;                                           \
        ResidualValues(dots, static_cast<const int32_t*>(r.shortcut) + from, added, s.width, r.shift,  \
                       stream, static_cast<int32_t*>(nullptr));                                        \
        values = stream;                                                                               \
      }                                                                                                \
      if (e.threshold == nullptr) continue;                                                            \
      for (int64_t plane = 0; plane < e.planes; ++plane) {                                             \
        NAME##Words(values, e.threshold + plane * s.n + s.col_begin, e.flip + plane * s.n + s.col_begin, \
                    s.width, r.bits + (row * e.planes + plane) * words + s.col_begin / kWordBits);    \
      }                                                                                                \
    }                                                                                                  \
  }                                                                                                    \
  ATTR void NAME(const Strip& s, const EpilogueData& e) {                                              \
    if (e.kind == Epilogue::kResidual) return NAME##Residual(s, e);                                    \
    int32_t pooled[kStripCols];                                                                        \
    const int64_t words = (s.n + kWordBits - 1) / kWordBits;                                           \
    for (int64_t o = 0; o < s.outputs; ++o) {                                                          \
      const int32_t* dots = s.dots + o * s.window * s.stride;                                          \
      if (s.window > 1) {                                                                              \
        PoolRows(dots, s.stride, s.window, s.width, pooled);                                           \
        dots = pooled;                                                                                 \
      }                                                                                                \
      const int64_t row = s.first_output + o;                                                          \
      if (e.kind == Epilogue::kInt32) {                                                                \
        std::copy(dots, dots + s.width, static_cast<int32_t*>(s.out) + row * s.n + s.col_begin);       \
      } else if (e.kind == Epilogue::kAffine) {                                                        \
        AffineRow(dots, e.scale + s.col_begin, e.bias + s.col_begin, s.width,                          \
                  static_cast<float*>(s.out) + row * s.n + s.col_begin);                               \
      } else {                                                                                         \
        for (int64_t plane = 0; plane < e.planes; ++plane) {                                           \
          NAME##Words(dots, e.threshold + plane * s.n + s.col_begin, e.flip + plane * s.n + s.col_begin, \
                      s.width, static_cast<uint32_t*>(s.out) + (row * e.planes + plane) * words +      \
                                   s.col_begin / kWordBits);                                           \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
  }

JAXBNN_FINISH_STRIP(FinishStripGeneric, , ScalarThresholdWord)
#ifdef JAXBNN_X86
JAXBNN_FINISH_STRIP(FinishStripAvx2, JAXBNN_TARGET_AVX2, Avx2ThresholdWord)
JAXBNN_FINISH_STRIP(FinishStripAvx512, JAXBNN_TARGET_AVX512, Avx512ThresholdWord)
#endif
#undef JAXBNN_FINISH_STRIP

// AddRowsFn, vectorized for each tier's ISA.
#define JAXBNN_ADD_ROWS(NAME, ATTR)                                                                    \
  template <int kFactor>                                                                               \
  ATTR void NAME(int32_t* dots, const int32_t* const* rows, int64_t count, int64_t width) {            \
    for (int64_t r = 0; r < count; ++r) {                                                              \
      const int32_t* row = rows[r];                                                                    \
      for (int64_t i = 0; i < width; ++i) dots[i] += kFactor * row[i];                                 \
    }                                                                                                  \
  }

JAXBNN_ADD_ROWS(AddRowsGeneric, )
#ifdef JAXBNN_X86
JAXBNN_ADD_ROWS(AddRowsAvx2, JAXBNN_TARGET_AVX2)
JAXBNN_ADD_ROWS(AddRowsAvx512, JAXBNN_TARGET_AVX512)
#endif
#undef JAXBNN_ADD_ROWS

Isa DetectBestIsa() {
#ifdef JAXBNN_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vpopcntdq")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt")) return Isa::kAvx2;
  if (__builtin_cpu_supports("popcnt")) return Isa::kPopcnt;
#endif
  return Isa::kGeneric;
}

std::atomic<Isa>& ActiveIsaSlot() {
  static std::atomic<Isa> active{DetectBestIsa()};
  return active;
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512_vpopcntdq";
    case Isa::kAvx2: return "avx2";
    case Isa::kPopcnt: return "popcnt";
    case Isa::kGeneric: return "generic";
  }
  return "generic";
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas;
  Isa best = DetectBestIsa();
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPopcnt, Isa::kGeneric}) {
    if (static_cast<int>(isa) <= static_cast<int>(best)) isas.push_back(isa);
  }
  return isas;
}

Isa ActiveIsa() { return ActiveIsaSlot().load(std::memory_order_relaxed); }

bool ForceIsa(const std::string& name) {
  for (Isa isa : SupportedIsas()) {
    if (name == IsaName(isa)) {
      ActiveIsaSlot().store(isa, std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

FinishStripFn FinishStripFor(Isa isa) {
  switch (isa) {
#ifdef JAXBNN_X86
    case Isa::kAvx512: return FinishStripAvx512;
    case Isa::kAvx2: return FinishStripAvx2;
#endif
    default: return FinishStripGeneric;
  }
}

AddRowsFn AddRowsFor(Isa isa, int factor) {
  const bool doubled = factor == 2;
  switch (isa) {
#ifdef JAXBNN_X86
    case Isa::kAvx512: return doubled ? AddRowsAvx512<2> : AddRowsAvx512<1>;
    case Isa::kAvx2: return doubled ? AddRowsAvx2<2> : AddRowsAvx2<1>;
#endif
    default: return doubled ? AddRowsGeneric<2> : AddRowsGeneric<1>;
  }
}

PanelDotsFn PanelDotsFor(Isa isa) {
  switch (isa) {
#ifdef JAXBNN_X86
    case Isa::kAvx512: return PanelAvx512;
    case Isa::kAvx2: return PanelAvx2;
    case Isa::kPopcnt: return PanelPopcnt;
#endif
    default: return PanelGeneric;
  }
}

LaneDotsFn LaneDotsFor(Isa isa) {
#ifdef JAXBNN_X86
  if (isa == Isa::kAvx2) return LaneAvx2;
#endif
  return nullptr;
}

TableTier TableTierFor(Isa isa) {
#ifdef JAXBNN_X86
  if (isa == Isa::kAvx2) return TableTier{TableAvx2, RowTablesAvx2, ColumnNibblesAvx2};
#endif
  return TableTier{};
}

}  // namespace jaxbnn::cpu

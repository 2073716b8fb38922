// Instruction-set tiers of the ternary and mixed panel and lane kernels (ternary_dots.h), compiled as the binary
// ones (panel_words.h).
#include "cpu/ternary_dots.h"

#include <algorithm>

#include "cpu/panel_words.h"

namespace jaxbnn::cpu {
namespace {

using namespace panel_words;

// Words of chunk 0 of panel row r (all planes); chunk j follows at + j * GroupChunkWords(mix).
template <Mix kMix>
constexpr int64_t GroupChunkWords() {
  return kGroupRows * PanelPlanes(kMix) * kChunkWords;
}

template <Mix kMix>
inline const uint32_t* PanelRowWords(const MixedPanel& panel, int64_t r) {
  return panel.data + ((r / kGroupRows) * panel.chunks * kGroupRows + r % kGroupRows) * PanelPlanes(kMix) * kChunkWords;
}

// The popcounts of one 64-bit word: `plus` (TNN: popc(z_x & z_w)) and `gated` (the gated XOR). x0 / x1 the
// panel planes' words, w0 / w1 the weight planes' (nonneg, pos; or w0 the bits), m the reduction mask.
struct WordCounts {
  uint64_t plus, gated;
};

// Always inlined, so that __builtin_popcountll becomes the popcnt instruction in the popcnt tier.
template <Mix kMix>
inline __attribute__((always_inline)) WordCounts CountWord(uint64_t x0, uint64_t x1, uint64_t w0, uint64_t w1,
                                                           uint64_t m) {
  if constexpr (kMix == Mix::kTnn) {
    const uint64_t g = x1 & ~(w0 ^ w1) & m;
    return {static_cast<uint64_t>(__builtin_popcountll(g)), static_cast<uint64_t>(__builtin_popcountll(g & (x0 ^ w1)))};
  } else if constexpr (kMix == Mix::kTbn) {
    return {0, static_cast<uint64_t>(__builtin_popcountll((x0 ^ w0) & x1))};
  } else {
    return {0, static_cast<uint64_t>(__builtin_popcountll((x0 ^ w1) & ~(w0 ^ w1) & m))};
  }
}

// Scalar tiers: the same code with and without the popcnt instruction.
#define JAXBNN_SCALAR_MIXED(NAME, ATTR)                                                                        \
  template <Mix kMix>                                                                                          \
  ATTR void NAME(const MixedPanel& panel, const MixedWeights& w, int64_t tiles, int32_t* dots, int64_t stride) { \
    constexpr int kPlanes = PanelPlanes(kMix);                                                                 \
    const int64_t chunks = panel.chunks;                                                                       \
    for (int64_t r = 0; r < panel.rows; ++r) {                                                                 \
      const uint32_t* x = PanelRowWords<kMix>(panel, r);                                                       \
      for (int64_t t = 0; t < tiles; ++t) {                                                                    \
        const int64_t tile_row = t * chunks * kTileChunkWords;                                                 \
        for (int i = 0; i < kTileRows; ++i) {                                                                  \
          uint64_t plus = 0, gated = 0;                                                                        \
          for (int64_t j = 0; j < chunks; ++j) {                                                               \
            const uint32_t* xj = x + j * GroupChunkWords<kMix>();                                              \
            const int64_t at = tile_row + j * kTileChunkWords + i * kChunkWords;                               \
            for (int half = 0; half < 2; ++half) {                                                             \
              const uint64_t x1 = kPlanes == 2 ? Load64(xj + kChunkWords + 2 * half) : 0;                      \
              const uint64_t w1 = w.pos != nullptr ? Load64(w.pos + at + 2 * half) : 0;                        \
              const uint64_t m = w.mask != nullptr ? Load64(w.mask + j * kChunkWords + 2 * half) : 0;          \
              const WordCounts counts =                                                                        \
                  CountWord<kMix>(Load64(xj + 2 * half), x1, Load64(w.nonneg + at + 2 * half), w1, m);         \
              plus += counts.plus;                                                                             \
              gated += counts.gated;                                                                           \
            }                                                                                                  \
          }                                                                                                    \
          dots[r * stride + t * kTileRows + i] = panel.row_term[r] + w.col_term[t * kTileRows + i] +           \
                                                 static_cast<int32_t>(plus) - 2 * static_cast<int32_t>(gated); \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
  }

JAXBNN_SCALAR_MIXED(MixedGeneric, )
#ifdef JAXBNN_X86
JAXBNN_SCALAR_MIXED(MixedPopcnt, JAXBNN_TARGET_POPCNT)
#endif
#undef JAXBNN_SCALAR_MIXED

#ifdef JAXBNN_X86

// AVX2: a tile chunk is four 256-bit registers (tile rows 2q, 2q+1 in register q); a panel chunk is
// broadcast to both 128-bit lanes. Bytes are counted (ByteCountsAvx2) and summed in byte lanes over up to
// kAvx2ByteChunks chunks, then into 64-bit lanes with psadbw.
JAXBNN_TARGET_AVX2 inline __m256i Broadcast128(const uint32_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

JAXBNN_TARGET_AVX2 inline __m256i AddByteCounts(__m256i bytes, __m256i bits) {
  return _mm256_add_epi8(bytes, ByteCountsAvx2(bits));
}

template <Mix kMix>
JAXBNN_TARGET_AVX2 void MixedAvx2(const MixedPanel& panel, const MixedWeights& w, int64_t tiles, int32_t* dots,
                                  int64_t stride) {
  constexpr int kPlanes = PanelPlanes(kMix);
  const __m256i zero = _mm256_setzero_si256();
  const int64_t chunks = panel.chunks;
  for (int64_t r = 0; r < panel.rows; ++r) {
    const uint32_t* x = PanelRowWords<kMix>(panel, r);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t tile_row = t * chunks * kTileChunkWords;
      __m256i plus_total[4] = {zero, zero, zero, zero}, gated_total[4] = {zero, zero, zero, zero};
      for (int64_t j0 = 0; j0 < chunks; j0 += kAvx2ByteChunks) {
        const int64_t j1 = std::min(chunks, j0 + kAvx2ByteChunks);
        __m256i plus[4] = {zero, zero, zero, zero}, gated[4] = {zero, zero, zero, zero};
        for (int64_t j = j0; j < j1; ++j) {
          const uint32_t* xj = x + j * GroupChunkWords<kMix>();
          const __m256i x0 = Broadcast128(xj);
          const __m256i x1 = kPlanes == 2 ? Broadcast128(xj + kChunkWords) : zero;
          const __m256i m = TernaryWeights(kMix) ? Broadcast128(w.mask + j * kChunkWords) : zero;
          for (int q = 0; q < 4; ++q) {
            const int64_t at = tile_row + j * kTileChunkWords + 8 * q;
            const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.nonneg + at));
            if constexpr (kMix == Mix::kTbn) {
              gated[q] = AddByteCounts(gated[q], _mm256_and_si256(_mm256_xor_si256(x0, w0), x1));
            } else {
              const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.pos + at));
              const __m256i z = _mm256_andnot_si256(_mm256_xor_si256(w0, w1), m);
              if constexpr (kMix == Mix::kTnn) {
                const __m256i g = _mm256_and_si256(z, x1);
                plus[q] = AddByteCounts(plus[q], g);
                gated[q] = AddByteCounts(gated[q], _mm256_and_si256(_mm256_xor_si256(x0, w1), g));
              } else {
                gated[q] = AddByteCounts(gated[q], _mm256_and_si256(_mm256_xor_si256(x0, w1), z));
              }
            }
          }
        }
        for (int q = 0; q < 4; ++q) {
          if constexpr (kMix == Mix::kTnn) {
            plus_total[q] = _mm256_add_epi64(plus_total[q], _mm256_sad_epu8(plus[q], zero));
          }
          gated_total[q] = _mm256_add_epi64(gated_total[q], _mm256_sad_epu8(gated[q], zero));
        }
      }
      // row_term + col_term + plus - 2 gated, the tile row's eight columns at once
      const int64_t c0 = t * kTileRows;
      __m256i out = _mm256_add_epi32(_mm256_set1_epi32(panel.row_term[r]),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.col_term + c0)));
      if constexpr (kMix == Mix::kTnn) out = _mm256_add_epi32(out, ColumnSumsAvx2(plus_total));
      out = _mm256_sub_epi32(out, _mm256_slli_epi32(ColumnSumsAvx2(gated_total), 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + r * stride + c0), out);
    }
  }
}

// AVX2 lane kernels (MixedLaneDotsFn): per word of a row and tile row, per nibble half, TNN forms g = z_x & z_w and
// the gated g & (a_x ^ b_w) (two ANDs, one XOR) and adds the lookup of one and subtracts the doubled lookup of the
// other, so that one signed byte accumulator a column holds popc(g) - 2 popc(gated); TBN and BTN gate their XOR
// with z_x or z_w (an XOR, an AND) and add one lookup. TNN's words add at most 8 in magnitude to a byte, so its
// bytes are folded into 32-bit counts every 15 words (15 * 8 = 120); the gated counts of TBN and BTN every
// kLaneByteWords words.
template <Mix kMix>
constexpr int64_t LaneFoldWords() {
  return kMix == Mix::kTnn ? 15 : kLaneByteWords;
}
static_assert(15 * 8 <= 127, "signed byte lanes must not wrap");

// A longer reduction is counted this many words at a time over a run of about kLaneRunRows rows (whole windows,
// BlockedLaneRowsAvx2), so that 4 tile rows of two planes (18 KB) stay in L1 while the rows pass.
constexpr int64_t kLaneBlockWords = 36;

// The counts of words [first_word, end_word) of one row against kTiles tile rows (of k_words words): TNN popc(g) -
// 2 popc(gated), else popc(gated), in 32-bit lanes in column order.
template <Mix kMix, int kTiles>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void MixedLaneCountsAvx2(const uint32_t* base,
                                                                                   const int64_t* offsets,
                                                                                   const uint32_t* lanes,
                                                                                   int64_t k_words,
                                                                                   int64_t first_word,
                                                                                   int64_t end_word,
                                                                                   __m256i (&counts)[kTiles]) {
  constexpr int64_t kTileWordWords = LaneWeightPlanes(kMix) * kLaneWordNibbles * kTileRows;
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1,
                                         2, 2, 3, 2, 3, 3, 4);
  const __m256i doubled = _mm256_add_epi8(table, table);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  const __m256i ones_8 = _mm256_set1_epi8(1), ones_16 = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int u = 0; u < kTiles; ++u) counts[u] = _mm256_setzero_si256();
  for (int64_t begin = first_word; begin < end_word; begin += LaneFoldWords<kMix>()) {
    const int64_t end = std::min(end_word, begin + LaneFoldWords<kMix>());
    __m256i bytes[kTiles];
#pragma GCC unroll 8
    for (int u = 0; u < kTiles; ++u) bytes[u] = _mm256_setzero_si256();
    for (int64_t k = begin; k < end; ++k) {
      const __m256i x0 = _mm256_set1_epi32(static_cast<int>(base[offsets[k]]));
      const __m256i x0_low = _mm256_and_si256(x0, low_nibbles);
      const __m256i x0_high = _mm256_and_si256(_mm256_srli_epi16(x0, 4), low_nibbles);
      __m256i z_low = x0_low, z_high = x0_high;  // z_x's nibbles (TNN, TBN)
      if constexpr (PanelPlanes(kMix) == 2) {
        const __m256i z = _mm256_set1_epi32(static_cast<int>(base[offsets[k_words + k]]));
        z_low = _mm256_and_si256(z, low_nibbles);
        z_high = _mm256_and_si256(_mm256_srli_epi16(z, 4), low_nibbles);
      }
#pragma GCC unroll 8
      for (int u = 0; u < kTiles; ++u) {
        const __m256i* w = reinterpret_cast<const __m256i*>(lanes + (u * k_words + k) * kTileWordWords);
        if constexpr (kMix == Mix::kTnn) {
          const __m256i g_low = _mm256_and_si256(z_low, _mm256_loadu_si256(w));
          const __m256i g_high = _mm256_and_si256(z_high, _mm256_loadu_si256(w + 1));
          const __m256i gated_low = _mm256_and_si256(g_low, _mm256_xor_si256(x0_low, _mm256_loadu_si256(w + 2)));
          const __m256i gated_high = _mm256_and_si256(g_high, _mm256_xor_si256(x0_high, _mm256_loadu_si256(w + 3)));
          bytes[u] = _mm256_add_epi8(bytes[u], _mm256_shuffle_epi8(table, g_low));
          bytes[u] = _mm256_sub_epi8(bytes[u], _mm256_shuffle_epi8(doubled, gated_low));
          bytes[u] = _mm256_add_epi8(bytes[u], _mm256_shuffle_epi8(table, g_high));
          bytes[u] = _mm256_sub_epi8(bytes[u], _mm256_shuffle_epi8(doubled, gated_high));
        } else {
          // TBN: (a_x ^ w) & z_x; BTN: (x ^ b_w) & z_w
          const __m256i sign_low = _mm256_loadu_si256(w + (kMix == Mix::kBtn ? 2 : 0));
          const __m256i sign_high = _mm256_loadu_si256(w + (kMix == Mix::kBtn ? 3 : 1));
          const __m256i gate_low = kMix == Mix::kBtn ? _mm256_loadu_si256(w) : z_low;
          const __m256i gate_high = kMix == Mix::kBtn ? _mm256_loadu_si256(w + 1) : z_high;
          const __m256i gated_low = _mm256_and_si256(gate_low, _mm256_xor_si256(x0_low, sign_low));
          const __m256i gated_high = _mm256_and_si256(gate_high, _mm256_xor_si256(x0_high, sign_high));
          bytes[u] = _mm256_add_epi8(bytes[u], _mm256_shuffle_epi8(table, gated_low));
          bytes[u] = _mm256_add_epi8(bytes[u], _mm256_shuffle_epi8(table, gated_high));
        }
      }
    }
    // each column's 4 bytes into its 32-bit lane (TNN's are signed: vpmaddubsw takes them as its second operand)
#pragma GCC unroll 8
    for (int u = 0; u < kTiles; ++u) {
      const __m256i pairs =
          kMix == Mix::kTnn ? _mm256_maddubs_epi16(ones_8, bytes[u]) : _mm256_maddubs_epi16(bytes[u], ones_8);
      counts[u] = _mm256_add_epi32(counts[u], _mm256_madd_epi16(pairs, ones_16));
    }
  }
}

// The dots of row r against kTiles tile rows from its counts (columns: their column terms; col: the first column).
template <Mix kMix, int kTiles>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void MixedLaneDotsAvx2(const LaneRows& rows, int64_t r,
                                                                                 const __m256i (&counts)[kTiles],
                                                                                 const __m256i (&columns)[kTiles],
                                                                                 int64_t col,
                                                                                 __m256i (&dots)[kTiles]) {
  const int32_t* correction = rows.correction == nullptr ? nullptr : rows.correction[r];
  const __m256i row_term = _mm256_set1_epi32(rows.k_valid[r]);
#pragma GCC unroll 8
  for (int u = 0; u < kTiles; ++u) {
    dots[u] = _mm256_add_epi32(row_term, columns[u]);
    dots[u] = kMix == Mix::kTnn ? _mm256_add_epi32(dots[u], counts[u])
                                : _mm256_sub_epi32(dots[u], _mm256_slli_epi32(counts[u], 1));
    if (correction != nullptr) {
      dots[u] = _mm256_add_epi32(
          dots[u], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(correction + col + u * kTileRows)));
    }
  }
}

// kTiles tile rows of every output row: each window row's dots, their max stored.
template <Mix kMix, int kTiles>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void MixedLaneOutputsAvx2(const LaneRows& rows,
                                                                                    const uint32_t* lanes,
                                                                                    int64_t k_words,
                                                                                    const int32_t* col_term,
                                                                                    int64_t col, int32_t* dots,
                                                                                    int64_t stride) {
  __m256i columns[kTiles];
#pragma GCC unroll 8
  for (int u = 0; u < kTiles; ++u) {
    columns[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col_term + u * kTileRows));
  }
  if (k_words <= kLaneBlockWords) {
    const auto row_dots = [&](int64_t r, __m256i (&row)[kTiles]) JAXBNN_TARGET_AVX2 __attribute__((always_inline)) {
      __m256i counts[kTiles];
      MixedLaneCountsAvx2<kMix, kTiles>(rows.base[r], rows.offsets[r], lanes, k_words, 0, k_words, counts);
      MixedLaneDotsAvx2<kMix, kTiles>(rows, r, counts, columns, col, row);
    };
    PoolLaneRowsAvx2<kTiles>(rows.rows, rows.window, row_dots, dots, stride);
    return;
  }
  // Longer reductions block by block over runs of whole windows of rows.
  const auto count = [&](int64_t r, int64_t begin, int64_t end, __m256i (&counts)[kTiles])
                         JAXBNN_TARGET_AVX2 __attribute__((always_inline)) {
    MixedLaneCountsAvx2<kMix, kTiles>(rows.base[r], rows.offsets[r], lanes, k_words, begin, end, counts);
  };
  const auto dots_of = [&](int64_t r, const __m256i (&counts)[kTiles], __m256i (&row)[kTiles])
                           JAXBNN_TARGET_AVX2 __attribute__((always_inline)) {
    MixedLaneDotsAvx2<kMix, kTiles>(rows, r, counts, columns, col, row);
  };
  BlockedLaneRowsAvx2<kTiles>(rows.rows, rows.window, k_words, kLaneBlockWords, count, dots_of, dots, stride);
}

// kWidest tile rows a step, each over all output rows while its weights are hot in L1; then half as many, down to
// one. Four at most: TNN's byte and 32-bit accumulators and its four nibble registers of a row word fill the
// sixteen registers.
template <Mix kMix, int kWidest>
JAXBNN_TARGET_AVX2 void MixedLaneStepsAvx2(const LaneRows& rows, const uint32_t* lane_tiles, int64_t k_words,
                                           const int32_t* col_term, int64_t col_begin, int64_t tiles, int32_t* dots,
                                           int64_t stride) {
  const int64_t tile_words = k_words * LaneWeightPlanes(kMix) * kLaneWordNibbles * kTileRows;
  int64_t t = 0;
  for (; t + kWidest <= tiles; t += kWidest) {
    MixedLaneOutputsAvx2<kMix, kWidest>(rows, lane_tiles + t * tile_words, k_words, col_term + t * kTileRows,
                                        col_begin + t * kTileRows, dots + t * kTileRows, stride);
  }
  if constexpr (kWidest > 1) {
    if (t < tiles) {
      MixedLaneStepsAvx2<kMix, kWidest / 2>(rows, lane_tiles + t * tile_words, k_words, col_term + t * kTileRows,
                                            col_begin + t * kTileRows, tiles - t, dots + t * kTileRows, stride);
    }
  }
}

// A tile chunk's 8 rows x 4 words, four registers of two rows each, as four registers of one word each, its 8 rows
// in order: an 8 x 4 transpose of unpacks, then one permutation a word.
JAXBNN_TARGET_AVX2 inline void TransposeChunkAvx2(const uint32_t* chunk, __m256i (&words)[4]) {
  const __m256i* rows = reinterpret_cast<const __m256i*>(chunk);
  const __m256i rows_01 = _mm256_loadu_si256(rows), rows_23 = _mm256_loadu_si256(rows + 1);
  const __m256i rows_45 = _mm256_loadu_si256(rows + 2), rows_67 = _mm256_loadu_si256(rows + 3);
  // words 0, 1 (low) and 2, 3 (high) of rows 0, 2 | 1, 3 and of rows 4, 6 | 5, 7
  const __m256i low_0123 = _mm256_unpacklo_epi32(rows_01, rows_23), high_0123 = _mm256_unpackhi_epi32(rows_01, rows_23);
  const __m256i low_4567 = _mm256_unpacklo_epi32(rows_45, rows_67), high_4567 = _mm256_unpackhi_epi32(rows_45, rows_67);
  // each word's rows in the order 0, 2, 4, 6, 1, 3, 5, 7
  const __m256i row_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  words[0] = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(low_0123, low_4567), row_order);
  words[1] = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(low_0123, low_4567), row_order);
  words[2] = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(high_0123, high_4567), row_order);
  words[3] = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(high_0123, high_4567), row_order);
}

// Word k of a tile row's 8 columns is word k % 4 of each row of tile chunk k / 4.
template <Mix kMix>
JAXBNN_TARGET_AVX2 void MixedLaneTilesAvx2(const MixedWeights& w, int64_t tiles, int64_t k_words, uint32_t* lanes) {
  constexpr int kPlanes = LaneWeightPlanes(kMix);
  const __m256i low_nibbles = _mm256_set1_epi32(static_cast<int>(kLowNibbles));
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t j = 0; j < w.chunks; ++j) {
      const int64_t at = (t * w.chunks + j) * kTileChunkWords;
      __m256i nonneg[4], pos[4];
      TransposeChunkAvx2(w.nonneg + at, nonneg);
      if constexpr (TernaryWeights(kMix)) TransposeChunkAvx2(w.pos + at, pos);
      for (int64_t i = 0; i < kChunkWords && j * kChunkWords + i < k_words; ++i) {
        const int64_t k = j * kChunkWords + i;
        __m256i planes[2] = {nonneg[i], nonneg[i]};
        if constexpr (TernaryWeights(kMix)) {
          // z_w = NOT (nonneg XOR pos), masked to the reduction
          planes[0] = _mm256_andnot_si256(_mm256_xor_si256(nonneg[i], pos[i]),
                                          _mm256_set1_epi32(static_cast<int>(w.mask[k])));
          planes[1] = pos[i];
        }
        __m256i* out = reinterpret_cast<__m256i*>(lanes + (t * k_words + k) * kPlanes * kLaneWordNibbles * kTileRows);
#pragma GCC unroll 2
        for (int p = 0; p < kPlanes; ++p) {
          _mm256_storeu_si256(out + 2 * p, _mm256_and_si256(planes[p], low_nibbles));
          _mm256_storeu_si256(out + 2 * p + 1, _mm256_and_si256(_mm256_srli_epi32(planes[p], 4), low_nibbles));
        }
      }
    }
  }
}

template <Mix kMix>
JAXBNN_TARGET_AVX2 void MixedLaneAvx2(const LaneRows& rows, const uint32_t* lane_tiles, int64_t k_words,
                                      const int32_t* col_term, int64_t col_begin, int64_t tiles, int32_t* dots,
                                      int64_t stride) {
  MixedLaneStepsAvx2<kMix, 4>(rows, lane_tiles, k_words, col_term, col_begin, tiles, dots, stride);
}

// GCC 12 reports its own _mm512_undefined_* placeholders (inside the narrowing intrinsics) as maybe
// uninitialized; they are do-not-care lanes by design.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// VPTERNLOGQ truth tables, operands (A, B, C): (A ^ B) & C, ~(A ^ B) & C and A & (B ^ C).
constexpr int kXorAnd = 0x28;
constexpr int kXnorAnd = 0x82;
constexpr int kAndXor = 0x60;

// The 64-bit half `half` of an 8-row tile chunk as one register of 8 columns x 64 bits, columns in the
// order 0, 4, 1, 5, 2, 6, 3, 7 (in-lane unpacks need no index registers).
JAXBNN_TARGET_AVX512 inline __m512i TileHalf(const uint32_t* chunk, int half) {
  const __m512i rows_0_3 = _mm512_loadu_si512(chunk);
  const __m512i rows_4_7 = _mm512_loadu_si512(chunk + 16);
  return half == 0 ? _mm512_unpacklo_epi64(rows_0_3, rows_4_7) : _mm512_unpackhi_epi64(rows_0_3, rows_4_7);
}

JAXBNN_TARGET_AVX512 inline __m512i Broadcast64(const uint32_t* p) {
  return _mm512_set1_epi64(static_cast<long long>(Load64(p)));
}

// AVX-512 VPOPCNTDQ, one register block: kRows panel rows x one tile row (8 output columns), one accumulator
// lane per output column (TNN has two). Per 64-bit half of a chunk the tile's weight registers are formed
// once (b_w and z_w, or the bits) for all rows; a gated term is then one VPTERNLOGQ (each panel word is
// used once: its broadcast is a load, not a vector operation), one VPOPCNTQ and one add, and TNN's
// z_x & z_w one AND, one VPOPCNTQ and one add more (its gated XOR reuses that AND). One tile row at a time:
// the kernels measured no faster with two (8 rows x 16 columns), and broadcasts used twice become register
// copies.
template <Mix kMix, int kRows>
JAXBNN_TARGET_AVX512 void MixedBlockAvx512(const uint32_t* group, int64_t group_words, const MixedWeights& w,
                                           int64_t chunks, const int32_t* row_term, int32_t* dots, int64_t stride) {
  constexpr int kPlanes = PanelPlanes(kMix);
  constexpr bool kPlus = kMix == Mix::kTnn;
  __m512i gated[kRows], plus[kPlus ? kRows : 1];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    gated[r] = _mm512_setzero_si512();
    if constexpr (kPlus) plus[r] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t at = j * kTileChunkWords;
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m512i sign, gate;  // TBN: sign = the weight bits, no gate
      if constexpr (TernaryWeights(kMix)) {
        sign = TileHalf(w.pos + at, half);
        gate = _mm512_ternarylogic_epi64(TileHalf(w.nonneg + at, half), sign,
                                         Broadcast64(w.mask + j * kChunkWords + 2 * half), kXnorAnd);
      } else {
        sign = TileHalf(w.nonneg + at, half);
      }
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const uint32_t* xr = group + (r / kGroupRows) * group_words + j * GroupChunkWords<kMix>() +
                             (r % kGroupRows) * kPlanes * kChunkWords + 2 * half;
        __m512i bits;
        if constexpr (kMix == Mix::kTnn) {
          const __m512i both = _mm512_and_si512(gate, Broadcast64(xr + kChunkWords));
          plus[r] = _mm512_add_epi64(plus[r], _mm512_popcnt_epi64(both));
          bits = _mm512_ternarylogic_epi64(both, sign, Broadcast64(xr), kAndXor);
        } else if constexpr (kMix == Mix::kTbn) {
          bits = _mm512_ternarylogic_epi64(Broadcast64(xr), sign, Broadcast64(xr + kChunkWords), kXorAnd);
        } else {
          bits = _mm512_ternarylogic_epi64(Broadcast64(xr), sign, gate, kXorAnd);
        }
        gated[r] = _mm512_add_epi64(gated[r], _mm512_popcnt_epi64(bits));
      }
    }
  }
  const __m256i column_order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i col_term = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.col_term));
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    __m512i terms = _mm512_add_epi64(gated[r], gated[r]);
    if constexpr (kPlus) terms = _mm512_sub_epi64(terms, plus[r]);
    const __m256i base = _mm256_add_epi32(_mm256_set1_epi32(row_term[r]), col_term);
    const __m256i counts = _mm256_permutevar8x32_epi32(_mm512_cvtepi64_epi32(terms), column_order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + r * stride), _mm256_sub_epi32(base, counts));
  }
}

// A register block holds 16 accumulators: 16 rows, or 8 for TNN (two per column).
template <Mix kMix>
constexpr int BlockRows() {
  return kMix == Mix::kTnn ? 8 : 16;
}

template <Mix kMix, int kRows>
void BlockOfRows(int64_t rows, const uint32_t* group, int64_t group_words, const MixedWeights& w, int64_t chunks,
                 const int32_t* row_term, int32_t* out, int64_t stride) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return MixedBlockAvx512<kMix, kRows>(group, group_words, w, chunks, row_term, out, stride);
    BlockOfRows<kMix, kRows - 1>(rows, group, group_words, w, chunks, row_term, out, stride);
  }
}

// One tile row at a time, swept over every row block of the panel while its weights are hot in L1 (a block
// of more than 8 rows spans consecutive 8-row groups).
template <Mix kMix>
void MixedAvx512(const MixedPanel& panel, const MixedWeights& w, int64_t tiles, int32_t* dots, int64_t stride) {
  constexpr int kRows = BlockRows<kMix>();
  const int64_t group_words = panel.chunks * GroupChunkWords<kMix>();
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t offset = t * panel.chunks * kTileChunkWords;
    const MixedWeights tile{w.nonneg + offset, w.pos == nullptr ? nullptr : w.pos + offset, w.chunks, w.mask,
                            w.col_term + t * kTileRows};
    for (int64_t first = 0; first < panel.rows; first += kRows) {
      BlockOfRows<kMix, kRows>(std::min<int64_t>(kRows, panel.rows - first),
                               panel.data + (first / kGroupRows) * group_words, group_words, tile, panel.chunks,
                               panel.row_term + first, dots + first * stride + t * kTileRows, stride);
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // JAXBNN_X86

template <Mix kMix>
MixedDotsFn TierFor(Isa isa) {
  switch (isa) {
#ifdef JAXBNN_X86
    case Isa::kAvx512: return MixedAvx512<kMix>;
    case Isa::kAvx2: return MixedAvx2<kMix>;
    case Isa::kPopcnt: return MixedPopcnt<kMix>;
#endif
    default: return MixedGeneric<kMix>;
  }
}

template <Mix kMix>
MixedLaneTier LaneTierFor(Isa isa) {
#ifdef JAXBNN_X86
  if (isa == Isa::kAvx2) return {MixedLaneAvx2<kMix>, MixedLaneTilesAvx2<kMix>};
#endif
  (void)isa;
  return {nullptr, nullptr};
}

}  // namespace

MixedDotsFn MixedDotsFor(Mix mix, Isa isa) {
  switch (mix) {
    case Mix::kTnn: return TierFor<Mix::kTnn>(isa);
    case Mix::kTbn: return TierFor<Mix::kTbn>(isa);
    case Mix::kBtn: return TierFor<Mix::kBtn>(isa);
  }
  return TierFor<Mix::kTnn>(isa);
}

MixedLaneTier MixedLaneTierFor(Mix mix, Isa isa) {
  switch (mix) {
    case Mix::kTnn: return LaneTierFor<Mix::kTnn>(isa);
    case Mix::kTbn: return LaneTierFor<Mix::kTbn>(isa);
    case Mix::kBtn: return LaneTierFor<Mix::kBtn>(isa);
  }
  return {nullptr, nullptr};
}

}  // namespace jaxbnn::cpu

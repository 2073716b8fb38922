// What the binary and the ternary panel kernels (popcount_kernels.cc, ternary_dots.cc) share: the words of
// a tile chunk, the instruction-set tiers' target attributes, and the AVX2 tier's byte popcount.
//
// Each tier is compiled for its ISA with __attribute__((target(...))) on its own functions only (not
// per-file flags), so no shared inline code is ever emitted with instructions the running CPU lacks; the
// tier is picked at run time (popcount_kernels.h, ActiveIsa).
#ifndef JAXBNN_XLA_FFI_CPU_PANEL_WORDS_H_
#define JAXBNN_XLA_FFI_CPU_PANEL_WORDS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define JAXBNN_X86 1
#include <immintrin.h>
#define JAXBNN_TARGET_POPCNT __attribute__((target("popcnt")))
#define JAXBNN_TARGET_AVX2 __attribute__((target("avx2,popcnt")))
#define JAXBNN_TARGET_AVX512 __attribute__((target("avx512f,avx512vpopcntdq,popcnt")))
#endif

namespace jaxbnn::cpu::panel_words {

inline constexpr int kTileRows = 8;
inline constexpr int kChunkWords = 4;
inline constexpr int kTileChunkWords = kTileRows * kChunkWords;  // 32 words = one 8 x 128-bit tile

inline uint64_t Load64(const uint32_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#ifdef JAXBNN_X86
// AVX2 has no vector popcount: bytes are counted with the nibble lookup table (pshufb); callers sum them in
// byte lanes, then into 64-bit lanes with psadbw.
JAXBNN_TARGET_AVX2 inline __m256i ByteCountsAvx2(__m256i v) {
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3,
                                         1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  __m256i low = _mm256_and_si256(v, low_nibbles);
  __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
  return _mm256_add_epi8(_mm256_shuffle_epi8(table, low), _mm256_shuffle_epi8(table, high));
}

// Byte counts are summed in byte lanes over at most this many chunks (each adds at most 8 to a byte: 31 * 8 =
// 248 cannot wrap), then into 64-bit lanes with psadbw: per 256 bits the two lookups and their adds, not a
// psadbw and a 64-bit add each as well.
inline constexpr int64_t kAvx2ByteChunks = 31;

// The eight column sums of a tile row from 64-bit lane sums in the order [c0, c2, c1, c3] (low) and
// [c4, c6, c5, c7] (high), as 32-bit lanes in column order (every sum fits 32 bits).
JAXBNN_TARGET_AVX2 inline __m256i PairedColumnSumsAvx2(__m256i low, __m256i high) {
  // 32-bit lanes [c0, c4, c2, c6, c1, c5, c3, c7], then in column order
  const __m256i both = _mm256_blend_epi32(low, _mm256_slli_epi64(high, 32), 0xaa);
  return _mm256_permutevar8x32_epi32(both, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7));
}

// The eight column sums of a tile row from the 64-bit lane sums of its four registers (register q: lanes 0, 1
// column 2q, lanes 2, 3 column 2q + 1), as 32-bit lanes in column order.
JAXBNN_TARGET_AVX2 inline __m256i ColumnSumsAvx2(const __m256i (&total)[4]) {
  return PairedColumnSumsAvx2(
      _mm256_add_epi64(_mm256_unpacklo_epi64(total[0], total[1]), _mm256_unpackhi_epi64(total[0], total[1])),
      _mm256_add_epi64(_mm256_unpacklo_epi64(total[2], total[3]), _mm256_unpackhi_epi64(total[2], total[3])));
}

// Byte counts summed in the byte lanes of a tile row's four registers over at most this many chunks can be
// folded pairwise (PairColumnBytesAvx2) and take a half chunk's counts without wrapping: 2 * 15 * 8 + 8 = 248.
inline constexpr int64_t kAvx2PairedChunks = 15;

// A tile row's four byte-count registers folded into two in byte lanes, 8 bytes a column: [c0, c2 | c1, c3]
// (low) and [c4, c6 | c5, c7] (high), so that two psadbw give the sums PairedColumnSumsAvx2 takes.
JAXBNN_TARGET_AVX2 inline void PairColumnBytesAvx2(const __m256i (&bytes)[4], __m256i& low, __m256i& high) {
  low = _mm256_add_epi8(_mm256_unpacklo_epi64(bytes[0], bytes[1]), _mm256_unpackhi_epi64(bytes[0], bytes[1]));
  high = _mm256_add_epi8(_mm256_unpacklo_epi64(bytes[2], bytes[3]), _mm256_unpackhi_epi64(bytes[2], bytes[3]));
}

// The outputs of a lane kernel's kTiles tile rows (popcount_kernels.h, LaneDotsFn; ternary_dots.h, MixedLaneDotsFn):
// row_dots(r, dots) sets the dots of reduction row r; each run of `window` rows is max-pooled in registers, output
// row o stored at dots + o * stride.
template <int kTiles, class RowDots>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void PoolLaneRowsAvx2(int64_t rows, int64_t window,
                                                                                const RowDots& row_dots,
                                                                                int32_t* dots, int64_t stride) {
  for (int64_t first = 0, o = 0; first < rows; first += window, ++o) {
    __m256i pooled[kTiles], next[kTiles];
    row_dots(first, pooled);
    for (int64_t r = first + 1; r < first + window; ++r) {
      row_dots(r, next);
#pragma GCC unroll 8
      for (int u = 0; u < kTiles; ++u) pooled[u] = _mm256_max_epi32(pooled[u], next[u]);
    }
#pragma GCC unroll 8
    for (int u = 0; u < kTiles; ++u) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + o * stride + u * kTileRows), pooled[u]);
    }
  }
}

// A lane kernel's long reduction is counted block by block over runs of about this many rows (whole windows),
// so that a block's weights stay in L1 while the run's rows pass.
inline constexpr int64_t kLaneRunRows = 64;

// This thread's scratch of at least `size` int32 (the blocked lane kernels' partial counts), kept from call to call.
inline int32_t* LanePartialCounts(int64_t size) {
  thread_local std::vector<int32_t> storage;
  if (static_cast<int64_t>(storage.size()) < size) storage.resize(size);
  return storage.data();
}

// The outputs of a lane kernel's kTiles tile rows over a reduction of k_words words counted `block_words` at a
// time: count(r, begin, end, counts) sets row r's counts of words [begin, end); they are summed in
// LanePartialCounts over a run of rows, block after block, then dots_of(r, counts, dots) makes row r's dots from
// its total counts, and the run's windows are pooled (PoolLaneRowsAvx2).
template <int kTiles, class Count, class DotsOf>
JAXBNN_TARGET_AVX2 inline __attribute__((always_inline)) void BlockedLaneRowsAvx2(int64_t rows, int64_t window,
                                                                                   int64_t k_words,
                                                                                   int64_t block_words,
                                                                                   const Count& count,
                                                                                   const DotsOf& dots_of,
                                                                                   int32_t* dots, int64_t stride) {
  const int64_t run_rows = std::max<int64_t>(1, kLaneRunRows / window) * window;
  int32_t* const partial = LanePartialCounts(std::min(run_rows, rows) * kTiles * kTileRows);
  for (int64_t first = 0; first < rows; first += run_rows) {
    const int64_t end = std::min(rows, first + run_rows);
    for (int64_t begin = 0; begin < k_words; begin += block_words) {
      for (int64_t r = first; r < end; ++r) {
        __m256i counts[kTiles];
        count(r, begin, std::min(k_words, begin + block_words), counts);
        auto* sums = reinterpret_cast<__m256i*>(partial + (r - first) * kTiles * kTileRows);
#pragma GCC unroll 8
        for (int u = 0; u < kTiles; ++u) {
          if (begin > 0) counts[u] = _mm256_add_epi32(counts[u], _mm256_loadu_si256(sums + u));
          _mm256_storeu_si256(sums + u, counts[u]);
        }
      }
    }
    const auto row_dots = [&](int64_t r, __m256i (&row)[kTiles]) JAXBNN_TARGET_AVX2 __attribute__((always_inline)) {
      __m256i counts[kTiles];
      const auto* sums = reinterpret_cast<const __m256i*>(partial + r * kTiles * kTileRows);
#pragma GCC unroll 8
      for (int u = 0; u < kTiles; ++u) counts[u] = _mm256_loadu_si256(sums + u);
      dots_of(first + r, counts, row);
    };
    PoolLaneRowsAvx2<kTiles>(end - first, window, row_dots, dots + first / window * stride, stride);
  }
}
#endif

}  // namespace jaxbnn::cpu::panel_words

#endif  // JAXBNN_XLA_FFI_CPU_PANEL_WORDS_H_
